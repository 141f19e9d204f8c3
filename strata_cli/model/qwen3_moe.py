"""Qwen3-MoE: full attention with q/k RMSNorm in every layer, each followed by a sparse MoE
(or a dense MLP on `mlp_only_layers`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .config import ConfigError, ModelConfig, check_value, lift_rope_parameters
from .decoder_layer import PreNormLayer
from .layers import MLP, DecoderStack, RMSNorm
from .layout import stack_experts
from .moe import SparseLayerRule, SparseMoeBlock
from .quant import router_overrides


@dataclass(frozen=True)
class Qwen3MoeConfig(SparseLayerRule, ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    head_dim: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"num_experts"})  # 0: a dense model

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Qwen3MoeConfig":
        params = lift_rope_parameters(params)
        cls.check_fields(params)
        # transformers 5 writes num_local_experts; the published checkpoints say num_experts.
        if "num_experts" not in params and "num_local_experts" in params:
            check_value("num_local_experts", params["num_local_experts"], int, zero_ok=True)
            params["num_experts"] = params["num_local_experts"]
        if params.get("use_sliding_window") and params.get("sliding_window") is not None:
            raise ConfigError(
                f"sliding-window attention is not supported (use_sliding_window is true, "
                f"sliding_window {params['sliding_window']})"
            )
        params["mlp_only_layers"] = tuple(params.get("mlp_only_layers") or ())
        config = super().from_dict(params)
        if config.head_dim is None:
            return replace(config, head_dim=config.hidden_size // config.num_attention_heads)
        return config


Config = Qwen3MoeConfig


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Qwen3MoeConfig, index: int):
        super().__init__()
        self.self_attn = GatedAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary_dim=config.head_dim,
            rope_theta=config.rope_theta,
            eps=config.rms_norm_eps,
            bias=config.attention_bias,
            output_gate=False,
            qk_norm=True,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(index):
            self.mlp = SparseMoeBlock(
                hidden_size=config.hidden_size,
                expert_size=config.moe_intermediate_size,
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                norm_topk_prob=config.norm_topk_prob,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


class Model(DecoderStack):
    """Token ids in, logits out; per-layer KV state comes from the caller (the window engine)."""

    def __init__(self, config):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                stack_experts(weights, f"model.layers.{i}.mlp", self.config.num_experts)
        return weights

    def quant_overrides(self, group_size: int):
        """Per-layer quantization settings `strata convert` applies (mlx-lm's choice for this family)."""
        return router_overrides(group_size)
