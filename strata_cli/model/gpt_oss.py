"""GPT-OSS: attention layers alternating between a sliding window and full context (`layer_types`),
each with a learned sink logit per head and biased projections, YaRN rope, and a sparse MoE of
clamped-SwiGLU experts with biases, routed by a biased linear router (softmax over the top-k
logits).

Layouts: transformers' (`experts.gate_up_proj` (E, H, 2I) with gate and up interleaved along the
last axis, `down_proj` (E, I, H), their `_bias` rows; as published, the matrices MXFP4-packed as
`*_blocks` (E, out, in/32, 16) uint8 and `*_scales` (E, out, in/32), kept as MLX `mxfp4`
quantized experts, whose bit layout is the same) and mlx-lm's (`experts.{gate,up,down}_proj.
{weight,bias[,scales]}`, the names of `ClampedSwitchGLU`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import router_window

from .biased_experts import ClampedSwitchGLU
from .config import ConfigError, ModelConfig
from .decoder_layer import PreNormLayer
from .layers import DecoderStack, RMSNorm, RowLinear
from .layout import LayoutError
from .moe import kernel_combine, picks_sum, plus, router_kernel_takes, weighted_sum
from .quant import MXFP4, MXFP4_BITS, MXFP4_GROUP_SIZE, ROUTER_BITS, Quantization
from .sink_attention import SinkAttention, rope_periods

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    head_dim: int = 64
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    rope_theta: float = 150000.0
    rope_scaling: Any = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    POSITIVE_FLOATS: ClassVar[frozenset[str]] = ModelConfig.POSITIVE_FLOATS | {"swiglu_limit"}

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "GptOssConfig":
        params = dict(params)
        cls.check_fields(params)
        # transformers 5 nests the rope (its theta included) in rope_parameters; the published
        # config.json keeps rope_theta and rope_scaling at the top.
        rope = params.get("rope_parameters") or params.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_scaling must be an object, got {rope!r}")
        params.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        kind = rope.get("rope_type", rope.get("type", "default"))
        params["rope_scaling"] = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        n = params.get("num_hidden_layers")
        if params.get("layer_types") is None and isinstance(n, int):
            params["layer_types"] = [SLIDING if i % 2 == 0 else FULL for i in range(n)]  # transformers' default
        params["layer_types"] = tuple(params["layer_types"]) if params.get("layer_types") is not None else None
        config = super().from_dict(params)
        config.check()
        return config

    def check(self) -> None:
        """Refuse what strata cannot run, in one line each."""
        kinds = self.layer_types
        if len(kinds) != self.num_hidden_layers:
            raise ConfigError(f"layer_types lists {len(kinds)} layers, num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(kinds) - {SLIDING, FULL})
        if unknown:
            raise ConfigError(f"layer_types {unknown} are not supported (only {SLIDING!r} and {FULL!r})")
        if SLIDING in kinds and self.sliding_window is None:
            raise ConfigError(f"layer_types has {SLIDING!r} layers but sliding_window is null")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts "
                              f"({self.num_local_experts})")
        rope_periods(self.head_dim, self.rope_theta, self.rope_scaling)  # refuses a rope it cannot compute

    def window_of(self, index: int) -> int | None:
        """Layer `index`'s sliding window, or None for full attention."""
        return self.sliding_window if self.layer_types[index] == SLIDING else None


Config = GptOssConfig


class GptOssMoe(nn.Module):
    """Router (linear with a bias), softmax over each token's top-k logits, biased clamped experts.

    `experts` is any module with the `(x (N, H), inds (N, k)) -> (N, k, H)` contract: experts/switch.py
    swaps in a `StreamedSwitchGLU` that serves them from disk. There is no routing-policy hook:
    cache-aware routing is refused for this block (experts/moce.py).
    """

    experts_attribute = "experts"

    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = RowLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = ClampedSwitchGLU(config.hidden_size, config.intermediate_size, config.num_local_experts,
                                        alpha=config.swiglu_alpha, limit=config.swiglu_limit)

    @property
    def gate(self) -> nn.Module:
        """The router, under the name the expert cache's prefetch reads routers by."""
        return self.router

    @property
    def compilable(self) -> bool:
        """Whether a decode window may run this block inside an `mx.compile` trace: not when the
        experts stream (their cache's contents would freeze in the trace)."""
        return isinstance(self.experts, ClampedSwitchGLU)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k)."""
        return self.route_logits(self.router(x))

    def route_logits(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The router's logits (N, E) -> expert ids (N, k) and their weights (N, k)."""
        inds = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)

    folds_residual = True  # `__call__` takes the decoder layer's residual (decoder_layer.PreNormLayer.tail)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """x (..., H) -> the block's output, plus `residual` (x's shape) where given: added in the
        combine kernel's launch where it runs, else by one add."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        if self.top_k > 1 and router_kernel_takes(logits, self.top_k):
            # A GPU window's routing in one launch: the top k logits are the top k probabilities, and
            # their softmax is those probabilities over their sum, a division the weighted sum takes
            # (the combine kernel's renormalisation, where it runs).
            inds, probs = router_window.router_window(logits, self.top_k)
            picks = self.experts(x, inds)
            out = kernel_combine(picks, probs, shape, residual, normalize=True)
            return plus(residual, picks_sum(picks, probs, normalize=True).reshape(shape)) if out is None else out
        inds, weights = self.route_logits(logits)
        return plus(residual, weighted_sum(self.experts(x, inds), weights).reshape(shape))


class DecoderLayer(PreNormLayer):
    def __init__(self, config: GptOssConfig, index: int):
        super().__init__()
        self.self_attn = SinkAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            window=config.window_of(index),
            bias=config.attention_bias,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMoe(config)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


class Model(DecoderStack):
    """Token ids in, logits out; per-layer KV state (a ring for the sliding layers) comes from the
    caller (the window engine)."""

    def __init__(self, config):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        """("sliding_kv", {window}) per sliding-window layer, ("kv", {}) per full one."""
        windows = [self.config.window_of(i) for i in range(len(self.layers))]
        return [("kv", {}) if w is None else ("sliding_kv", {"window": w}) for w in windows]

    @staticmethod
    def foreign_quantization(params: dict) -> Quantization | None:
        """The published checkpoints' `quantization_config` (quant_method mxfp4, the experts
        only) as the quantization the loader applies; None for any other config."""
        foreign = params.get("quantization_config")
        if "quantization" in params or not isinstance(foreign, dict) or foreign.get("quant_method") != MXFP4:
            return None
        return Quantization(group_size=MXFP4_GROUP_SIZE, bits=MXFP4_BITS, mode=MXFP4)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i in range(len(self.layers)):
            split_fused_experts(weights, f"model.layers.{i}.mlp.experts")
        return weights

    def quant_overrides(self, group_size: int):
        """Per-layer quantization settings `strata convert` applies: the routers at 8 bits, as
        mlx-lm's converter sets them for this family."""

        def overrides(path: str) -> dict | None:
            return {"group_size": group_size, "bits": ROUTER_BITS} if path.endswith("mlp.router") else None

        return overrides


GATE_UP = ("gate_proj", "up_proj")  # the even and the odd rows of transformers' fused gate_up


def split_fused_experts(weights: dict[str, mx.array], prefix: str) -> None:
    """transformers' fused experts of one block -> `ClampedSwitchGLU`'s stacks, in place.

    gate_up (E, H, 2I) holds gate and up interleaved along its last axis (gate in the even
    columns), its bias (E, 2I) likewise; down (E, I, H). Stored MXFP4, the matrices are
    `<proj>_blocks` (E, out, in/32, 16) and `<proj>_scales` (E, out, in/32), gate_up's rows
    interleaved the same way. Absent tensors (mlx-lm's layout) are left alone.
    """
    fused = weights.pop(f"{prefix}.gate_up_proj", None)
    if fused is not None:
        _check_rank(fused, 3, f"{prefix}.gate_up_proj")
        for j, name in enumerate(GATE_UP):
            weights[f"{prefix}.{name}.weight"] = mx.contiguous(fused[..., j::2].swapaxes(1, 2))
    bias = weights.pop(f"{prefix}.gate_up_proj_bias", None)
    if bias is not None:
        for j, name in enumerate(GATE_UP):
            weights[f"{prefix}.{name}.bias"] = mx.contiguous(bias[..., j::2])
    down = weights.pop(f"{prefix}.down_proj", None)
    if down is not None:
        _check_rank(down, 3, f"{prefix}.down_proj")
        weights[f"{prefix}.down_proj.weight"] = mx.contiguous(down.swapaxes(1, 2))
    bias = weights.pop(f"{prefix}.down_proj_bias", None)
    if bias is not None:
        weights[f"{prefix}.down_proj.bias"] = bias
    for proj in ("gate_up_proj", "down_proj"):
        packed = _mxfp4_words(weights, f"{prefix}.{proj}")
        if packed is None:
            continue
        words, scales = packed
        if proj == "down_proj":
            weights[f"{prefix}.down_proj.weight"], weights[f"{prefix}.down_proj.scales"] = words, scales
            continue
        for j, name in enumerate(GATE_UP):
            weights[f"{prefix}.{name}.weight"] = mx.contiguous(words[:, j::2])
            weights[f"{prefix}.{name}.scales"] = mx.contiguous(scales[:, j::2])


def _mxfp4_words(weights: dict[str, mx.array], base: str) -> tuple[mx.array, mx.array] | None:
    """`base`_blocks and `base`_scales, popped, as MLX's mxfp4 weight (E, out, in/8) uint32 words
    (the same bytes) and scales; None when neither is there."""
    blocks, scales = weights.pop(f"{base}_blocks", None), weights.pop(f"{base}_scales", None)
    if blocks is None and scales is None:
        return None
    if blocks is None or scales is None:
        missing = f"{base}_{'blocks' if blocks is None else 'scales'}"
        raise LayoutError(f"missing tensor {missing} (MXFP4 experts need blocks and scales)", tensor=missing)
    _check_rank(blocks, 4, f"{base}_blocks")
    if blocks.dtype != mx.uint8 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise LayoutError(f"tensor {base}_blocks ({blocks.dtype}, {tuple(blocks.shape)}) and its scales "
                          f"{tuple(scales.shape)} are not MXFP4 blocks (uint8 (E, out, in/32, 16), scales "
                          "(E, out, in/32))", tensor=f"{base}_blocks")
    return blocks.view(mx.uint32).reshape(*blocks.shape[:2], -1), scales


def _check_rank(value: mx.array, ndim: int, name: str) -> None:
    if value.ndim != ndim:
        raise LayoutError(f"tensor {name} has shape {tuple(value.shape)}, expected {ndim} dimensions", tensor=name)
