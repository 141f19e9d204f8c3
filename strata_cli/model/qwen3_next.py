"""Qwen3-Next: gated-delta-rule and gated full-attention layers, each followed by a sparse MoE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .config import ConfigError, ModelConfig, lift_rope_parameters
from .decoder_layer import PreNormLayer
from .gdn import GatedDeltaNet
from .layers import MLP, DecoderStack, RMSNorm
from .layout import HF, detect_layout, stack_experts
from .moe import SparseLayerRule, SparseMoeBlock
from .quant import router_overrides

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3NextConfig(SparseLayerRule, ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: Any = None

    # 0: no experts (a dense model), no shared expert
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"num_experts", "shared_expert_intermediate_size"})

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Qwen3NextConfig":
        params = lift_rope_parameters(params, ("rope_theta", "partial_rotary_factor"))
        cls.check_fields(params)  # the layer rule below computes with them
        if not 0 < params.get("partial_rotary_factor", 0.25) <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {params['partial_rotary_factor']}")
        n = params.get("num_hidden_layers", 0)
        if not params.get("layer_types"):
            interval = params.get("full_attention_interval", 4)
            params["layer_types"] = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        params["layer_types"] = tuple(params["layer_types"])
        params["mlp_only_layers"] = tuple(params.get("mlp_only_layers") or ())
        config = super().from_dict(params)
        if len(config.layer_types) != config.num_hidden_layers or set(config.layer_types) - {LINEAR, FULL}:
            raise ConfigError(
                f"layer_types must list {config.num_hidden_layers} entries of "
                f"{LINEAR!r}/{FULL!r}, got {list(config.layer_types)}"
            )
        return config


Config = Qwen3NextConfig


def gated_delta_net(config, cls=GatedDeltaNet) -> GatedDeltaNet:
    """A linear-attention layer of `config`'s shape (`cls`: the projections' layout)."""
    return cls(
        hidden_size=config.hidden_size,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
    )


def gated_attention(config) -> GatedAttention:
    """A full-attention layer of `config`'s shape: gated, q/k-normed, partial rotary."""
    return GatedAttention(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rotary_dim=int(config.head_dim * config.partial_rotary_factor),
        rope_theta=config.rope_theta,
        eps=config.rms_norm_eps,
        bias=config.attention_bias,
    )


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Qwen3NextConfig, index: int):
        super().__init__()
        self.is_linear = config.layer_types[index] == LINEAR
        if self.is_linear:
            self.linear_attn = gated_delta_net(config)
        else:
            self.self_attn = gated_attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(index):
            self.mlp = SparseMoeBlock(
                hidden_size=config.hidden_size,
                expert_size=config.moe_intermediate_size,
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                norm_topk_prob=config.norm_topk_prob,
                shared_expert_size=config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


class Model(DecoderStack):
    """Token ids in, logits out; per-layer state comes from the caller (the window engine)."""

    def __init__(self, config):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        """What state each layer needs: ("gdn", {conv_kernel}) or ("kv", {})."""
        return [
            ("gdn", {"conv_kernel": self.config.linear_conv_kernel_dim}) if layer.is_linear else ("kv", {})
            for layer in self.layers
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters.

        Only a Hugging Face checkpoint needs the family transforms (1 + w norms, (C, 1, K) conv);
        mlx-lm applied them before writing its layout.
        """
        is_hf = _is_hf_layout(weights)
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            if "linear_attn" in layer:
                key = f"{prefix}.linear_attn.conv1d.weight"
                if key in weights and weights[key].ndim == 3:  # HF (C, 1, K), mlx-lm (C, K, 1) -> (C, K)
                    weights[key] = weights[key].squeeze(1 if is_hf else 2)
            if isinstance(layer.mlp, SparseMoeBlock):
                stack_experts(weights, f"{prefix}.mlp", self.config.num_experts)
        if not is_hf:
            return weights
        # Qwen3-Next's RMSNorms are zero-centred (they scale by 1 + weight); the gated one is not.
        zero_centred = (
            ".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight"
        )
        for k in list(weights):
            if k == "model.norm.weight" or k.endswith(zero_centred):
                weights[k] = weights[k].astype(mx.float32) + 1.0  # in float32: 1 + w rounds in bf16
        return weights

    def quant_overrides(self, group_size: int):
        """Per-layer quantization settings `strata convert` applies (mlx-lm's choice for this family)."""
        return router_overrides(group_size)


def _is_hf_layout(weights: dict[str, mx.array]) -> bool:
    layout = detect_layout(weights)
    if layout is not None:
        return layout == HF
    # No expert tensors: the conv weight tells, HF stores (C, 1, K) and mlx-lm (C, K, 1).
    conv = next((v for k, v in weights.items() if k.endswith("conv1d.weight")), None)
    return conv is None or conv.ndim != 3 or conv.shape[1] == 1
