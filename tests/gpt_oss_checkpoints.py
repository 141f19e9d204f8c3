"""Tiny random GPT-OSS checkpoints, offline: transformers' layout (float and MXFP4 experts, the
published config.json spelling) and mlx-lm's (unquantized and mxfp4 experts), built once per
test session under the shared checkpoint root.

The shapes are small but keep every GPT-OSS feature in play: 4 layers alternating a sliding
window of 8 and full attention (so prompts of a few dozen tokens wrap the ring), sinks, biases
everywhere, YaRN rope (transformers: `truncate` false, as published), 4 experts top-2, and a
SwiGLU limit of 1.5 in the transformers checkpoints, so that the clamps bind on many activations
(mlx-lm's class has no such field: it always clamps at 7).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

from hf_checkpoints import HEAD_GAIN, RESIDUAL_GAIN, ROUTER_GAIN, SEED, SHARD_SIZE, VOCAB, copy_tokenizer, tokenizer_dir

WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64}
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW,
              max_position_embeddings=2048, rms_norm_eps=1e-5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
BIAS_STD, SINK_STD = 0.1, 1.0
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_built: dict[str, object] = {}


def hf_model(mxfp4: bool = False):
    """transformers' GptOssForCausalLM, float32, eval mode; `mxfp4`: its experts replaced by their
    MXFP4 rounding (what `mxfp4_blocks` packs), so it is the reference for the MXFP4 checkpoint."""
    key = f"hf_model_{mxfp4}"
    if key in _built:
        return _built[key]
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(SEED)
    config = GptOssConfig(**SHAPES, swiglu_limit=1.5, rope_parameters={**YARN, "rope_theta": 10000.0},
                          eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    model = GptOssForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(SEED)
    hidden, inter = SHAPES["hidden_size"], SHAPES["intermediate_size"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                std, mean = 0.1, 1.0
            elif name.endswith("sinks"):
                std, mean = SINK_STD, 0.0
            elif "bias" in name:
                std, mean = BIAS_STD, 0.0
            elif "embed_tokens" in name:
                std, mean = 1.0, 0.0
            elif name.startswith("lm_head"):
                std, mean = HEAD_GAIN / math.sqrt(hidden), 0.0
            elif name.endswith("router.weight"):
                std, mean = ROUTER_GAIN / math.sqrt(hidden), 0.0
            elif name.endswith("experts.gate_up_proj"):  # (E, H, 2I): fan-in H
                std, mean = 1.5 / math.sqrt(hidden), 0.0
            elif name.endswith("experts.down_proj"):  # (E, I, H): fan-in I
                std, mean = RESIDUAL_GAIN / math.sqrt(inter), 0.0
            else:
                std, mean = (RESIDUAL_GAIN if "o_proj" in name else 1.0) / math.sqrt(p.shape[-1]), 0.0
            p.copy_(torch.randn(p.shape, generator=g) * std + mean)
        if mxfp4:
            for layer in model.model.layers:
                for name in ("gate_up_proj", "down_proj"):
                    w = getattr(layer.mlp.experts, name)  # (E, in, out)
                    blocks, scales = mxfp4_blocks(w.transpose(1, 2).numpy())
                    w.copy_(torch.from_numpy(dequantize_blocks(blocks, scales)).transpose(1, 2))
    _built[key] = model.eval()
    return model


def mxfp4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E, out, in) float -> transformers' MXFP4 tensors: blocks (E, out, in/32, 16) uint8 and
    scales (E, out, in/32) uint8, through MLX's mxfp4 quantization (whose bits
    `dequantize_blocks`, transformers' reading written out here, must give back)."""
    import mlx.core as mx

    packed, scales = mx.quantize(mx.array(w), 32, 4, mode="mxfp4")
    E, out, n = w.shape
    return np.array(packed).view(np.uint8).reshape(E, out, n // 32, 16), np.array(scales)


def dequantize_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' `convert_moe_packed_tensors` without the transpose: low nibble first, the
    FP4 (E2M1) table, times 2^(scale - 127) -> (E, out, in) float32."""
    values = np.empty((*blocks.shape[:-1], 32), dtype=np.float32)
    values[..., 0::2], values[..., 1::2] = FP4[blocks & 15], FP4[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def hf_checkpoint(root: Path) -> Path:
    """transformers' save_pretrained of `hf_model()`, sharded, plus the tiny tokenizer."""

    def build(out: Path) -> None:
        hf_model().save_pretrained(out, max_shard_size=SHARD_SIZE)
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / "hf-gpt_oss", build)


def hf_mxfp4_checkpoint(root: Path) -> Path:
    """The layout the GPT-OSS models are published in: experts as `*_blocks` / `*_scales`, biases
    float, `quantization_config` {quant_method: mxfp4}, rope_theta and rope_scaling at the top
    of config.json. Holds `hf_model(mxfp4=True)`'s weights exactly."""

    def build(out: Path) -> None:
        from safetensors.numpy import save_file

        out.mkdir(parents=True)
        state = {k: v.numpy() for k, v in hf_model(mxfp4=True).state_dict().items()}
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = mxfp4_blocks(np.ascontiguousarray(state.pop(key).transpose(0, 2, 1)))
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        save_file(state, str(out / "model.safetensors"))
        config = json.loads(hf_model().config.to_json_string())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        config["experts_per_token"] = config["num_experts_per_tok"]
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / "hf-gpt_oss-mxfp4", build)


MLX_CONFIG = dict(SHAPES, model_type="gpt_oss", rope_theta=10000.0, tie_word_embeddings=False,
                  rope_scaling={**YARN, "truncate": True})  # mlx-lm always truncates YaRN's range


def mlx_model(mxfp4: bool):
    """mlx-lm's own gpt_oss Model with random weights (seeded), its experts mxfp4-quantized by
    MLX when `mxfp4`; returns (model, config)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import gpt_oss

    mx.random.seed(SEED + 1)
    config = json.loads(json.dumps(MLX_CONFIG))
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("sinks"):
            weights[name] = mx.random.normal(p.shape) * SINK_STD
        elif name.endswith("bias"):
            weights[name] = mx.random.normal(p.shape) * BIAS_STD
        elif name.endswith("router.weight"):
            weights[name] = mx.random.normal(p.shape) * ROUTER_GAIN / math.sqrt(p.shape[-1])
        elif name.endswith("norm.weight"):
            weights[name] = mx.random.normal(p.shape) * 0.1 + 1.0
        elif "embed_tokens" in name:
            weights[name] = mx.random.normal(p.shape)
        elif name.startswith("lm_head"):
            weights[name] = mx.random.normal(p.shape) * HEAD_GAIN / math.sqrt(p.shape[-1])
        else:
            gain = RESIDUAL_GAIN if ("o_proj" in name or "down_proj" in name) else 1.0
            weights[name] = mx.random.normal(p.shape) * gain / math.sqrt(p.shape[-1])
    model.update(tree_unflatten(list(weights.items())))
    if mxfp4:
        nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                    class_predicate=lambda path, m: ".experts." in path and hasattr(m, "to_quantized"))
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        config["quantization_config"] = config["quantization"]
    mx.eval(model.parameters())
    return model, config


def mlx_checkpoint(root: Path, mxfp4: bool) -> Path:
    """`mlx_model(mxfp4)` saved by mlx-lm (the mlx-community layout), plus the tiny tokenizer."""

    def build(out: Path) -> None:
        from mlx_lm.utils import save_config, save_model

        model, config = mlx_model(mxfp4)
        save_model(out, model)
        save_config(config, out / "config.json")
        copy_tokenizer(tokenizer_dir(root), out)

    return _once(root / f"mlx-gpt_oss-{'mxfp4' if mxfp4 else 'float32'}", build)


def _once(path: Path, build) -> Path:
    if _built.get(str(path)) != path:
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path)
        _built[str(path)] = path
    return path


def strata_model(window: int, *, seed: int = SEED, num_hidden_layers: int = 2, **overrides):
    """strata's own GPT-OSS module with random weights, no checkpoint: what the sliding-state
    tests run on (a small window, so that cheap sequences wrap the ring many times)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from strata_cli.model.gpt_oss import Config, Model

    params = dict(SHAPES, model_type="gpt_oss", sliding_window=window, num_hidden_layers=num_hidden_layers,
                  layer_types=["sliding_attention", "full_attention"] * (num_hidden_layers // 2),
                  rope_theta=10000.0, rope_scaling=YARN)
    model = Model(Config.from_dict({**params, **overrides}))
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    drawn = {}
    for (name, p), key in zip(flat, keys):
        if name.endswith("norm.weight"):
            drawn[name] = 1.0 + 0.1 * mx.random.normal(p.shape, key=key)
        elif name.endswith(("sinks", "bias")):
            drawn[name] = mx.random.normal(p.shape, key=key) * (SINK_STD if name.endswith("sinks") else BIAS_STD)
        elif name.endswith("embed_tokens.weight"):
            drawn[name] = mx.random.normal(p.shape, key=key)
        else:
            gain = ROUTER_GAIN if name.endswith("router.weight") else HEAD_GAIN if name.startswith("lm_head") else 1.0
            drawn[name] = gain * mx.random.normal(p.shape, key=key) / math.sqrt(p.shape[-1])
    model.update(tree_unflatten(list(drawn.items())))
    mx.eval(model.parameters())
    return model.eval()
