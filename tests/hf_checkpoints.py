"""Tiny random checkpoints of each supported family, written by transformers and mlx-lm, offline.

Used by the parity and convert tests. Everything is built once per test session under one root
(`checkpoint_root(tmp_path_factory)`) and reused; seeds are fixed, so the files are deterministic.

Weight scales: matrices get std 1/sqrt(fan_in), the residual-branch outputs half that (so float32
noise does not grow layer by layer), the routers 3/sqrt(hidden) (decisive top-k, so float rounding
does not flip an expert), lm_head 2/sqrt(hidden) (logits with a std of about 2, far from flat).
Qwen3-MoE ties lm_head to the embedding (as the small Qwen3 models do), which then gets that std.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import textwrap
from pathlib import Path

FAMILIES = ("qwen3_next", "qwen3_moe", "mixtral")
VOCAB = 512
SEED = 0
RESIDUAL_GAIN = 0.5
ROUTER_GAIN = 3.0
HEAD_GAIN = 2.0
SHARD_SIZE = "60KB"  # small, so every checkpoint is sharded and read through its index
_built: dict[tuple, Path] = {}


def checkpoint_root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "checkpoints"


PROMPT_CODE = '''def moving_average(values, window):
    """Return the mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    totals, current = [], 0.0
    for i, value in enumerate(values):
        current += value
    return totals
'''


def prompt_text() -> str:
    """Code whose tail repeats its first lines, so the suffix drafter proposes from the start."""
    return PROMPT_CODE + "\n\n" + "".join(PROMPT_CODE.splitlines(keepends=True)[:3]).rstrip()


def tokenizer_dir(root: Path) -> Path:
    def build(out: Path) -> None:
        import argparse
        import difflib

        from scripts.train.build_tokenizer import train_tokenizer

        files = [Path(m.__file__) for m in (textwrap, inspect, json, argparse, difflib)]
        train_tokenizer(files, vocab_size=VOCAB, out_dir=out)

    return _once(root / "tokenizer", ("tokenizer",), build)


def hf_config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3NextConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                  num_experts_per_tok=2, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    if family == "qwen3_next":
        return Qwen3NextConfig(
            **common, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, norm_topk_prob=True,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, intermediate_size=128,
            tie_word_embeddings=False,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, moe_intermediate_size=64, intermediate_size=128, mlp_only_layers=[1],
            norm_topk_prob=True, rope_theta=10000.0, tie_word_embeddings=True,
        )
    if family == "mixtral":
        return MixtralConfig(
            **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, intermediate_size=64, rope_theta=1e6, tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}")


def init_weights(model, family: str, *, seed: int = SEED) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # transformers' own initialisation
            if name.endswith("norm.weight"):
                zero_centred = family == "qwen3_next" and "linear_attn.norm" not in name
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (0.0 if zero_centred else 1.0))
                continue
            if "embed_tokens" in name:
                std = HEAD_GAIN / math.sqrt(hidden) if model.config.tie_word_embeddings else 1.0
            elif name.startswith("lm_head"):
                std = HEAD_GAIN / math.sqrt(hidden)
            elif name.endswith("mlp.gate.weight"):  # the routers
                std = ROUTER_GAIN / math.sqrt(hidden)
            else:
                gain = RESIDUAL_GAIN if any(s in name for s in ("o_proj", "down_proj", "out_proj")) else 1.0
                std = gain / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g) * std)


def hf_model(family: str):
    """The transformers model behind `hf_checkpoint(family)`, float32, in eval mode (cached)."""
    key = ("hf_model", family)
    if key not in _built:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
        init_weights(model, family)
        _built[key] = model.eval()
    return _built[key]


def hf_checkpoint(root: Path, family: str) -> Path:
    """A sharded Hugging Face checkpoint exactly as transformers saves it, plus the tokenizer.

    transformers 5 nests rope_theta (and partial_rotary_factor) in `rope_parameters` and names
    Qwen3-MoE's expert count `num_local_experts`; strata reads that as it is.
    """

    def build(out: Path) -> None:
        hf_model(family).save_pretrained(out, max_shard_size=SHARD_SIZE)
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / f"hf-{family}", ("hf", family), build)


def _hf_checkpoint_for_mlx_lm(root: Path, family: str) -> Path:
    """mlx-lm 0.32 reads these keys at the top level, as the published checkpoints carry them."""

    def build(out: Path) -> None:
        shutil.copytree(hf_checkpoint(root, family), out)
        config = json.loads((out / "config.json").read_text())
        rope = config["rope_parameters"]
        config["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if family == "qwen3_moe":
            config["num_experts"] = config["num_local_experts"]
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return _once(root / f"hf-{family}-for-mlx-lm", ("hf for mlx-lm", family), build)


def fused_checkpoint(root: Path, family: str) -> Path:
    """The model's in-memory state dict as is: transformers 5 fuses experts into
    `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I)."""

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir()
        model = hf_model(family)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]  # the embedding itself
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, out / "model.safetensors")
        src = hf_checkpoint(root, family)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)

    return _once(root / f"fused-{family}", ("fused", family), build)


def mlx_checkpoint(root: Path, family: str, bits: int | None) -> Path:
    """The same checkpoint converted by mlx-lm: affine `bits`-bit with group size 64, or unquantized."""

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=64) if bits else {}
        convert(str(_hf_checkpoint_for_mlx_lm(root, family)), str(out), **quantized)

    name = f"mlx-{family}-" + (f"q{bits}" if bits else "float32")
    return _once(root / name, ("mlx", family, bits), build)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


def _once(path: Path, key: tuple, build) -> Path:
    if key not in _built or _built[key] != path:
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path)
        _built[key] = path
    return path
