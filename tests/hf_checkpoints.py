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


# -- the Mamba-2 hybrids (issue 33): Nemotron-H and Granite-4.0-H ---------------------------------

HYBRID_FAMILIES = ("nemotron_h", "granitemoehybrid")
DT_GAIN = 0.3  # the dt rows of in_proj: dt = softplus(dt + dt_bias) stays inside [0.003, 0.3]


def hybrid_hf_config(family: str, **overrides):
    """A tiny config of each Mamba-2 hybrid: every block kind, groups of B/C heads (Nemotron-H),
    group routing, multipliers and tied embeddings (Granite), dims multiples of 64 (so mlx-lm
    quantizes every matrix at group size 64)."""
    from transformers import GraniteMoeHybridConfig, NemotronHConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None,
                  bos_token_id=None)
    if family == "nemotron_h":
        params = dict(common, hybrid_override_pattern="ME*M-E", head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                      ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=8, n_group=2, topk_group=1,
                      moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, intermediate_size=128,
                      routed_scaling_factor=2.5, layer_norm_epsilon=1e-5, tie_word_embeddings=False)
        return NemotronHConfig(**{**params, **overrides})
    if family == "granitemoehybrid":
        params = dict(common, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                      num_local_experts=4, intermediate_size=64, shared_intermediate_size=64, mamba_n_heads=4,
                      mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
                      embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.0625,
                      logits_scaling=2.0, position_embedding_type="nope", tie_word_embeddings=True,
                      rms_norm_eps=1e-6)
        return GraniteMoeHybridConfig(**{**params, **overrides})
    raise ValueError(f"unknown hybrid family {family!r}")


def init_hybrid_weights(model, *, seed: int = SEED) -> None:
    """The module docstring's scales, plus the Mamba-2 parameters: A = -U(1, 8), dt_bias the
    inverse softplus of a log-uniform dt in [0.01, 0.1] (long memories, as the reference init
    gives, yet dt never reaches Nemotron-H's time_step_min), D near 1, and random routing biases."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    tied = model.config.tie_word_embeddings
    heads = getattr(model.config, "mamba_num_heads", None) or model.config.mamba_n_heads
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("A_log"):
                value = torch.log(torch.rand(p.shape, generator=g) * 7 + 1)
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=g) * math.log(10) + math.log(0.01))
                value = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                value = torch.randn(p.shape, generator=g) * 0.1 + 1.0
            elif name.endswith(("conv1d.bias", "e_score_correction_bias")):
                value = torch.randn(p.shape, generator=g) * 0.1
            elif "embed" in name:
                value = torch.randn(p.shape, generator=g) * (HEAD_GAIN / math.sqrt(hidden) if tied else 1.0)
            elif name.startswith("lm_head"):
                value = torch.randn(p.shape, generator=g) * HEAD_GAIN / math.sqrt(hidden)
            elif name.endswith(("mixer.gate.weight", "router.weight")):
                value = torch.randn(p.shape, generator=g) * ROUTER_GAIN / math.sqrt(hidden)
            elif p.ndim >= 2:
                gain = RESIDUAL_GAIN if any(s in name for s in ("o_proj", "down_proj", "out_proj", "output_linear")) else 1.0
                value = torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1])
                if name.endswith("in_proj.weight"):
                    value[-heads:] *= DT_GAIN  # the dt rows come last
            else:
                continue
            p.copy_(value)


def hybrid_hf_model(family: str, **overrides):
    """The transformers model behind `hybrid_hf_checkpoint(family)`, float32, eval mode (cached)."""
    key = ("hybrid_hf_model", family, repr(sorted(overrides.items())))
    if key not in _built:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(hybrid_hf_config(family, **overrides), dtype=torch.float32)
        init_hybrid_weights(model)
        _built[key] = model.eval()
    return _built[key]


def hybrid_hf_checkpoint(root: Path, family: str, variant: str = "", **overrides) -> Path:
    """A sharded Hugging Face checkpoint of `hybrid_hf_model(family, **overrides)` as transformers
    saves it (Nemotron-H: `backbone.*`, per-expert tensors; Granite: fused `input_linear`), plus
    the tokenizer; `variant` names a checkpoint built with `overrides`."""

    def build(out: Path) -> None:
        hybrid_hf_model(family, **overrides).save_pretrained(out, max_shard_size=SHARD_SIZE)
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / f"hf-{family}{variant}", ("hf", family, variant), build)


def hybrid_fused_checkpoint(root: Path, family: str) -> Path:
    """The model's in-memory state dict as is (`model.*`, fused `experts.*` tensors)."""

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir()
        model = hybrid_hf_model(family)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]
        save_file(state, out / "model.safetensors")
        src = hybrid_hf_checkpoint(root, family)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)

    return _once(root / f"fused-{family}", ("fused", family), build)


def hybrid_mlx_checkpoint(root: Path, family: str, bits: int | None) -> Path:
    """The same checkpoint converted by mlx-lm (affine `bits`-bit, group size 64, or unquantized).

    mlx-lm 0.32 cannot read two things transformers 5 writes, so its copy of config.json spells
    them as the published checkpoints do: `time_step_limit` as numbers (transformers writes
    infinity as {"__float__": "Infinity"}), and Granite's legacy layer names.
    """

    def source(out: Path) -> None:
        shutil.copytree(hybrid_hf_checkpoint(root, family), out)
        config = json.loads((out / "config.json").read_text())
        config["time_step_limit"] = [0.0, math.inf]
        if family == "granitemoehybrid":
            legacy = {"linear_attention": "mamba", "full_attention": "attention"}
            config["layer_types"] = [legacy[t] for t in config["layer_types"]]
        (out / "config.json").write_text(json.dumps(config, indent=2))

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=64) if bits else {}
        src = _once(root / f"hf-{family}-for-mlx-lm", ("hf for mlx-lm", family), source)
        convert(str(src), str(out), **quantized)

    name = f"mlx-{family}-" + (f"q{bits}" if bits else "float32")
    return _once(root / name, ("mlx", family, bits), build)


# -- Qwen3.5 / 3.6 (issue 33): dense `qwen3_5` and `qwen3_5_moe`, every layout they are published in ---

QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# transformers' save_pretrained of the multimodal model, of the text-only one, and the published
# layout (the multimodal model's own state dict: fused experts, plus MTP tensors transformers drops).
QWEN3_5_LAYOUTS = ("multimodal", "text", "published")
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      num_position_embeddings=16)


def qwen3_5_text_params(family: str) -> dict:
    """A tiny text config: the 3:1 rhythm, 8 value heads over 2 key heads, 16 rotary dims in
    interleaved mRoPE sections [3, 3, 2], dims multiples of 64 (mlx-lm quantizes every matrix)."""
    params = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                  num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, tie_word_embeddings=False, eos_token_id=None, pad_token_id=None,
                  bos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    if family == "qwen3_5":
        return dict(params, intermediate_size=128)
    if family == "qwen3_5_moe":
        return dict(params, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64)
    raise ValueError(f"unknown Qwen3.5 family {family!r}")


def qwen3_5_hf_model(family: str, layout: str = "multimodal"):
    """The transformers model behind a Qwen3.5 checkpoint, float32, eval mode (cached).

    "multimodal" is `Qwen3_5[Moe]ForConditionalGeneration` (a tiny vision tower included, as the
    published models carry one); "text" is `Qwen3_5[Moe]ForCausalLM` holding the very same
    language-model weights."""
    key = ("qwen3_5_hf_model", family, layout == "text")
    if key in _built:
        return _built[key]
    import torch
    import transformers

    prefix = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"
    text = qwen3_5_text_params(family)
    torch.manual_seed(SEED)
    if layout == "text":
        mm = qwen3_5_hf_model(family)
        model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}TextConfig")(**text))
        state = {k.replace("model.language_model.", "model."): v for k, v in mm.state_dict().items()
                 if not k.startswith("model.visual.")}
        model.load_state_dict(state)
    else:
        config = getattr(transformers, f"{prefix}Config")(text_config=text, vision_config=QWEN3_5_VISION,
                                                          tie_word_embeddings=False)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
        init_qwen3_5_weights(model)
    _built[key] = model.to(torch.float32).eval()
    return _built[key]


def init_qwen3_5_weights(model, *, seed: int = SEED) -> None:
    """The module docstring's scales; every RMSNorm but the GDN's gated one is zero-centred."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")) or ".visual." in f".{name}":
                continue  # transformers' own initialisation
            p.copy_(_qwen3_5_init(name, p.shape, hidden, g))


def _qwen3_5_init(name: str, shape, hidden: int, g):
    import torch

    if name.endswith("norm.weight"):
        return torch.randn(shape, generator=g) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0)
    if "embed_tokens" in name:
        std = 1.0
    elif name.startswith("lm_head"):
        std = HEAD_GAIN / math.sqrt(hidden)
    elif name.endswith("mlp.gate.weight"):  # the routers
        std = ROUTER_GAIN / math.sqrt(hidden)
    else:
        gain = RESIDUAL_GAIN if any(s in name for s in ("o_proj", "down_proj", "out_proj")) else 1.0
        std = gain / math.sqrt(shape[-1])
    return torch.randn(shape, generator=g) * std


def qwen3_5_mtp_tensors(family: str, *, seed: int = SEED + 1) -> dict:
    """Random MTP tensors as the published checkpoints name them (vLLM's Qwen3_5 MTP loader): `fc`,
    three zero-centred norms and one full-attention decoder layer, its experts stored per expert."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p = qwen3_5_text_params(family)
    H, D, I = p["hidden_size"], p["head_dim"], p.get("moe_intermediate_size", p.get("intermediate_size"))
    q, kv = p["num_attention_heads"] * D, p["num_key_value_heads"] * D
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
              "mtp.pre_fc_norm_embedding.weight": (H,)}
    layer = "mtp.layers.0"
    shapes.update({f"{layer}.input_layernorm.weight": (H,), f"{layer}.post_attention_layernorm.weight": (H,),
                   f"{layer}.self_attn.q_proj.weight": (2 * q, H), f"{layer}.self_attn.k_proj.weight": (kv, H),
                   f"{layer}.self_attn.v_proj.weight": (kv, H), f"{layer}.self_attn.o_proj.weight": (H, q),
                   f"{layer}.self_attn.q_norm.weight": (D,), f"{layer}.self_attn.k_norm.weight": (D,)})
    if family == "qwen3_5_moe":
        E = p["num_experts"]
        shapes[f"{layer}.mlp.gate.weight"] = (E, H)
        for e in range(E):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                shapes[f"{layer}.mlp.experts.{e}.{proj}.weight"] = shape
        S = p["shared_expert_intermediate_size"]
        shapes.update({f"{layer}.mlp.shared_expert.gate_proj.weight": (S, H),
                       f"{layer}.mlp.shared_expert.up_proj.weight": (S, H),
                       f"{layer}.mlp.shared_expert.down_proj.weight": (H, S),
                       f"{layer}.mlp.shared_expert_gate.weight": (1, H)})
    else:
        shapes.update({f"{layer}.mlp.gate_proj.weight": (I, H), f"{layer}.mlp.up_proj.weight": (I, H),
                       f"{layer}.mlp.down_proj.weight": (H, I)})
    return {name: _qwen3_5_init(name, shape, H, g).contiguous() for name, shape in shapes.items()}


def qwen3_5_checkpoint(root: Path, family: str, layout: str) -> Path:
    """A Qwen3.5 checkpoint in one of QWEN3_5_LAYOUTS, plus the tokenizer.

    - "multimodal": `Qwen3_5[Moe]ForConditionalGeneration.save_pretrained` (sharded; `text_config` +
      `vision_config`; `model.language_model.*`, `model.visual.*`; experts per expert);
    - "text": `Qwen3_5[Moe]ForCausalLM.save_pretrained` (`model_type` `qwen3_5[_moe]_text`, `model.*`);
    - "published": what Qwen publishes: the multimodal state dict as the model holds it (fused
      `experts.gate_up_proj` / `down_proj`), plus `mtp.*` and `mtp_num_hidden_layers: 1` in text_config.
    """

    def build(out: Path) -> None:
        model = qwen3_5_hf_model(family, layout)
        if layout != "published":
            model.save_pretrained(out, max_shard_size=SHARD_SIZE)
        else:
            from safetensors.torch import save_file

            out.mkdir()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            state.update(qwen3_5_mtp_tensors(family))
            save_file(state, out / "model.safetensors")
            model.config.save_pretrained(out)
            config = json.loads((out / "config.json").read_text())
            config["text_config"]["mtp_num_hidden_layers"] = 1
            (out / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / f"{layout}-{family}", ("qwen3_5", family, layout), build)


def qwen3_5_mlx_checkpoint(root: Path, family: str, bits: int | None) -> Path:
    """The published layout converted by mlx-lm (affine `bits`-bit, group size 64, or unquantized):
    `language_model.*`, no vision tower and no MTP (mlx-lm drops both), as mlx-community ships them.
    mlx-lm 0.32's qwen3_5_moe reads fused experts only, so it converts the published layout."""

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=64) if bits else {}
        convert(str(qwen3_5_checkpoint(root, family, "published")), str(out), **quantized)

    name = f"mlx-{family}-" + (f"q{bits}" if bits else "float32")
    return _once(root / name, ("qwen3_5 mlx", family, bits), build)


# -- GLM-4.5 / 4.6 / 4.7 MoE (issue 34): `glm4_moe` -----------------------------------------------

# transformers' save_pretrained (sharded, per-expert, config listing 1 MTP layer it does not hold),
# the in-memory state dict (fused experts), and the published layout (the save plus an MTP shard).
GLM_LAYOUTS = ("hf", "fused", "published")
GLM_VARIANTS = {"": {}, "-air": dict(use_qk_norm=False, n_group=1, topk_group=1, partial_rotary_factor=1.0)}


def glm_hf_config(variant: str = ""):
    """A tiny GLM-4.5: a dense first layer then two MoE layers of 8 experts (top-2 in 2 groups,
    scaling 2.5, one shared expert), q/k norm, q/k/v biases, head_dim 32 (not hidden / heads) with
    half of it rotary; dims multiples of 64, so mlx-lm quantizes every matrix. "-air" drops the
    q/k norm and the groups (GLM-4.5-Air's settings) and rotates whole heads."""
    from transformers import Glm4MoeConfig

    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                  moe_intermediate_size=64, num_experts_per_tok=2, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                  use_qk_norm=True, attention_bias=True, tie_word_embeddings=False, num_nextn_predict_layers=1,
                  eos_token_id=None, pad_token_id=None, bos_token_id=None)
    params.update(GLM_VARIANTS[variant])
    rotary = params.pop("partial_rotary_factor", 0.5)
    return Glm4MoeConfig(**params, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": rotary})


def glm_hf_model(variant: str = ""):
    """The transformers model behind the GLM checkpoints, float32, eval mode (cached): the module
    docstring's scales, and non-negative routing biases (mlx-lm masks dropped groups with 0, not
    -inf as transformers does; non-negative biased scores keep the two references one routing)."""
    key = ("glm_hf_model", variant)
    if key not in _built:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(glm_hf_config(variant), dtype=torch.float32)
        init_weights(model, "glm4_moe")
        g = torch.Generator().manual_seed(SEED + 2)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn(buffer.shape, generator=g).abs() * 0.1)
        _built[key] = model.eval()
    return _built[key]


def glm_mtp_tensors(*, seed: int = SEED + 1) -> dict:
    """Random tensors of one MTP layer as the published checkpoints name them (model.layers.3.*,
    after the 3 decoder layers): eh_proj, enorm, hnorm, shared_head.norm and a MoE decoder layer
    with per-expert tensors, the routing bias included; no embed_tokens / shared_head.head."""
    import torch

    g = torch.Generator().manual_seed(seed)
    config = glm_hf_config()
    H, E, I = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    D = config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    shapes = {"eh_proj.weight": (H, 2 * H), "enorm.weight": (H,), "hnorm.weight": (H,), "shared_head.norm.weight": (H,),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (q, H), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.weight": (kv, H),
              "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (H, q), "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
              "mlp.gate.weight": (E, H), "mlp.gate.e_score_correction_bias": (E,),
              "mlp.shared_experts.gate_proj.weight": (I, H), "mlp.shared_experts.up_proj.weight": (I, H),
              "mlp.shared_experts.down_proj.weight": (H, I)}
    for e in range(E):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (I, H), f"mlp.experts.{e}.up_proj.weight": (I, H),
                       f"mlp.experts.{e}.down_proj.weight": (H, I)})
    first = config.num_hidden_layers
    return {f"model.layers.{first}.{name}": (torch.randn(shape, generator=g) * 0.1).contiguous()
            for name, shape in shapes.items()}


def glm_checkpoint(root: Path, layout: str = "hf", variant: str = "") -> Path:
    """A GLM checkpoint in one of GLM_LAYOUTS, plus the tokenizer (see GLM_LAYOUTS)."""

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        model = glm_hf_model(variant)
        if layout == "fused":
            out.mkdir()
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
            model.config.save_pretrained(out)
        else:
            model.save_pretrained(out, max_shard_size=SHARD_SIZE)
        if layout == "published":  # one more shard holding the MTP layer, listed in the index
            name = "model-mtp.safetensors"
            tensors = glm_mtp_tensors()
            save_file(tensors, out / name)
            index = json.loads((out / "model.safetensors.index.json").read_text())
            index["weight_map"].update(dict.fromkeys(tensors, name))
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / f"glm-{layout}{variant}", ("glm", layout, variant), build)


def glm_mlx_checkpoint(root: Path, bits: int | str | None) -> Path:
    """The published layout converted by mlx-lm (affine `bits`-bit, group size 64, or unquantized,
    or a mixed recipe such as "mixed_4_6": per-layer records in config.json), as mlx-community
    ships GLM: `switch_mlp` stacks, no MTP layer (mlx-lm drops it). mlx-lm 0.32 reads rope_theta,
    partial_rotary_factor and rope_scaling at the top level of config.json."""

    def source(out: Path) -> None:
        shutil.copytree(glm_checkpoint(root, "published"), out)
        config = json.loads((out / "config.json").read_text())
        config.update(rope_theta=config["rope_parameters"]["rope_theta"], rope_scaling=None,
                      partial_rotary_factor=config["rope_parameters"]["partial_rotary_factor"])
        (out / "config.json").write_text(json.dumps(config, indent=2))

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=64) if isinstance(bits, int) else {}
        if isinstance(bits, str):
            quantized = dict(quantize=True, q_group_size=64, quant_predicate=bits)
        src = _once(root / "glm-published-for-mlx-lm", ("glm for mlx-lm",), source)
        convert(str(src), str(out), **quantized)

    name = "mlx-glm4_moe-" + (f"q{bits}" if isinstance(bits, int) else bits or "float32")
    return _once(root / name, ("glm mlx", bits), build)
