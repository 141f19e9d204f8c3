"""Tiny random checkpoints of the DeepSeek line (DeepSeek-V3, Kimi-Linear), written by transformers
and mlx-lm, offline, once per test session (the pattern and scales of tests/hf_checkpoints.py).

DeepSeek-V3: 3 layers (the first dense, `first_k_dense_replace` = 1), MLA with a q LoRA (or a
plain q_proj), 8 routed experts in 2 groups (1 kept) top-2 plus a shared expert, routed scaling
2.5; dims multiples of 32 so every matrix quantizes at group size 32 (MLA's per-head halves are
32 wide). Routing biases are non-negative: mlx-lm drops the unkept groups by zeroing their
scores where transformers uses -inf, which agree only while every kept biased score is >= 0.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from hf_checkpoints import HEAD_GAIN, RESIDUAL_GAIN, ROUTER_GAIN, SEED, SHARD_SIZE, VOCAB, copy_tokenizer, tokenizer_dir

_built: dict[tuple, object] = {}
GROUP_SIZE = 32  # MLA's per-head matrices are 32 wide here
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def _cached(path: Path, key: tuple, build) -> Path:
    if _built.get(key) != path:
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path)
        _built[key] = path
    return path


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64,
                  qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1,
                  num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512,
                  eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    return DeepseekV3Config(**{**params, **overrides})


def init_weights(model, *, seed: int = SEED) -> None:
    """tests/hf_checkpoints.py's scales; norms near 1, routing biases in [0, 0.1]-ish."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or name.endswith(("A_log", "dt_bias")):
                continue  # transformers' own initialisation (Kimi's forget gate)
            if name.endswith("norm.weight"):
                value = torch.randn(p.shape, generator=g) * 0.1 + 1.0
            elif name.endswith("e_score_correction_bias"):
                value = torch.randn(p.shape, generator=g).abs() * 0.1
            elif "embed_tokens" in name:
                value = torch.randn(p.shape, generator=g)
            elif name.startswith("lm_head"):
                value = torch.randn(p.shape, generator=g) * HEAD_GAIN / math.sqrt(hidden)
            elif name.endswith("mlp.gate.weight"):
                value = torch.randn(p.shape, generator=g) * ROUTER_GAIN / math.sqrt(hidden)
            elif p.ndim >= 2:
                gain = RESIDUAL_GAIN if any(s in name for s in ("o_proj", "down_proj")) else 1.0
                value = torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1])
            else:
                continue
            p.copy_(value)


def deepseek_v3_hf_model(**overrides):
    """The transformers model of `deepseek_v3_config(**overrides)`, float32, eval mode (cached)."""
    key = ("deepseek_v3_hf_model", repr(sorted(overrides.items())))
    if key not in _built:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(deepseek_v3_config(**overrides), dtype=torch.float32)
        init_weights(model)
        _built[key] = model.eval()
    return _built[key]


def deepseek_v3_checkpoint(root: Path, variant: str = "", **overrides) -> Path:
    """transformers' sharded `save_pretrained` (per-expert tensors, `kv_b_proj`) plus the tokenizer."""

    def build(out: Path) -> None:
        deepseek_v3_hf_model(**overrides).save_pretrained(out, max_shard_size=SHARD_SIZE)
        copy_tokenizer(tokenizer_dir(root), out)

    return _cached(root / f"hf-deepseek_v3{variant}", ("hf deepseek_v3", variant), build)


def mtp_tensors(model, *, seed: int = SEED + 1) -> dict:
    """One MTP layer as the published DeepSeek-V3 stores it after its decoder layers
    (`model.layers.N.*`: a MoE decoder layer, per-expert, with `kv_b_proj`; `enorm`, `hnorm`,
    `eh_proj`, `shared_head.norm`, `shared_head.head`, `embed_tokens`), random, as torch tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n, H, V = model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size
    out = {}
    for name, p in model.state_dict().items():
        if not name.startswith(f"model.layers.{n - 1}."):  # the last layer is a MoE one
            continue
        rest = name.split(".", 3)[3]
        if rest.startswith("mlp.experts."):  # in memory fused: stored per expert
            E, I = p.shape[0], model.config.moe_intermediate_size
            projs = {"gate_proj": (I, H), "up_proj": (I, H)} if rest.endswith("gate_up_proj") else {"down_proj": (H, I)}
            for e in range(E):
                for proj, shape in projs.items():
                    out[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=g)
            continue
        out[f"model.layers.{n}.{rest}"] = torch.randn(p.shape, generator=g)
    for name, shape in {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H),
                        "shared_head.norm.weight": (H,), "shared_head.head.weight": (V, H),
                        "embed_tokens.weight": (V, H)}.items():
        out[f"model.layers.{n}.{name}"] = torch.randn(shape, generator=g)
    return out


def deepseek_v3_published_checkpoint(root: Path) -> Path:
    """The published layout: transformers' tensors plus one MTP layer (`num_nextn_predict_layers` 1)."""

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        shutil.copytree(deepseek_v3_checkpoint(root), out)
        save_file({k: v.contiguous() for k, v in mtp_tensors(deepseek_v3_hf_model()).items()},
                  out / "model-mtp.safetensors")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        index["weight_map"].update(dict.fromkeys(mtp_tensors(deepseek_v3_hf_model()), "model-mtp.safetensors"))
        (out / "model.safetensors.index.json").write_text(json.dumps(index))

    return _cached(root / "published-deepseek_v3", ("published deepseek_v3",), build)


def deepseek_v3_mlx_checkpoint(root: Path, bits: int | None) -> Path:
    """The transformers checkpoint converted by mlx-lm (its `embed_q` / `unembed_out` layout),
    unquantized or affine `bits`-bit at group size 32."""

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=GROUP_SIZE) if bits else {}
        convert(str(deepseek_v3_checkpoint(root)), str(out), **quantized)

    name = "mlx-deepseek_v3-" + (f"q{bits}" if bits else "float32")
    return _cached(root / name, ("mlx deepseek_v3", bits), build)


# -- Kimi-Linear: 4 layers (KDA, MLA, KDA, KDA), the first MLP dense, then DeepSeek's MoE -----------

KIMI_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def kimi_linear_config(**overrides):
    from transformers import KimiLinearConfig

    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  num_local_experts=8, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=None,
                  qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1,
                  num_experts_per_tok=2, max_position_embeddings=512, linear_head_dim=32, linear_num_heads=2,
                  linear_conv_kernel_dim=4, layer_types=KIMI_LAYERS, mlp_layer_types=["dense"] + ["sparse"] * 3,
                  rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                  tie_word_embeddings=False)
    return KimiLinearConfig(**{**params, **overrides})


def kimi_linear_hf_model():
    """The transformers model behind `kimi_linear_checkpoint`, float32, eval mode (cached); the forget
    gate's A_log and dt_bias keep transformers' own initialisation (decay rates 1..16)."""
    key = ("kimi_linear_hf_model",)
    if key not in _built:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(kimi_linear_config(), dtype=torch.float32)
        init_weights(model)
        _built[key] = model.eval()
    return _built[key]


def kimi_linear_checkpoint(root: Path) -> Path:
    """transformers' `save_pretrained`: the published layout (`block_sparse_moe`, `experts.E.w1`,
    `q_conv1d`, the forget gate on the attention)."""

    def build(out: Path) -> None:
        kimi_linear_hf_model().save_pretrained(out, max_shard_size=SHARD_SIZE)
        copy_tokenizer(tokenizer_dir(root), out)

    return _cached(root / "hf-kimi_linear", ("hf kimi_linear",), build)


def kimi_linear_fused_checkpoint(root: Path) -> Path:
    """The model's in-memory state dict as is (fused `conv1d`, `forget_gate.*`, fused experts)."""

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir()
        state = {k: v.contiguous() for k, v in kimi_linear_hf_model().state_dict().items()}
        save_file(state, out / "model.safetensors")
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(kimi_linear_checkpoint(root) / name, out / name)

    return _cached(root / "fused-kimi_linear", ("fused kimi_linear",), build)


def kimi_linear_mlx_checkpoint(root: Path, bits: int | None) -> Path:
    """mlx-lm's conversion of the published layout. mlx-lm reads the published config's spelling
    (`linear_attn_config`, `rope_theta`, `first_k_dense_replace`) and the dense layer's MLP as
    `mlp.*`, so its source copy says so (transformers writes `block_sparse_moe.*` for every MLP)."""

    def source(out: Path) -> None:
        import mlx.core as mx

        shutil.copytree(kimi_linear_checkpoint(root), out)
        config = json.loads((out / "config.json").read_text())
        kinds = config["layer_types"]
        config["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t == "full_attention"],
            "num_heads": config["linear_num_heads"], "head_dim": config["linear_head_dim"],
            "short_conv_kernel_size": config["linear_conv_kernel_dim"]}
        config.update(rope_theta=10000.0, first_k_dense_replace=1)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        for shard in sorted(set(index["weight_map"].values())):
            tensors = dict(mx.load(str(out / shard)))
            renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
            if renamed.keys() != tensors.keys():
                mx.save_safetensors(str(out / shard), renamed)
        index["weight_map"] = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v
                               for k, v in index["weight_map"].items()}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))

    def build(out: Path) -> None:
        from mlx_lm.convert import convert

        quantized = dict(quantize=True, q_bits=bits, q_group_size=GROUP_SIZE) if bits else {}
        src = _cached(root / "hf-kimi_linear-for-mlx-lm", ("hf kimi_linear for mlx-lm",), source)
        convert(str(src), str(out), **quantized)

    name = "mlx-kimi_linear-" + (f"q{bits}" if bits else "float32")
    return _cached(root / name, ("mlx kimi_linear", bits), build)
