"""Granite-4.0-H (`granitemoehybrid`): Mamba-2 and full-attention layers, each followed by a MoE
with a shared SwiGLU MLP (or the MLP alone when there are no experts).

Granite's quirks, as transformers defines them: the embeddings are multiplied by
`embedding_multiplier`, each residual branch by `residual_multiplier`, attention scores are
scaled by `attention_multiplier` (not head_dim^-0.5), the logits are divided by
`logits_scaling`; attention uses rotary embeddings only when `position_embedding_type` is "rope"
(Granite-4.0-H ships "nope"); the router takes the top-k logits and softmaxes them. Module names
are mlx-lm's: stacked experts `block_sparse_moe.switch_mlp.*`, the router `router.layer`, a dense
model's MLP `mlp.*`; the Hugging Face layout's fused `input_linear`/`output_linear` is split onto them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .config import ConfigError, ModelConfig, lift_rope_parameters, time_step_limit
from .decoder_layer import PreNormLayer
from .layers import MLP, WINDOW_ROWS, DecoderStack, RMSNorm, RowLinear, lookup_embedding, swiglu
from .layout import stack_experts
from .mamba2 import Mamba2Mixer
from .moe import QuantizedSwitchGLU, SparseMoeBlock, SwitchGLU, gather_matmul, glu_by_expert, sorted_gather_is_exact

MAMBA, ATTENTION = "mamba", "attention"
LAYER_NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclass(frozen=True)
class GraniteMoeHybridConfig(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    layer_types: tuple[str, ...]
    mamba_n_heads: int
    mamba_d_state: int
    mamba_d_head: int
    intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    position_embedding_type: str | None = None
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "GraniteMoeHybridConfig":
        params = lift_rope_parameters(params) if params.get("position_embedding_type") == "rope" else dict(params)
        n = params.get("num_hidden_layers", 0)
        names = params.get("layer_types") or params.get("layers_block_type") or [MAMBA] * n
        unknown = sorted(set(names) - set(LAYER_NAMES))
        if unknown:
            raise ConfigError(f"unknown Granite layer types {unknown} (known: {sorted(LAYER_NAMES)})")
        params["layer_types"] = tuple(LAYER_NAMES[name] for name in names)
        if params.get("mamba_d_head", "auto") == "auto":  # transformers' default
            params["mamba_d_head"] = params.get("mamba_expand", 2) * params["hidden_size"] // params["mamba_n_heads"]
        params["time_step_limit"] = time_step_limit(params)
        config = super().from_dict(params)
        if len(config.layer_types) != config.num_hidden_layers:
            raise ConfigError(f"layer_types lists {len(config.layer_types)} layers, num_hidden_layers is "
                              f"{config.num_hidden_layers}")
        if config.mamba_n_heads * config.mamba_d_head != config.mamba_expand * config.hidden_size:
            raise ConfigError(f"mamba_n_heads ({config.mamba_n_heads}) x mamba_d_head ({config.mamba_d_head}) must "
                              f"equal mamba_expand x hidden_size ({config.mamba_expand * config.hidden_size})")
        return config


Config = GraniteMoeHybridConfig


class SharedMLP(nn.Module):
    """output_linear(silu(gate) · up), [gate | up] = input_linear(x): Granite's shared expert."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.input_linear = RowLinear(dims, 2 * hidden_dims, bias=False)
        self.output_linear = RowLinear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(swiglu(gate, up))


def granite_glu_by_expert(x: mx.array, inds: mx.array, matmul, *, window: bool | None = None) -> mx.array:
    """`moe.glu_by_expert`, except GPU prompt chunks: picks sorted by expert, multiplied without
    the sorted flag (`GraniteSwitchGLU`'s reason). Public so that streamed Granite experts
    (experts/switch.py) run the very same form over their slot banks."""
    N, k = inds.shape
    if sorted_gather_is_exact() or (N <= WINDOW_ROWS if window is None else window):
        return glu_by_expert(x, inds, matmul, window=window)
    flat = inds.reshape(-1)
    order = mx.argsort(flat)
    experts = flat[order]
    xs = x[order // k][:, None, :]
    h = swiglu(matmul("gate_proj", xs, experts, False), matmul("up_proj", xs, experts, False))
    return matmul("down_proj", h, experts, False)[mx.argsort(order)].reshape(N, k, -1)


class GraniteSwitchGLU(SwitchGLU):
    """`SwitchGLU` whose GPU prompt chunks sort their picks by expert and multiply them without
    the sorted flag. On MLX 0.32.4's CUDA backend, with unquantized experts, both the sorted
    `gather_mm` (moe.sorted_gather_is_exact) and model/moe.py's padded batches gave
    products 2.0 off the pick-by-pick ones on the H200; this form matched them (as Nemotron-H's
    experts do). Quantized experts (`QuantizedSwitchGLU`, sorted `gather_qmm`) are unaffected."""

    by_expert = staticmethod(granite_glu_by_expert)  # the form streamed unquantized records take

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        if sorted_gather_is_exact() or inds.shape[0] <= WINDOW_ROWS:
            return super().__call__(x, inds)
        return granite_glu_by_expert(
            x, inds, lambda name, xs, experts, is_sorted: gather_matmul(xs, self[name], experts, is_sorted=is_sorted))


class GraniteMoe(SparseMoeBlock):
    """`SparseMoeBlock` (its experts, hooks and call) with Granite's router: the top-k of the
    logits of `router.layer`, softmaxed among themselves (the same weights as the softmax over
    every expert renormalised over the picks). `gate` names that linear for the expert cache's
    prefetch, which ranks experts by it."""

    def __init__(self, *, hidden_size: int, expert_size: int, num_experts: int, top_k: int):
        nn.Module.__init__(self)  # SparseMoeBlock's own router would be a parameter named `gate`
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_local_experts ({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, True
        self.router = nn.Module()
        self.router.layer = RowLinear(hidden_size, num_experts, bias=False)
        self.switch_mlp = GraniteSwitchGLU(hidden_size, expert_size, num_experts)

    @property
    def gate(self) -> RowLinear:
        return self.router.layer

    @property
    def compilable(self) -> bool:
        return self.routing_policy is None and type(self.switch_mlp) in (GraniteSwitchGLU, QuantizedSwitchGLU)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k), float32."""
        logits = self.router.layer(x).astype(mx.float32)
        if self.routing_policy is None:
            inds = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
            return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
        probs = mx.softmax(logits, axis=-1, precise=True)
        inds, mask = self.routing_policy(probs, self.top_k)
        weights = mx.take_along_axis(probs, inds, axis=-1) * mask
        return inds, weights / weights.sum(axis=-1, keepdims=True)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: GraniteMoeHybridConfig, index: int):
        super().__init__()
        self.is_mamba = config.layer_types[index] == MAMBA
        self.residual_multiplier = float(config.residual_multiplier)
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                hidden_size=config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
                state_size=config.mamba_d_state, n_groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv,
                eps=config.rms_norm_eps, time_step_limit=config.time_step_limit, use_bias=config.mamba_proj_bias,
                use_conv_bias=config.mamba_conv_bias,
            )
        else:
            head_dim = config.hidden_size // config.num_attention_heads
            self.self_attn = GatedAttention(
                hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                rotary_dim=head_dim if config.position_embedding_type == "rope" else 0,
                rope_theta=config.rope_theta, eps=config.rms_norm_eps, bias=config.attention_bias,
                output_gate=False, qk_norm=False,
            )
            self.self_attn.scale = float(config.attention_multiplier)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_local_experts:
            self.block_sparse_moe = GraniteMoe(
                hidden_size=config.hidden_size, expert_size=config.intermediate_size,
                num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
            )
            self.shared_mlp = SharedMLP(config.hidden_size, config.shared_intermediate_size)
        else:
            self.mlp = MLP(config.hidden_size, config.shared_intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.mamba if self.is_mamba else self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if "block_sparse_moe" in self else self.mlp

    def tail(self, x: mx.array, mixed: mx.array, *tail_in: mx.array) -> mx.array:
        h = x + self.mixer.tail(mixed, *tail_in) * self.residual_multiplier
        normed = self.post_attention_layernorm(h)
        if "block_sparse_moe" in self:
            out = self.block_sparse_moe(normed) + self.shared_mlp(normed)
        else:
            out = self.mlp(normed)
        return h + out * self.residual_multiplier


class Model(DecoderStack):
    """Token ids in, logits out; per-layer state comes from the caller (the window engine)."""

    def __init__(self, config: GraniteMoeHybridConfig):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        """("mamba2", {conv_kernel}) per Mamba layer, ("kv", {}) per attention layer."""
        return [("mamba2", {"conv_kernel": self.config.mamba_d_conv}) if layer.is_mamba else ("kv", {})
                for layer in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        return lookup_embedding(self.model.embed_tokens, tokens) * self.config.embedding_multiplier

    def head(self, h: mx.array, *, last_only: bool = False) -> mx.array:
        return super().head(h, last_only=last_only) / self.config.logits_scaling

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters:
        the conv weight (HF (C, 1, K), mlx-lm (C, K, 1)) to (C, K); HF's fused experts
        (`input_linear` (E, 2I, H) = [gate; up], `output_linear`; in memory `experts.gate_up_proj`,
        `experts.down_proj`, `router.weight`) and a dense model's `shared_mlp` onto mlx-lm's names."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            key = f"{prefix}.mamba.conv1d.weight"
            if key in weights and weights[key].ndim == 3:
                weights[key] = weights[key].squeeze(1 if weights[key].shape[1] == 1 else 2)
            moe = f"{prefix}.block_sparse_moe"
            if "block_sparse_moe" in layer:
                for source, target in (("input_linear.weight", "experts.gate_up_proj"),
                                       ("output_linear.weight", "experts.down_proj"),
                                       ("router.weight", "router.layer.weight")):
                    if f"{moe}.{source}" in weights:
                        weights[f"{moe}.{target}"] = weights.pop(f"{moe}.{source}")
                stack_experts(weights, moe, self.config.num_local_experts)
            elif f"{prefix}.shared_mlp.input_linear.weight" in weights:
                gate, up = mx.split(weights.pop(f"{prefix}.shared_mlp.input_linear.weight"), 2, axis=0)
                weights[f"{prefix}.mlp.gate_proj.weight"], weights[f"{prefix}.mlp.up_proj.weight"] = gate, up
                weights[f"{prefix}.mlp.down_proj.weight"] = weights.pop(f"{prefix}.shared_mlp.output_linear.weight")
        return weights

    def quant_overrides(self, group_size: int):
        """Per-layer quantization settings `strata convert` applies: the routers at 8 bits, as
        mlx-lm quantizes this family."""

        def overrides(path: str) -> dict | None:
            return {"group_size": group_size, "bits": 8} if path.endswith("router.layer") else None

        return overrides
