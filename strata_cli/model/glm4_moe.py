"""GLM-4.5 / 4.6 / 4.7 (and their Air models): full attention in every layer, each followed by a
dense SwiGLU MLP (the first `first_k_dense_replace` layers) or a MoE of routed experts under a
sigmoid router with a score-correction bias and group-limited top-k (`moe.SigmoidTopkRouter`),
scaled by `routed_scaling_factor`, plus `n_shared_experts` shared experts as one MLP.

Attention, as transformers 5.24's `Glm4MoeAttention` defines it: biases on q, k and v only
(`attention_bias`), optional per-head q/k RMSNorm (`use_qk_norm`), rotary embedding on the first
`partial_rotary_factor` of each head's dims (rotate-half form), `head_dim` from config.json.

The published checkpoints append `num_nextn_predict_layers` multi-token-prediction layers after
the last decoder layer, under the next layer indices (`model.layers.{N}.*`: `eh_proj`, `enorm`,
`hnorm`, `shared_head.norm`, optionally `embed_tokens` and `shared_head.head`, and one MoE
decoder layer; vLLM's `Glm4MoeMultiTokenPredictorLayer` names). They are loaded and kept aside
(`layers.KeptAside`) at those very indices, so `strata convert` writes them back under their
published names, which mlx-lm drops on load as its own converter does.

Layouts read (`Model.sanitize`): transformers' save (per-expert tensors) and in-memory state dict
(fused `experts.gate_up_proj` / `down_proj`), the published one (per-expert, MTP layers), and
mlx-lm's (`switch_mlp` stacks, quantized or not; its conversions hold no MTP layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .attention import GatedAttention
from .config import ConfigError, ModelConfig, lift_rope_parameters
from .decoder_layer import PreNormLayer
from .layers import MLP, MTP_OPTIONAL, DecoderStack, KeptAside, RMSNorm, mtp_head_shapes
from .layout import stack_experts
from .moe import SigmoidTopkRouter, SparseMoeBlock, SwitchGLU, weighted_sum


@dataclass(frozen=True)
class Glm4MoeConfig(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float = 0.5  # transformers' default for this family
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (kept aside, unused)

    # written into `strata convert`'s config.json where SRC lacks it: mlx-lm's glm4_moe requires the key
    WRITTEN_DEFAULTS: ClassVar[dict[str, Any]] = {"rope_scaling": None}
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"n_shared_experts", "first_k_dense_replace"})
    POSITIVE_FLOATS: ClassVar[frozenset[str]] = ModelConfig.POSITIVE_FLOATS | {"partial_rotary_factor"}

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Glm4MoeConfig":
        """Build from config.json (published, transformers 5's or mlx-lm's spelling).

        Raises:
            ConfigError: a missing or mistyped field, rope scaling, an activation other than
                SiLU, routing other than sigmoid scores with a correction bias ("noaux_tc").
        """
        params = lift_rope_parameters(params, ("rope_theta", "partial_rotary_factor"))
        for alias, name in (("num_mtp_layers", "num_nextn_predict_layers"), ("num_local_experts", "n_routed_experts")):
            if alias in params and name not in params:
                params[name] = params[alias]
        for key, supported in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if params.get(key, supported) != supported:
                raise ConfigError(f"{key} {params[key]!r} is not supported (only {supported!r})")
        config = super().from_dict(params)
        if config.head_dim is None:
            config = replace(config, head_dim=config.hidden_size // config.num_attention_heads)
        if config.partial_rotary_factor > 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {config.partial_rotary_factor}")
        if config.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {config.partial_rotary_factor} of head_dim {config.head_dim} "
                              f"gives {config.rotary_dim} rotary dims; they must be even")
        return config

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


Config = Glm4MoeConfig


class Glm4MoeBlock(SparseMoeBlock):
    """`SparseMoeBlock`'s experts and hooks (streaming, the expert cache) with GLM's router
    (`gate`: weight and `e_score_correction_bias`) and ungated shared experts added to the routed
    sum. Approximate cache-aware routing (MoCE) ranks softmax probabilities, which this router
    does not have: `takes_routing_policy` is False, and experts/moce.py refuses it."""

    takes_routing_policy = False

    def __init__(self, config: Glm4MoeConfig):
        nn.Module.__init__(self)  # SparseMoeBlock's own router would be a linear named `gate`
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = SigmoidTopkRouter(
            hidden_size=config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            n_group=config.n_group, topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
        )
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts)
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k), float32."""
        return self.gate.select(x)

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        inds, weights = self.route(x)
        y = weighted_sum(self.switch_mlp(x, inds), weights)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Glm4MoeConfig, index: int):
        super().__init__()
        self.self_attn = GatedAttention(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
            rope_theta=config.rope_theta, eps=config.rms_norm_eps, bias=config.attention_bias, output_bias=False,
            output_gate=False, qk_norm=config.use_qk_norm,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Glm4MoeBlock(config) if config.is_moe_layer(index) else MLP(config.hidden_size,
                                                                                 config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


def mtp_shapes(config: Glm4MoeConfig, optional: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """One MTP layer's tensors under the names and shapes `sanitize` gives them (experts stacked as
    `mlp.switch_mlp.*`): a MoE decoder layer, `eh_proj` (H, 2H), three norms, and the `optional`
    names of MTP_OPTIONAL the checkpoint holds (each (V, H))."""
    shapes = mtp_head_shapes(config.hidden_size, config.vocab_size, optional)
    layer = DecoderLayer(config, config.num_hidden_layers)
    shapes.update((name, tuple(value.shape)) for name, value in tree_flatten(layer.parameters()))
    return shapes


class Model(DecoderStack):
    """Token ids in, logits out; per-layer KV state comes from the caller (the window engine).

    `model.layers` holds the N decoder layers, then the MTP layers kept aside; `layers` (what the
    forward pass and the engine see) only the decoder layers."""

    # The router in float32 whatever the model computes in, as transformers keeps it: the
    # correction bias decides near-ties between experts, which bfloat16 would round away.
    FLOAT32_PARAMETERS: ClassVar[tuple[str, ...]] = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(self, config: Glm4MoeConfig):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.model.layers.extend(KeptAside(mtp_shapes(config)) for _ in range(config.num_nextn_predict_layers))
        self.__dict__["mtp_absent"] = 0  # MTP layers config.json lists and the checkpoint lacks

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers[: self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[KeptAside]:
        return self.model.layers[self.config.num_hidden_layers:]

    @property
    def load_notes(self) -> list[str]:
        """The MTP layers kept aside, or config.json's that the checkpoint lacks: one line."""
        if self.mtp_layers:
            first = self.config.num_hidden_layers
            count = sum(len(tree_flatten(layer.parameters())) for layer in self.mtp_layers)
            return [f"MTP: {len(self.mtp_layers)} layer(s) (model.layers.{first}), {count} tensors loaded and "
                    "kept aside, unused"]
        if self.mtp_absent:
            return [f"MTP: config.json lists {self.mtp_absent} layer(s), the checkpoint holds none "
                    "(transformers' save and mlx-lm conversions drop them)"]
        return []

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face, published or mlx-lm checkpoint's tensors onto this module's parameters:
        experts stacked (per-expert or fused) in the MoE layers and the MTP layers alike."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        total = self.config.num_hidden_layers + self.config.num_nextn_predict_layers
        for i in range(self.config.first_k_dense_replace, total):
            stack_experts(weights, f"model.layers.{i}.mlp", self.config.n_routed_experts)
        return weights

    def fit_to_checkpoint(self, weights: dict[str, mx.array]) -> None:
        """Shape the MTP layers to what the checkpoint holds (every layout, strata's own too): none
        at all (mlx-lm drops them; `self.config` then says 0 layers, so `strata convert` writes
        what is there), or each with the MTP_OPTIONAL tensors it has."""
        first = self.config.num_hidden_layers
        if self.mtp_layers and not any(k.startswith(f"model.layers.{first}.") for k in weights):
            self.__dict__["mtp_absent"] = len(self.mtp_layers)
            del self.model.layers[first:]
            self.config = replace(self.config, num_nextn_predict_layers=0)
            return
        for i in range(len(self.mtp_layers)):
            optional = tuple(name for name in MTP_OPTIONAL if f"model.layers.{first + i}.{name}" in weights)
            if optional:
                self.model.layers[first + i] = KeptAside(mtp_shapes(self.config, optional))
