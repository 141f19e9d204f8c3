"""Qwen3.5 / Qwen3.6: Qwen3-Next's 3:1 rhythm of gated-delta-rule and gated full-attention layers,
each followed by a dense MLP (`qwen3_5`) or a sparse MoE with a shared expert (`qwen3_5_moe`).

What differs from Qwen3-Next (model/qwen3_next.py), as transformers 5.24 defines it:

- the GDN projections are stored apart: `in_proj_qkv` ([q | k | v], head-major: already the conv's
  channel order), `in_proj_z`, `in_proj_b`, `in_proj_a`;
- rotary embedding is interleaved mRoPE. Text positions give the temporal, height and width
  sections the same position, so every rotary frequency sees that position and mRoPE is exactly
  the partial RoPE Qwen3-Next uses (`Qwen3_5TextRotaryEmbedding.recomposition_frequencies` only
  picks, per frequency, which of three equal angles to take);
- every MoE layer is sparse and renormalises its top-k (the MoE config has no
  `decoder_sparse_step`, `mlp_only_layers` or `norm_topk_prob`);
- the published checkpoints are multimodal: `text_config` + `vision_config` in config.json, the
  language model under `model.language_model.*`, the vision tower under `model.visual.*` (skipped:
  strata runs text), and MTP layers under `mtp.*` (kept aside, see `layers.KeptAside`).

Layouts read (`Model.sanitize`): the multimodal one above, transformers' text-only one
(`Qwen3_5TextConfig`, `model.*`), and mlx-lm's (`language_model.model.*`, norms already 1 + w,
conv weights (C, K, 1), stacked `switch_mlp` experts, quantized or not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ConfigError, ModelConfig, lift_rope_parameters
from .decoder_layer import PreNormLayer
from .gdn import GatedDeltaNet
from .layers import MLP, DecoderStack, KeptAside, RMSNorm, RowLinear, host_window, project, stack, stacked
from .layout import MLX, detect_layout, stack_experts
from .moe import SparseMoeBlock
from .quant import Quantization, router_overrides
from .qwen3_next import gated_attention, gated_delta_net

LINEAR, FULL = "linear_attention", "full_attention"
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# Where each layout keeps the language model: prefix -> strata's (model.*, lm_head, mtp.*).
PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.")
# Zero-centred RMSNorms (they scale by 1 + weight); the GDN layers' gated norm is not.
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
                ".pre_fc_norm_hidden.weight", ".pre_fc_norm_embedding.weight")
ZERO_CENTRED_KEYS = ("model.norm.weight", "mtp.norm.weight")


@dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int = 0  # the dense MLP (qwen3_5)
    num_experts: int = 0  # 0: dense (qwen3_5)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0  # MTP layers in the checkpoint (kept aside, unused)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Qwen3_5Config":
        """Build from config.json: the multimodal one (`text_config` inside; its top-level keys,
        `tie_word_embeddings` and those `strata convert` writes, take precedence, as in
        transformers) or a text-only one.

        Raises:
            ConfigError: a missing or mistyped field, rope scaling, a MoE config without experts.
        """
        params = dict(params)
        text = params.pop("text_config", None)
        if text is not None:
            if not isinstance(text, dict):
                raise ConfigError(f"text_config must be an object, got {text!r}")
            params = {**text, **{k: v for k, v in params.items() if k != "vision_config"}}
        params = lift_rope_parameters(params, ("rope_theta", "partial_rotary_factor"))
        is_moe = params.get("model_type") in MOE_TYPES
        if not is_moe:  # transformers' dense Qwen3.5 reads no MoE field
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
                params.pop(key, None)
        cls.check_fields(params)
        n = params.get("num_hidden_layers", 0)
        if not params.get("layer_types"):
            interval = params.get("full_attention_interval", 4)
            params["layer_types"] = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        params["layer_types"] = tuple(params["layer_types"])
        config = super().from_dict(params)
        if len(config.layer_types) != config.num_hidden_layers or set(config.layer_types) - {LINEAR, FULL}:
            raise ConfigError(
                f"layer_types must list {config.num_hidden_layers} entries of "
                f"{LINEAR!r}/{FULL!r}, got {list(config.layer_types)}"
            )
        if is_moe:
            lacking = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
                       if not getattr(config, k)]
            if lacking:
                raise ConfigError(f"{config.model_type} needs {', '.join(lacking)} (positive integers)")
        elif not config.intermediate_size:
            raise ConfigError(f"{config.model_type} needs intermediate_size (a positive integer)")
        return config

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


Config = Qwen3_5Config


PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's GDN layer (model/gdn.py) with Qwen3.5's four separate input projections.

    `in_proj_qkv` is already laid out as the conv's channels ([q | k | v], each head-major), so
    the split is a slice per output, where Qwen3-Next gathers columns per key head. The four
    projections run as one matmul (`layers.StackedRows`): on a GPU each matmul costs a launch
    and host dispatch, and a decode step is host-bound. State, conv, scan and kernels are the
    parent's: the GDN state kind and its rollback unchanged.
    """

    def __init__(self, *, hidden_size: int, **dims: int | float):
        super().__init__(hidden_size=hidden_size, **dims)
        for fused in ("in_proj_qkvz", "in_proj_ba"):
            self.pop(fused)
        self.in_proj_qkv = RowLinear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = RowLinear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = RowLinear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = RowLinear(hidden_size, self.num_v_heads, bias=False)

    def stack_linears(self) -> None:
        """Stack the four projections where their forms allow (`layers.stack_rows`, at load)."""
        stack(self, "_input_rows", *PROJECTIONS)
        self.tile_norm_weight()

    def project(self, x: mx.array):
        """x (B, T, H) -> conv inputs (B, T, C), z (B, T, Hv, Dv) (or (B, T, Hv·Dv) from the
        stack, `gate_by_heads`), b and a (B, T, Hv)."""
        B, T, _ = x.shape
        parts = [self[name] for name in PROJECTIONS]
        # The CPU's short calls run each row as numpy matrix-vector products, which read the
        # stack from memory once per row (T = 6: 10.7 ms against 9.1 apart, narrow 8-layer shape):
        # there the four stay apart, sharing one read of x.
        rows = None if host_window(x) else stacked(self, "_input_rows")
        if rows is None:  # also projections of different kinds (a mixed quantization)
            qkv, z, b, a = project(x, *parts)
            return qkv, z.reshape(B, T, self.num_v_heads, self.head_v_dim), b, a
        qkv, z, b, a = rows(x)
        return qkv, self.gate_by_heads(z), b, a


def feed_forward(config: Qwen3_5Config) -> nn.Module:
    if config.is_moe:
        return SparseMoeBlock(
            hidden_size=config.hidden_size,
            expert_size=config.moe_intermediate_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=True,
            shared_expert_size=config.shared_expert_intermediate_size,
        )
    return MLP(config.hidden_size, config.intermediate_size)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Qwen3_5Config, index: int):
        super().__init__()
        self.is_linear = config.layer_types[index] == LINEAR
        if self.is_linear:
            self.linear_attn = gated_delta_net(config, SplitGatedDeltaNet)
        else:
            self.self_attn = gated_attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


def mtp_shapes(config: Qwen3_5Config) -> dict[str, tuple[int, ...]]:
    """The MTP tensors a checkpoint with `mtp_num_hidden_layers` holds, under the names and shapes
    `sanitize` gives them (experts stacked as `switch_mlp.*`): per layer a full-attention decoder
    layer, plus `fc` (H, 2H) and three zero-centred norms (vLLM's `Qwen3_5MultiTokenPredictor`)."""
    H = config.hidden_size
    shapes = {"fc.weight": (H, 2 * H), "norm.weight": (H,), "pre_fc_norm_hidden.weight": (H,),
              "pre_fc_norm_embedding.weight": (H,)}
    layer = nn.Module()
    layer.input_layernorm = RMSNorm(H, config.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
    layer.self_attn = gated_attention(config)
    layer.mlp = feed_forward(config)
    for name, value in tree_flatten(layer.parameters()):
        for i in range(config.mtp_num_hidden_layers):
            shapes[f"layers.{i}.{name}"] = tuple(value.shape)
    return shapes


class Model(DecoderStack):
    """Token ids in, logits out; per-layer state comes from the caller (the window engine)."""

    def __init__(self, config: Qwen3_5Config):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.mtp_num_hidden_layers:
            self.mtp = KeptAside(mtp_shapes(config))
        self.__dict__["skipped"] = {}  # what sanitize left out of the model, for `load_notes`

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        """What state each layer needs: ("gdn", {conv_kernel}) or ("kv", {})."""
        return [
            ("gdn", {"conv_kernel": self.config.linear_conv_kernel_dim}) if layer.is_linear else ("kv", {})
            for layer in self.layers
        ]

    @property
    def load_notes(self) -> list[str]:
        """What the load did besides building the text model: the MTP layers kept aside (or their
        absence) and the vision tower left out, one line each."""
        notes = []
        if "mtp" in self:
            count = len(tree_flatten(self.mtp.parameters()))
            notes.append(f"MTP: {self.config.mtp_num_hidden_layers} layer(s), {count} tensors loaded and kept "
                         "aside (model.mtp), unused")
        elif self.skipped.get("mtp_layers"):
            notes.append(f"MTP: config.json lists {self.skipped['mtp_layers']} layer(s), the checkpoint holds none "
                         "(mlx-lm conversions drop them)")
        if self.skipped.get("vision"):
            notes.append(f"vision tower: {self.skipped['vision']} tensors skipped (strata runs text only)")
        return notes

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a multimodal, text-only or mlx-lm checkpoint's tensors onto this module's parameters.

        Only a Hugging Face checkpoint needs the family transforms (1 + w norms, (C, 1, K) conv);
        mlx-lm applied them before writing its layout. The vision tower is dropped (counted in
        `load_notes`); MTP tensors go to `self.mtp`. When the checkpoint holds no MTP tensors,
        `self.mtp` goes and `self.config` says 0 layers, so `strata convert` writes what is there.
        """
        out, vision = {}, 0
        for key, value in weights.items():
            if key.startswith(VISION_PREFIXES):
                vision += 1
                continue
            for old, new in PREFIXES:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            out[key] = value
        weights = out
        self.skipped.update(vision=vision)
        is_hf = _is_hf_layout(weights)
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        if "mtp" in self and not any(k.startswith("mtp.") for k in weights):
            self.skipped.update(mtp_layers=self.config.mtp_num_hidden_layers)
            self.pop("mtp")
            self.config = replace(self.config, mtp_num_hidden_layers=0)
        prefixes = [(f"model.layers.{i}", layer.is_linear) for i, layer in enumerate(self.layers)]
        prefixes += [(f"mtp.layers.{i}", False) for i in range(self.config.mtp_num_hidden_layers)]
        for prefix, is_linear in prefixes:
            key = f"{prefix}.linear_attn.conv1d.weight"
            if is_linear and key in weights and weights[key].ndim == 3:  # HF (C, 1, K), mlx-lm (C, K, 1) -> (C, K)
                weights[key] = weights[key].squeeze(1 if is_hf else 2)
            if self.config.is_moe:
                stack_experts(weights, f"{prefix}.mlp", self.config.num_experts)
        if not is_hf:
            return weights
        for k in list(weights):
            if k in ZERO_CENTRED_KEYS or k.endswith(ZERO_CENTRED):
                weights[k] = weights[k].astype(mx.float32) + 1.0  # in float32: 1 + w rounds in bf16
        return weights

    def sanitize_quantization(self, quantization: Quantization) -> Quantization:
        """mlx-lm records per-layer settings under its module paths (`language_model.model.*`);
        the same settings under this model's paths."""
        layers = {}
        for path, params in quantization.layers.items():
            for old, new in PREFIXES:
                if path.startswith(old):
                    path = new + path[len(old):]
                    break
            layers[path] = params
        return replace(quantization, layers=layers)

    def quant_overrides(self, group_size: int):
        """Per-layer quantization settings `strata convert` applies (mlx-lm's choice for this family:
        routers and shared-expert gates at 8 bits)."""
        return router_overrides(group_size)


def _is_hf_layout(weights: dict[str, mx.array]) -> bool:
    """HF stores the GDN conv weight (C, 1, K), mlx-lm (C, K, 1) (mlx-lm's own test); the expert
    tensors tell where there is no conv weight."""
    conv = next((v for k, v in weights.items() if k.endswith("linear_attn.conv1d.weight")), None)
    if conv is not None and conv.ndim == 3:
        return conv.shape[1] == 1
    return detect_layout(weights) != MLX
