"""Mixtral: full attention with full rotary embedding in every layer, each followed by a sparse
MoE (`block_sparse_moe`) whose top-k weights are renormalised."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .config import ConfigError, ModelConfig, lift_rope_parameters
from .decoder_layer import PreNormLayer
from .layers import DecoderStack, RMSNorm
from .layout import stack_experts
from .moe import SparseMoeBlock

# Mixtral's per-expert names: w1 = gate, w3 = up, w2 = down.
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class MixtralConfig(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    head_dim: int | None = None
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "MixtralConfig":
        config = super().from_dict(lift_rope_parameters(params))
        # A window as long as the context never drops a key, so only a shorter one is refused.
        if config.sliding_window is not None and config.sliding_window < config.max_position_embeddings:
            raise ConfigError(
                f"sliding-window attention is not supported (sliding_window {config.sliding_window} "
                f"< max_position_embeddings {config.max_position_embeddings}); it must be null"
            )
        if config.head_dim is None:
            return replace(config, head_dim=config.hidden_size // config.num_attention_heads)
        return config


Config = MixtralConfig


class DecoderLayer(PreNormLayer):
    def __init__(self, config: MixtralConfig):
        super().__init__()
        self.self_attn = GatedAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary_dim=config.head_dim,
            rope_theta=config.rope_theta,
            eps=config.rms_norm_eps,
            output_gate=False,
            qk_norm=False,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(
            hidden_size=config.hidden_size,
            expert_size=config.intermediate_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=True,
        )

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe


class Model(DecoderStack):
    """Token ids in, logits out; per-layer KV state comes from the caller (the window engine)."""

    def __init__(self, config):
        super().__init__(config, [DecoderLayer(config) for _ in range(config.num_hidden_layers)])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i in range(len(self.layers)):
            block = f"model.layers.{i}.block_sparse_moe"
            # transformers' in-memory names (`mlp.gate`, `mlp.experts.gate_up_proj`) -> Mixtral's.
            for key in [k for k in weights if k.startswith(f"model.layers.{i}.mlp.")]:
                weights[block + key[len(f"model.layers.{i}.mlp") :]] = weights.pop(key)
            stack_experts(weights, block, self.config.num_local_experts, names=EXPERT_NAMES)
        return weights
