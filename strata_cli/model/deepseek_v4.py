"""DeepSeek-V4 (`deepseek_v4`), as transformers defines it (`DeepseekV4ForCausalLM`).

Every attention block is shared-KV multi-query attention (one KV head read as keys and values)
over a sliding window of `sliding_window` cells, with per-head sinks, interleaved partial rotary
on each head's trailing `qk_rope_head_dim` channels (undone on the output), and a grouped
low-rank output projection. Compressed layers add long-range entries:

- CSA (`compressed_sparse_attention`, rate 4): each entry pools a window of `rate` rows and the
  previous window's first series (two series, width 2·rate, stride rate); a lightning indexer
  (its own compressor at `index_head_dim`) keeps the top `index_topk` entries per query;
- HCA (`heavily_compressed_attention`, rate 128): non-overlapping windows, no indexer.

A row at position p sees entry w when its window is closed, w < (p + 1) // rate. The residual is
`hc_mult` streams mixed by hyper-connections (Sinkhorn-projected); feed-forward blocks are MoE with
sqrt-softplus routing (hash-routed by token id on `hash_moe` layers), a shared expert and clamped
SwiGLU. The attention block is model/compressed_attention.py; the compressor tails live in the
caller's state (engine/compressed_state.py).

Legend: B batch, T window rows, N hc streams, H heads, D head dim, n compressed entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .compressed_attention import Attention, per_row, unit_rms
from .config import ConfigError, ModelConfig
from .layers import RMSNorm, RowLinear, by_row, lookup_embedding, tied_logits
from .moe import SparseMoeBlock, SwitchGLU, weighted_sum

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class DeepseekV4Config(ModelConfig):
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    moe_intermediate_size: int
    layer_types: tuple
    mlp_layer_types: tuple
    compress_rates: dict
    qk_rope_head_dim: int
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = False
    compress_rope: dict | None = None  # YaRN settings of the compressed layers' rotary, or None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "DeepseekV4Config":
        """The config as transformers normalises it (`DeepseekV4Config.__post_init__`): legacy
        `compress_ratios`, `compress_rate_csa/hca`, `num_hash_layers` and `qk_rope_head_dim`
        fold into `layer_types`, `compress_rates`, `mlp_layer_types` and the rotary width.

        Raises:
            ConfigError: a layer type or scoring function it does not know, rope scaling, more
                than one KV head, or a grouped projection that does not divide the heads.
        """
        params = dict(params)
        n = params.get("num_hidden_layers")
        if not isinstance(n, int):
            raise ConfigError("config.json for DeepseekV4Config lacks num_hidden_layers")
        rates = dict(params.get("compress_rates") or {"compressed_sparse_attention": 4,
                                                      "heavily_compressed_attention": 128})
        for key, name in (("compress_rate_csa", "compressed_sparse_attention"),
                          ("compress_rate_hca", "heavily_compressed_attention")):
            if params.get(key) is not None:
                rates[name] = params[key]
        layer_types = params.get("layer_types")
        if layer_types is None and params.get("compress_ratios") is not None:
            layer_types = [RATIO_TO_LAYER_TYPE.get(r, r) for r in params["compress_ratios"]][:n]
        if layer_types is None:
            tail = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
            layer_types = ["heavily_compressed_attention"] * min(n, 2) + tail
        mlp_types = params.get("mlp_layer_types")
        if mlp_types is None:
            hashed = params.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        factor = params.get("partial_rotary_factor")
        rope_dim = params.get("qk_rope_head_dim")
        if factor is not None:
            rope_dim = int(params["head_dim"] * factor)
        elif rope_dim is None:
            rope_dim = params["head_dim"] * 64 // 512
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", mlp_types, MLP_LAYER_TYPES)):
            bad = [t for t in types if t not in allowed]
            if bad or len(types) < n:
                raise ConfigError(f"{name} {list(types)}: need {n} entries from {allowed}")
        params.update(compress_rope=compress_rope(params))
        params.update(layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp_types[:n]),
                      compress_rates=rates, qk_rope_head_dim=rope_dim)
        config = super().from_dict(params)
        if config.scoring_func not in SCORING:
            raise ConfigError(f"scoring_func {config.scoring_func!r} is not one of {SCORING}")
        if config.num_key_value_heads != 1:
            raise ConfigError(f"num_key_value_heads {config.num_key_value_heads}: DeepSeek-V4 attention shares one KV head")
        if config.num_attention_heads % config.o_groups:
            raise ConfigError(f"o_groups {config.o_groups} does not divide num_attention_heads {config.num_attention_heads}")
        if rope_dim % 2 or rope_dim > min(config.head_dim, config.index_head_dim):
            raise ConfigError(f"rotary width {rope_dim} must be even and fit head_dim and index_head_dim")
        return config

    def rate(self, layer_type: str) -> int:
        return 0 if layer_type == "sliding_attention" else int(self.compress_rates[layer_type])


def compress_rope(params: dict) -> dict | None:
    """The compressed layers' YaRN settings (None: plain rotary), from `rope_parameters`
    ("main"/"compress", as transformers nests them) or a flat `rope_scaling`; the thetas move
    into `rope_theta` / `compress_rope_theta`.

    Raises:
        ConfigError: rotary scaling other than YaRN on the compressed layers, or any on the
            sliding ones (transformers applies YaRN to compressed layers only).
    """
    nested = params.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = nested["main"], nested["compress"]
    else:
        main, compress = {}, {**(params.get("rope_scaling") or {}), **{k: v for k, v in nested.items()
                                                                       if not isinstance(v, dict)}}
    for key, found in (("rope_theta", main.get("rope_theta")), ("compress_rope_theta", compress.get("rope_theta"))):
        if found is not None:
            params[key] = found
    kind = main.get("rope_type", main.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"rope scaling {kind!r} on sliding-window layers is not supported for deepseek_v4")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope scaling {kind!r} is not supported for deepseek_v4 (plain or YaRN only)")
    try:
        return {"factor": float(compress["factor"]),
                "original_max_position_embeddings": int(compress["original_max_position_embeddings"]),
                "beta_fast": float(compress.get("beta_fast") or 32), "beta_slow": float(compress.get("beta_slow") or 1),
                "attention_factor": float(compress.get("attention_factor", 1.0))}
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"YaRN rope parameters {compress}: {type(e).__name__} {e}") from None


Config = DeepseekV4Config


# -- hyper-connections --------------------------------------------------------------------------

class HyperConnection(nn.Module):
    """Weights that collapse the N streams into a block's input (pre), spread its output back
    (post) and mix the streams (comb, projected towards doubly stochastic by Sinkhorn)."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        N = config.hc_mult
        self.hc_mult, self.iters, self.hc_eps, self.eps = N, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = mx.zeros(((2 + N) * N, N * config.hidden_size))
        self.base = mx.zeros(((2 + N) * N,))
        self.scale = mx.ones((3,))

    def __call__(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """streams (B, T, N, C) -> post (B, T, N), comb (B, T, N, N), collapsed (B, T, C)."""
        B, T, N, C = streams.shape
        flat = unit_rms(streams.reshape(B, T, N * C).astype(mx.float32), self.eps)
        fn = self.fn.astype(mx.float32).T
        mixes = per_row(lambda rows: rows @ fn, flat)
        pre_b, post_b, comb_b = self.base[:N], self.base[N : 2 * N], self.base[2 * N :].reshape(N, N)
        pre = mx.sigmoid(mixes[..., :N] * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * mx.sigmoid(mixes[..., N : 2 * N] * self.scale[1] + post_b)
        comb = mx.softmax(mixes[..., 2 * N :].reshape(B, T, N, N) * self.scale[2] + comb_b, axis=-1,
                          precise=True) + self.hc_eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + self.hc_eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + self.hc_eps)
        collapsed = (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
        return post, comb, collapsed


def spread(post: mx.array, comb: mx.array, out: mx.array, streams: mx.array) -> mx.array:
    """post·out on every stream plus combᵀ @ streams."""
    dtype = streams.dtype
    mixed = per_row(lambda c, x: c.astype(dtype).swapaxes(-1, -2) @ x, comb, streams)
    return post.astype(dtype)[..., None] * out[..., None, :] + mixed


class HyperHead(nn.Module):
    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        N = config.hc_mult
        self.hc_eps, self.eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = mx.zeros((N, N * config.hidden_size))
        self.hc_base = mx.zeros((N,))
        self.hc_scale = mx.ones((1,))

    def __call__(self, streams: mx.array) -> mx.array:
        B, T, N, C = streams.shape
        flat = unit_rms(streams.reshape(B, T, N * C).astype(mx.float32), self.eps)
        fn = self.hc_fn.astype(mx.float32).T
        pre = mx.sigmoid(per_row(lambda rows: rows @ fn, flat) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)


# -- feed-forward -------------------------------------------------------------------------------

def clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    return nn.silu(mx.minimum(gate, limit)) * mx.clip(up, -limit, limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = RowLinear(hidden, inner, bias=False)
        self.up_proj = RowLinear(hidden, inner, bias=False)
        self.down_proj = RowLinear(inner, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Scores `score_fn(x @ Wᵀ)`; picks by score + correction bias, or by a frozen token-id ->
    experts table (`tid2eid`, hash-routed layers). Called alone it gives the logits, as the
    expert cache's router prefetch reads them (a guess only: hash layers pick by token)."""

    def __init__(self, config: DeepseekV4Config, *, hashed: bool):
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.scoring, self.scale = config.num_experts_per_tok, config.scoring_func, config.routed_scaling_factor
        self.weight = mx.zeros((E, config.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((config.vocab_size, self.top_k), dtype=mx.int32)
        else:
            self.e_score_correction_bias = mx.zeros((E,))

    def __call__(self, x: mx.array) -> mx.array:
        return by_row(lambda rows: rows @ self.weight.T, x)

    def route(self, x: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """x (M, H), tokens (M,) -> expert ids (M, k), weights (M, k)."""
        logits = self(x).astype(mx.float32)
        if self.scoring == "sqrtsoftplus":
            scores = mx.sqrt(nn.softplus(logits))
        elif self.scoring == "sigmoid":
            scores = mx.sigmoid(logits)
        else:
            scores = mx.softmax(logits, axis=-1, precise=True)
        if "tid2eid" in self:
            inds = self.tid2eid[tokens]
        else:
            biased = scores + self.e_score_correction_bias
            inds = mx.argpartition(-biased, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, weights * self.scale


class MoE(SparseMoeBlock):
    """Routed experts (`switch_mlp`: a `SwitchGLU` with clamped SwiGLU, so it quantizes and
    streams as every family's does) and a shared expert; its own router (above)."""

    def __init__(self, config: DeepseekV4Config, *, hashed: bool):
        nn.Module.__init__(self)
        limit = config.swiglu_limit
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, True
        self.gate = Router(config, hashed=hashed)
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                    partial(clamped_swiglu, limit=limit))
        self.shared_experts = SharedExpert(config.hidden_size, config.moe_intermediate_size, limit)

    def __call__(self, x: mx.array, tokens: mx.array) -> mx.array:
        if self.routing_policy is not None:
            raise ConfigError("cache-aware routing (--moce-protect) is not supported for deepseek_v4 "
                              "(its router scores are not a softmax)")
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        inds, weights = self.gate.route(flat, tokens.reshape(-1))
        routed = weighted_sum(self.switch_mlp(flat, inds), weights)
        return routed.reshape(B, T, C) + self.shared_experts(x)


# -- the stack ----------------------------------------------------------------------------------

class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config, i: int):
        super().__init__()
        self.layer_type = config.layer_types[i]
        self.self_attn = Attention(config, self.layer_type)
        self.mlp = MoE(config, hashed=config.mlp_layer_types[i] == "hash_moe")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def __call__(self, streams: mx.array, state, tokens: mx.array) -> mx.array:
        post, comb, collapsed = self.attn_hc(streams)
        streams = spread(post, comb, self.self_attn(self.input_layernorm(collapsed), state), streams)
        post, comb, collapsed = self.ffn_hc(streams)
        return spread(post, comb, self.mlp(self.post_attention_layernorm(collapsed), tokens), streams)


class Model(nn.Module):
    """Token ids in, logits out; each layer's compressed-attention state comes from the caller."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model.hc_head = HyperHead(config)
        if not config.tie_word_embeddings:
            self.lm_head = RowLinear(config.hidden_size, config.vocab_size, bias=False)
        self.__dict__["skipped_mtp"] = 0  # MTP tensors sanitize left out, for `load_notes`

    @property
    def load_notes(self) -> list[str]:
        """What the load left out of a published checkpoint (the CLI prints it with --stats)."""
        if not self.skipped_mtp:
            return []
        return [f"MTP: {self.skipped_mtp} tensors (mtp.*) left out: strata does not run DeepSeek-V4's MTP layers"]

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        c = self.config
        return [("compressed_attention", {"compress_rate": c.rate(t), "head_dim": c.head_dim,
                                          "index_head_dim": c.index_head_dim if t == "compressed_sparse_attention" else None})
                for t in c.layer_types]

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last row only."""
        h = lookup_embedding(self.model.embed_tokens, tokens)
        streams = mx.broadcast_to(h[:, :, None], (*h.shape[:2], self.config.hc_mult, h.shape[-1]))
        for layer, state in zip(self.layers, states):
            streams = layer(streams, state, tokens)
        if last_only:
            streams = streams[:, -1:]
        h = self.model.norm(self.model.hc_head(streams))
        if self.config.tie_word_embeddings:
            return tied_logits(self.model.embed_tokens, h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """DeepSeek's own names (what transformers' `save_pretrained` writes back, and the
        released checkpoints use) or transformers' in-memory ones -> this module's: per-expert
        w1/w3/w2 stacked as `switch_mlp`'s gate/up/down, a fused `gate_up_proj` split, the hash table as int32;
        MTP weights (`mtp.*`) are left out and counted (`load_notes`)."""
        renamed = {}
        for key, value in weights.items():
            name = key.removeprefix("model.")
            if name.startswith("mtp."):
                self.__dict__["skipped_mtp"] += 1
                continue
            for pattern, target in RENAMES:
                name = re.sub(pattern, target, name)
            renamed[name if name == "lm_head.weight" else "model." + name] = value
        if self.config.tie_word_embeddings:
            renamed.pop("lm_head.weight", None)
        E = self.config.n_routed_experts
        for i in range(len(self.layers)):
            prefix = f"model.layers.{i}.mlp"
            fused = renamed.pop(f"{prefix}.experts.gate_up_proj", None)
            if fused is not None:
                inner = fused.shape[1] // 2
                renamed[f"{prefix}.switch_mlp.gate_proj"] = fused[:, :inner]
                renamed[f"{prefix}.switch_mlp.up_proj"] = fused[:, inner:]
            down = renamed.pop(f"{prefix}.experts.down_proj", None)
            if down is not None:
                renamed[f"{prefix}.switch_mlp.down_proj"] = down
            for source, name in EXPERT_NAMES.items():
                per = [f"{prefix}.experts.{e}.{source}.weight" for e in range(E)]
                if all(k in renamed for k in per):
                    renamed[f"{prefix}.switch_mlp.{name}"] = mx.stack([renamed.pop(k) for k in per])
            table = f"{prefix}.gate.tid2eid"
            if table in renamed:
                renamed[table] = renamed[table].astype(mx.int32)
        return renamed


# DeepSeek's checkpoint names -> transformers' (this module's), applied in order to each key
# without its "model." prefix (transformers' conversion mapping for deepseek_v4).
RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def sparse_selection_length(config: DeepseekV4Config) -> int:
    """The context length from which a CSA row has more closed entries than the indexer keeps
    (so top-k selection changes what it attends to)."""
    return (config.index_topk + 1) * config.compress_rates["compressed_sparse_attention"]
