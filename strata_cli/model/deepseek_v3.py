"""DeepSeek-V3 (and the models built on it: Kimi-K2, ...): multi-head latent attention in every
layer (model/mla.py), dense SwiGLU MLPs in the first `first_k_dense_replace` layers, then a MoE of
routed SwiGLU experts with sigmoid group-limited routing (model/sigmoid_routing.py) plus shared
experts, as transformers 5.24 defines `DeepseekV3ForCausalLM`.

Layouts read (`Model.sanitize`): transformers' (`kv_b_proj` per layer, experts per expert or fused
`experts.gate_up_proj` / `down_proj`) and mlx-lm's (`embed_q` / `unembed_out`, stacked
`switch_mlp`, quantized or not). The published checkpoints' multi-token-prediction layers
(`model.layers.N..` past `num_hidden_layers`, `num_nextn_predict_layers` of them) are loaded and
kept aside on `model.mtp` (`layers.KeptAside`), unused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ConfigError, ModelConfig
from .decoder_layer import PreNormLayer
from .layers import MLP, MTP_OPTIONAL, DecoderStack, KeptAside, RMSNorm, mtp_head_shapes
from .layout import stack_experts
from .mla import LatentAttention, Rope, split_kv_b
from .moe import SigmoidTopkRouter, SparseMoeBlock, SwitchGLU, weighted_sum


@dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    q_lora_rank: int | None = None
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers in the checkpoint (kept aside, unused)
    rope: Rope | None = None  # parsed from rope_theta / rope_scaling / rope_parameters

    INTERNAL_FIELDS: ClassVar[tuple[str, ...]] = ("rope",)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "DeepseekV3Config":
        """Raises ConfigError: a missing or mistyped field, a rope type other than default or
        yarn, routing other than sigmoid `noaux_tc`, `moe_layer_freq` other than 1, groups that
        do not split the experts."""
        params = dict(params)
        if "n_routed_experts" not in params and "num_local_experts" in params:
            params["n_routed_experts"] = params["num_local_experts"]
        for key in ("n_routed_experts", "n_shared_experts", "num_nextn_predict_layers"):
            if params.get(key) is None:
                params.pop(key, None)  # null: none
        if params.get("topk_method", "noaux_tc") != "noaux_tc" or params.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"routing {params.get('topk_method')!r} with {params.get('scoring_func')!r} scores is "
                              "not supported (only noaux_tc with sigmoid, DeepSeek-V3's)")
        if params.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {params['moe_layer_freq']!r} is not supported (only 1: every layer "
                              "from first_k_dense_replace on is a MoE, as transformers builds it)")
        if params.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {params['hidden_act']!r} is not supported (only silu)")
        cls.check_fields({k: v for k, v in params.items() if k != "rope"})
        params["rope"] = Rope.from_params(params, dims=params.get("qk_rope_head_dim", 0),
                                          traditional=params.get("rope_interleave", True))
        config = super().from_dict(params)
        if config.n_routed_experts:
            E, k = config.n_routed_experts, config.num_experts_per_tok
            if not 1 <= k <= E:
                raise ConfigError(f"num_experts_per_tok ({k}) must be in 1..n_routed_experts ({E})")
            if E % config.n_group or not 1 <= config.topk_group <= config.n_group:
                raise ConfigError(f"n_routed_experts ({E}) must split into n_group ({config.n_group}) groups, "
                                  f"of which topk_group ({config.topk_group}) are kept")
            if not config.moe_intermediate_size:
                raise ConfigError("a MoE config needs moe_intermediate_size (a positive integer)")
        return config

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts > 0 and index >= self.first_k_dense_replace


Config = DeepseekV3Config


class DeepseekMoE(SparseMoeBlock):
    """`SparseMoeBlock` (its experts, streaming and routing-policy hooks) with DeepSeek's router
    (`GroupLimitedTopK`) and ungated shared experts (`shared_experts`, n_shared × the expert width)."""

    def __init__(self, config: DeepseekV3Config):
        nn.Module.__init__(self)  # SparseMoeBlock's own router is a softmax Linear
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = SigmoidTopkRouter(hidden_size=config.hidden_size, num_experts=config.n_routed_experts,
                                      top_k=config.num_experts_per_tok, n_group=config.n_group,
                                      topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
                                      routed_scaling_factor=config.routed_scaling_factor)
        self.select = self.gate.rule
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts)
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    @property
    def correction_bias(self) -> mx.array:
        return self.gate.e_score_correction_bias

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k), float32. A routing policy
        (MoCE) ranks the biased, group-limited scores normalised to sum to 1."""
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        bias = self.correction_bias
        if self.routing_policy is None:
            return self.select(scores, bias)
        choice = mx.maximum(self.select.choice(scores, bias), 0.0)  # -inf (dropped groups) -> 0
        inds, mask = self.routing_policy(choice / choice.sum(axis=-1, keepdims=True), self.top_k)
        return inds, self.select.weigh(scores, inds, mask)

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        inds, weights = self.route(x)
        y = weighted_sum(self.switch_mlp(x, inds), weights)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


def latent_attention(config: DeepseekV3Config) -> LatentAttention:
    return LatentAttention(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope=config.rope,
        bias=config.attention_bias,
    )


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DeepseekV3Config, index: int):
        super().__init__()
        self.self_attn = latent_attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekMoE(config) if config.is_moe_layer(index) else MLP(config.hidden_size,
                                                                             config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


def mtp_shapes(config: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """The MTP tensors under `mtp.layers.i.*` as `sanitize` names them: a MoE decoder layer (experts
    stacked, `kv_b_proj` split), `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and `MTP_OPTIONAL`."""
    extra = mtp_head_shapes(config.hidden_size, config.vocab_size)
    layer = DecoderLayer(config, config.num_hidden_layers)
    shapes = {}
    for i in range(config.num_nextn_predict_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in extra.items()})
        shapes.update({f"layers.{i}.{k}": tuple(v.shape) for k, v in tree_flatten(layer.parameters())})
    return shapes


class Model(DecoderStack):
    """Token ids in, logits out; one latent KV state per layer comes from the caller (the engine)."""

    # The routing correction bias stays float32 in any compute dtype, as transformers and mlx-lm
    # keep it: in bfloat16 it would round the experts' ranking.
    FLOAT32_PARAMETERS: ClassVar[tuple[str, ...]] = ("e_score_correction_bias",)

    def __init__(self, config: DeepseekV3Config):
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.num_nextn_predict_layers:
            self.mtp = KeptAside(mtp_shapes(config))
        self.__dict__["skipped"] = {}  # what sanitize found missing, for `load_notes`

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        return [("latent_kv", {}) for _ in self.layers]

    @property
    def load_notes(self) -> list[str]:
        if "mtp" in self:
            count = len(tree_flatten(self.mtp.parameters()))
            return [f"MTP: {self.config.num_nextn_predict_layers} layer(s), {count} tensors loaded and kept aside "
                    "(model.mtp), unused"]
        if self.skipped.get("mtp_layers"):
            return [f"MTP: config.json lists {self.skipped['mtp_layers']} layer(s), the checkpoint holds none"]
        return []

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a transformers or mlx-lm checkpoint's tensors onto this module's parameters: the
        MTP layers to `mtp.layers.i.*`, `kv_b_proj` split into `embed_q` / `unembed_out`,
        experts stacked. A checkpoint without MTP tensors drops `self.mtp` and says 0 layers."""
        config, n = self.config, self.config.num_hidden_layers
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for key in [k for k in weights if k.startswith("model.layers.")]:
            index, rest = key[len("model.layers."):].split(".", 1)
            if int(index) >= n:
                weights[f"mtp.layers.{int(index) - n}.{rest}"] = weights.pop(key)
        mtp = [i for i in range(config.num_nextn_predict_layers) if any(k.startswith(f"mtp.layers.{i}.") for k in weights)]
        if "mtp" in self and not mtp:
            self.skipped.update(mtp_layers=config.num_nextn_predict_layers)
            self.pop("mtp")
            self.config = replace(config, num_nextn_predict_layers=0)
        elif "mtp" in self:
            missing = [k for k in MTP_OPTIONAL if not any(w.endswith(k) and w.startswith("mtp.") for w in weights)]
            if missing:  # rebuilt without the repeated embedding and head the checkpoint leaves out
                shapes = {k: s for k, s in mtp_shapes(config).items() if not k.endswith(tuple(missing))}
                self.mtp = KeptAside(shapes)
        prefixes = [f"model.layers.{i}" for i in range(n)]
        prefixes += [f"mtp.layers.{i}" for i in range(self.config.num_nextn_predict_layers)]
        for prefix in prefixes:
            split_kv_b(weights, f"{prefix}.self_attn", num_heads=config.num_attention_heads,
                       nope_dim=config.qk_nope_head_dim, v_dim=config.v_head_dim)
            if config.n_routed_experts:
                stack_experts(weights, f"{prefix}.mlp", config.n_routed_experts)
        return weights

    def quant_overrides(self, group_size: int):
        """mlx-lm's choice for this family: every quantizable layer at the model's bits (its
        router is no Linear, so it stays in float)."""
        return None
