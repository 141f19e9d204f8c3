"""Build strata's embedded demo checkpoint: a tiny random Qwen3-Next model.

Writes config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json and README.md in Hugging Face layout (experts stored per
expert, as transformers saves them), then loads the folder back with
transformers and mlx-lm to check it. Same command, same files.

Examples:

    python scripts/make_demo_model.py
    python scripts/make_demo_model.py --out /tmp/demo --seed 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tokenizer import (  # noqa: E402
    check_round_trip,
    stdlib_files,
    train_tokenizer,
)

DEFAULT_OUT = Path("strata_cli/assets/demo")
DEFAULT_SEED = 0
TOKENIZER_BYTES = 4_000_000
MAX_FOLDER_BYTES = 10_000_000
OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
PROMPTS = (
    "def main():\n",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self, text):\n",
    "# Copyright",
    'print("hello, world")\n',
)
NUM_GREEDY_TOKENS = 64
MIN_LOGIT_STD = 1.5


def build_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
    )


def init_weights(model: nn.Module, *, seed: int) -> None:
    """Replace HF's std-0.02 init with one whose logits are far from flat.

    Matrices get std 1/sqrt(fan_in) so each layer keeps the residual scale;
    lm_head and the router get 2/sqrt(hidden), so the logits have a std of
    about 2 and routing is not uniform. Zero-centred RMSNorm weights (HF
    applies 1 + w) get small noise, the gated RMSNorm (applied as is) stays
    near 1, and A_log and dt_bias keep HF's init.
    """
    g = torch.Generator().manual_seed(seed)
    lm_head = model.get_output_embeddings()

    def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        nn.init.normal_(t, mean=mean, std=std, generator=g)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                normal_(module.weight, 1.0)
            elif isinstance(module, (nn.Linear, nn.Conv1d)):
                gain = 2.0 if module is lm_head else 1.0
                normal_(module.weight, gain / math.sqrt(module.weight[0].numel()))
            elif isinstance(module, hf.Qwen3NextExperts):
                for w in (module.gate_up_proj, module.down_proj):  # (E, out, in)
                    normal_(w, 1 / math.sqrt(w.shape[-1]))
            elif isinstance(module, hf.Qwen3NextTopKRouter):
                normal_(module.weight, 2 / math.sqrt(module.hidden_dim))
            elif isinstance(module, hf.Qwen3NextRMSNorm):
                normal_(module.weight, 0.1)
                # Multiples of 2**-7 keep 1 + w exact in bfloat16, so loaders
                # that add the 1 after loading (mlx-lm's sanitize) agree with HF.
                module.weight.mul_(128).round_().div_(128)
            elif isinstance(module, hf.Qwen3NextRMSNormGated):
                normal_(module.weight, 0.1, mean=1.0)


def save(model: nn.Module, out: Path, *, seed: int) -> None:
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    # mlx-lm's qwen3_next reads rope_theta and partial_rotary_factor at the top
    # level; transformers 5 nests them in rope_parameters and accepts both.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["partial_rotary_factor"] = config["rope_parameters"]["partial_rotary_factor"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    train_tokenizer(
        stdlib_files(TOKENIZER_BYTES), vocab_size=config["vocab_size"], out_dir=out
    )
    num_params = sum(p.numel() for p in model.parameters())
    (out / "README.md").write_text(model_card(config, num_params, seed))


def model_card(config: dict, num_params: int, seed: int) -> str:
    seed_arg = "" if seed == DEFAULT_SEED else f" --seed {seed}"
    py = ".".join(map(str, sys.version_info[:2]))
    return f"""# strata demo model

**RANDOM WEIGHTS.** This checkpoint is untrained: its output is gibberish. It
exists so that `strata` runs out of the box and so tests have a real
Qwen3-Next-shaped checkpoint. A later issue replaces it with a trained one.

- architecture: `Qwen3NextForCausalLM` (`model_type` `qwen3_next`): 4 layers
  (3 Gated DeltaNet linear-attention layers, then 1 full-attention layer),
  each with a sparse MoE block (top {config["num_experts_per_tok"]} of {config["num_experts"]} experts) plus a shared expert
- parameters: {num_params:,} ({num_params * 2 / 1e6:.1f} MB in bfloat16)
- tokenizer: byte-level BPE, vocab {config["vocab_size"]}, trained on about {TOKENIZER_BYTES / 1e6:.0f} MB
  of the Python {py} standard library; `<|endoftext|>` (id 0) is EOS and pad,
  there is no BOS
- init: seed {seed}; normal with std 1/sqrt(fan_in) for matrices, 1 for
  embeddings, 2/sqrt(hidden) for lm_head and the router, 0.1 for the
  zero-centred RMSNorm offsets (rounded to multiples of 1/128, so that 1 + w
  is exact in bfloat16), 1 ± 0.1 for the gated norm; A_log and dt_bias
  as transformers initializes them. So the logits are not flat (std about 2)
- layout: Hugging Face; experts are stored per expert as
  `model.layers.N.mlp.experts.E.{{gate,up,down}}_proj.weight`

Made with (from the repository root):

    python scripts/make_demo_model.py{seed_arg}

The tokenizer depends on the Python version's standard library, so the files
are reproducible byte for byte only with the same Python and library versions.

Notes for loaders: `config.json` repeats `rope_theta` and
`partial_rotary_factor` at the top level (mlx-lm reads them there; transformers
5 reads `rope_parameters`). MLX's CPU backend runs `gather_mm`, which the MoE
layers use, only in float32, so cast the weights to float32 there.

## config.json

```json
{json.dumps(config, indent=2, sort_keys=True)}
```
"""


def greedy_hf(
    model: nn.Module, ids: list[int], num_tokens: int
) -> tuple[list[int], float]:
    """Greedy tokens by uncached full forward passes, and the first step's logit std."""
    ids = list(ids)
    first_std = math.nan
    with torch.no_grad():
        for step in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            if not torch.isfinite(logits).all():
                raise ValueError(f"non-finite logits at step {step}")
            if step == 0:
                first_std = logits.std().item()
            ids.append(int(logits.argmax()))
    return ids[-num_tokens:], first_std


def load_mlx(path: Path):
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    return model


def greedy_mlx(model, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens through mlx-lm's cached generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(ids), model, max_tokens=num_tokens)
    return [int(token) for token, _ in steps]


def verify(out: Path) -> None:
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    for p in sorted(out.iterdir()):
        print(f"  {p.name:24s} {p.stat().st_size:>10,d} B  {sha256(p)[:16]}")
    print(f"folder size {size / 1e6:.2f} MB")
    assert size <= MAX_FOLDER_BYTES, f"{out} is {size} bytes, over {MAX_FOLDER_BYTES}"

    check_round_trip(out, stdlib_files()[::150])
    model, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    bad_keys = {k: v for k, v in info.items() if v}
    assert not bad_keys, f"loading {out} reported {bad_keys}"
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(out)

    mlx_model = load_mlx(out)

    stds = []
    for prompt in tqdm(PROMPTS, desc="greedy decoding", file=sys.stderr):
        ids = tokenizer.encode(prompt)
        tokens, std = greedy_hf(model, ids, NUM_GREEDY_TOKENS)
        mlx_tokens = greedy_mlx(mlx_model, ids, NUM_GREEDY_TOKENS)
        mismatches = (i for i, (a, b) in enumerate(zip(tokens, mlx_tokens)) if a != b)
        agree = next(mismatches, len(tokens))
        stds.append(std)
        tqdm.write(
            f"  {prompt!r}: logit std {std:.2f}, {len(set(tokens))} distinct tokens, "
            f"mlx-lm agrees on the first {agree}/{len(tokens)}\n"
            f"    -> {tokenizer.decode(tokens)!r}"
        )
    assert min(stds) >= MIN_LOGIT_STD, f"logits too flat: stds {stds}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}"
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"default: {DEFAULT_SEED}"
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(build_config())
    init_weights(model, seed=args.seed)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, args.out, seed=args.seed)
    verify(args.out)


if __name__ == "__main__":
    main()
