"""Kimi-Linear: Kimi delta attention layers (model/kda.py) with a few multi-head latent attention
layers (model/mla.py, without positional embedding: Kimi's MLA is NoPE), each followed by a dense
SwiGLU MLP (`mlp_layer_types` "dense", the first layer) or DeepSeek-V3's MoE (sigmoid group-limited
routing with a correction bias, shared experts), as transformers 5.24 defines `KimiLinearForCausalLM`.

KDA layers keep GDN's state kind (`GDNState`: recurrent state and conv history, exact rollback);
MLA layers the latent KV cache (`LatentKVState`, positional).

config.json is read in transformers' spelling (`layer_types`, `linear_num_heads`, ...) or the
published one (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, `num_experts`,
`num_experts_per_token`, `moe_renormalize`, `model_max_length`, ...). Tensors are read in the
published layout (what transformers saves: `block_sparse_moe`, `experts.E.w1/w2/w3`, `q_conv1d`, the
forget gate's `f_a_proj`/`f_b_proj`/`A_log`/`dt_bias` on the attention), transformers' in-memory one
(fused `conv1d`, `forget_gate.*`, fused experts) and mlx-lm's (`q_conv.conv` (C, K, 1), stacked
`switch_mlp`, `mlp.e_score_correction_bias`, `embed_q`/`unembed_out`), under mlx-lm's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .config import ConfigError, ModelConfig
from .decoder_layer import PreNormLayer
from .deepseek_v3 import DeepseekMoE
from .kda import KimiDeltaAttention
from .layers import MLP, DecoderStack, RMSNorm, RowLinear
from .layout import stack_experts
from .mla import LatentAttention, split_kv_b
from .quant import router_overrides

LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
# config.json spellings of the published checkpoints (and transformers' attribute_map) -> strata's
ALIASES = {"model_max_length": "max_position_embeddings", "num_experts": "n_routed_experts",
           "num_local_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group"}
LINEAR_CONFIG = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                 "short_conv_kernel_size": "linear_conv_kernel_dim"}


@dataclass(frozen=True)
class KimiLinearConfig(ModelConfig):
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    linear_num_heads: int
    linear_head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    q_lora_rank: int | None = None
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"qk_rope_head_dim"})

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "KimiLinearConfig":
        """Raises ConfigError: a missing or mistyped field, routing other than sigmoid, an
        activation other than silu, `moe_layer_freq` other than 1, layer lists that do not fit."""
        params = dict(params)
        for alias, name in ALIASES.items():
            if alias in params and name not in params:
                params[name] = params[alias]
        linear = params.get("linear_attn_config") or {}
        for alias, name in LINEAR_CONFIG.items():
            if alias in linear and name not in params:
                params[name] = linear[alias]
        if params.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"moe_router_activation_func {params['moe_router_activation_func']!r} is not "
                              "supported (only sigmoid)")
        if params.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {params['hidden_act']!r} is not supported (only silu)")
        if params.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {params['moe_layer_freq']!r} is not supported (only 1)")
        for key in ("n_routed_experts", "n_shared_experts"):
            if params.get(key) is None:
                params.pop(key, None)
        cls.check_fields(params)
        n = params.get("num_hidden_layers", 0)
        params["layer_types"] = tuple(_layer_types(params, linear, n))
        if params.get("mlp_layer_types") is None:
            dense = params.get("first_k_dense_replace", 1)
            params["mlp_layer_types"] = [DENSE if i < dense or not params.get("n_routed_experts") else SPARSE
                                         for i in range(n)]
        params["mlp_layer_types"] = tuple(params["mlp_layer_types"])
        config = super().from_dict(params)
        for name, kinds in (("layer_types", (LINEAR, FULL)), ("mlp_layer_types", (DENSE, SPARSE))):
            value = getattr(config, name)
            if len(value) != n or set(value) - set(kinds):
                raise ConfigError(f"{name} must list {n} entries of {'/'.join(kinds)}, got {list(value)}")
        if SPARSE in config.mlp_layer_types:
            E, k = config.n_routed_experts, config.num_experts_per_tok
            if not 1 <= k <= E or not config.moe_intermediate_size:
                raise ConfigError(f"sparse layers need num_experts_per_tok ({k}) in 1..n_routed_experts ({E}) "
                                  "and moe_intermediate_size")
            if E % config.n_group or not 1 <= config.topk_group <= config.n_group:
                raise ConfigError(f"n_routed_experts ({E}) must split into n_group ({config.n_group}) groups, "
                                  f"of which topk_group ({config.topk_group}) are kept")
        return config


def _layer_types(params: dict[str, Any], linear: dict[str, Any], n: int) -> list[str]:
    """transformers' `layer_types`, else the published `kda_layers` / `full_attn_layers` (1-based),
    else transformers' default: full attention at layers i > 0 with i % 4 == 0, KDA elsewhere."""
    if params.get("layer_types"):
        return list(params["layer_types"])
    if "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * n
        for kind, layers in ((FULL, linear["full_attn_layers"]), (LINEAR, linear["kda_layers"])):
            for layer in layers:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ConfigError(f"linear_attn_config lists layer {layer!r}, outside 1..{n}")
                types[layer - 1] = kind
        if None in types:
            raise ConfigError(f"linear_attn_config leaves layer {types.index(None) + 1} without a kind")
        return types
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]


Config = KimiLinearConfig


class KimiMoE(DeepseekMoE):
    """DeepSeek-V3's MoE with mlx-lm's Kimi names: the router a Linear `gate`, the correction
    bias on the block (`e_score_correction_bias`)."""

    def __init__(self, config: KimiLinearConfig):
        super().__init__(config)
        self.gate = RowLinear(config.hidden_size, config.n_routed_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((config.n_routed_experts,))

    @property
    def correction_bias(self) -> mx.array:
        return self.e_score_correction_bias


class DecoderLayer(PreNormLayer):
    def __init__(self, config: KimiLinearConfig, index: int):
        super().__init__()
        self.is_linear = config.layer_types[index] == LINEAR
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(hidden_size=config.hidden_size, num_heads=config.linear_num_heads,
                                                head_dim=config.linear_head_dim,
                                                conv_kernel=config.linear_conv_kernel_dim, eps=config.rms_norm_eps)
        else:
            self.self_attn = LatentAttention(
                hidden_size=config.hidden_size, num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope=None,
                bias=config.attention_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.mlp_layer_types[index] == SPARSE:
            self.mlp = KimiMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


class Model(DecoderStack):
    """Token ids in, logits out; per-layer state (GDN kind for KDA, latent KV for MLA) comes
    from the caller (the window engine)."""

    # The routing correction bias and the forget gate's A_log and dt_bias stay float32 in any
    # compute dtype, as transformers and mlx-lm keep them.
    FLOAT32_PARAMETERS: ClassVar[tuple[str, ...]] = ("e_score_correction_bias", ".A_log", ".dt_bias")

    def __init__(self, config: KimiLinearConfig):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        return [("gdn", {"conv_kernel": self.config.linear_conv_kernel_dim}) if layer.is_linear else ("latent_kv", {})
                for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map the published, transformers in-memory or mlx-lm tensors onto this module's parameters."""
        config = self.config
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        out = {}
        for key, value in weights.items():
            key = key.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
            out[key.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")] = value
        H, D = config.linear_num_heads, config.linear_head_dim
        for i, layer in enumerate(self.layers):
            attn = f"model.layers.{i}.self_attn"
            if layer.is_linear:
                fused = out.pop(f"{attn}.conv1d.weight", None)  # transformers in memory: (3C, 1, K)
                if fused is not None:
                    for name, part in zip("qkv", mx.split(fused, 3)):
                        out[f"{attn}.{name}_conv1d.weight"] = part
                for name in "qkv":
                    conv = out.pop(f"{attn}.{name}_conv1d.weight", None)  # published: (C, 1, K)
                    if conv is not None:
                        out[f"{attn}.{name}_conv.conv.weight"] = mx.moveaxis(conv.reshape(H * D, 1, -1), 2, 1)
                for name, shape in (("A_log", (1, 1, H, 1)), ("dt_bias", (H * D,))):
                    if f"{attn}.{name}" in out and out[f"{attn}.{name}"].size == math.prod(shape):
                        out[f"{attn}.{name}"] = out[f"{attn}.{name}"].reshape(shape)
            else:
                split_kv_b(out, attn, num_heads=config.num_attention_heads, nope_dim=config.qk_nope_head_dim,
                           v_dim=config.v_head_dim)
            if config.mlp_layer_types[i] == SPARSE:
                stack_experts(out, f"model.layers.{i}.mlp", config.n_routed_experts,
                              names={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
        return out

    def quant_overrides(self, group_size: int):
        """mlx-lm's choice for this family: the routers (`mlp.gate`) at 8 bits."""
        return router_overrides(group_size)
