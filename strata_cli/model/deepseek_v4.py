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
SwiGLU. The compressor tails live in the caller's state (engine/compressed_state.py).

Legend: B batch, T window rows, N hc streams, H heads, D head dim, n compressed entries.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import ConfigError, ModelConfig
from .layer_state import CompressedAttentionState
from .layers import RMSNorm, RowLinear, RowSplit, by_row
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


# -- rotary, norms ------------------------------------------------------------------------------

def inv_freq(dims: int, base: float, yarn: dict | None = None) -> mx.array:
    """Rotary inverse frequencies (dims/2), YaRN-blended when `yarn` is given (transformers'
    `_compute_yarn_parameters`, with its truncated correction range)."""
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return dims * math.log(yarn["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope(x: mx.array, positions: mx.array, freqs: mx.array, *, inverse: bool = False, scale: float = 1.0) -> mx.array:
    """Interleaved rotary on x's trailing 2·len(freqs) channels; positions broadcast against
    x's row axis (x (..., T, C), positions (T,)); cos and sin times `scale` (YaRN's attention
    factor)."""
    rd = 2 * freqs.shape[0]
    angles = positions.astype(mx.float32)[:, None] * freqs  # (T, rd/2)
    cos, sin = mx.cos(angles) * scale, mx.sin(angles) * scale
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:]
    even, odd = tail[..., 0::2].astype(mx.float32), tail[..., 1::2].astype(mx.float32)
    rotated = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(tail.shape)
    return mx.concatenate([head, rotated.astype(x.dtype)], axis=-1)


def per_row(fn, *arrays: mx.array, axis: int = 1) -> mx.array:
    """`fn(*arrays)`, or, where `RowSplit` applies (a decode window on a GPU backend), `fn` of
    each row along `axis` of every array, concatenated: a row's products never depend on how
    many rows share the call (docs/design.md, "Row invariance")."""
    T = arrays[0].shape[axis]
    if not RowSplit.applies(T):
        return fn(*arrays)
    def row(a: mx.array, i: int) -> mx.array:
        return a[(slice(None),) * (axis % a.ndim) + (slice(i, i + 1),)]

    return mx.concatenate([fn(*(row(a, i) for a in arrays)) for i in range(T)], axis=axis)


@dataclass(frozen=True)
class Rotary:
    """One layer's rotary: its inverse frequencies and YaRN's attention factor."""

    freqs: mx.array
    scale: float = 1.0

    def __call__(self, x: mx.array, positions: mx.array, *, inverse: bool = False) -> mx.array:
        return rope(x, positions, self.freqs, inverse=inverse, scale=self.scale)


def unit_rms(x: mx.array, eps: float) -> mx.array:
    """RMSNorm without a weight, the mean square taken in float32."""
    return x * mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True) + eps).astype(x.dtype)


# -- compressors and the lightning indexer ------------------------------------------------------

class Compressor(nn.Module):
    """Pools each closed window of `rate` raw rows into one entry (softmax-gated with a
    positional bias, RMS-normed, rotary at the window's first position). With `overlap` the
    projections give two series (first D channels: the next entry's; last D: this one's)."""

    def __init__(self, hidden: int, dims: int, rate: int, *, overlap: bool, eps: float, rotary: Rotary):
        super().__init__()
        width = dims * (2 if overlap else 1)
        self.dims, self.rate, self.overlap, self._rotary = dims, rate, overlap, rotary
        self.kv_proj = RowLinear(hidden, width, bias=False)
        self.gate_proj = RowLinear(hidden, width, bias=False)
        self.position_bias = mx.zeros((rate, width))
        self.kv_norm = RMSNorm(dims, eps)

    def pool(self, kv: mx.array, gate: mx.array, has_prev: bool, first: int) -> mx.array:
        """kv, gate (B, (m + has_prev)·rate, W) -> entries first..first+m-1 (B, m, D)."""
        B, rows, W = kv.shape
        D, r, has_prev = self.dims, self.rate, int(has_prev)
        kv = kv.reshape(B, rows // r, r, W)
        gate = gate.reshape(B, rows // r, r, W).astype(mx.float32) + self.position_bias
        if self.overlap:
            m = rows // r - has_prev
            own_kv, own_gate = kv[:, has_prev:, :, D:], gate[:, has_prev:, :, D:]
            prev_kv, prev_gate = kv[:, :m, :, :D], gate[:, :m, :, :D]
            if not has_prev:  # the first window has no previous one: its slots weigh nothing
                prev_kv = mx.concatenate([mx.zeros_like(prev_kv[:, :1]), prev_kv[:, : m - 1]], axis=1)
                none = mx.full(prev_gate[:, :1].shape, -mx.inf, dtype=prev_gate.dtype)
                prev_gate = mx.concatenate([none, prev_gate[:, : m - 1]], axis=1)
            kv = mx.concatenate([prev_kv, own_kv], axis=2)
            gate = mx.concatenate([prev_gate, own_gate], axis=2)
        pooled = per_row(lambda k, g: self.kv_norm((k * mx.softmax(g, axis=2, precise=True).astype(k.dtype)).sum(axis=2)),
                         kv, gate)
        positions = (mx.arange(pooled.shape[1]) + first) * r
        return self._rotary(pooled, positions)

    def __call__(self, x: mx.array, tail) -> mx.array | None:
        return tail.compress(self.kv_proj(x), self.gate_proj(x), self.pool)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = RowLinear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The lightning indexer: its own overlapping compressor at `index_head_dim`, and per query
    the score Σ_h w_h · ReLU(q_h · k) of each closed entry; the top `index_topk` are kept."""

    def __init__(self, config: DeepseekV4Config, rate: int, rotary: Rotary):
        super().__init__(config.hidden_size, config.index_head_dim, rate, overlap=True, eps=config.rms_norm_eps,
                         rotary=rotary)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = RowLinear(config.q_lora_rank, self.heads * self.dims, bias=False)
        self.scorer = IndexerScorer(config.hidden_size, self.heads)

    def select(self, x: mx.array, q_residual: mx.array, tail, positions: mx.array) -> mx.array | None:
        """Which entries each row keeps: (B, T, n) bool, causal and top-k; None without entries."""
        keys = self(x, tail)
        if keys is None:
            return None
        B, T, _ = x.shape
        q = self.q_b_proj(q_residual).reshape(B, T, self.heads, self.dims)
        q = self._rotary(q.swapaxes(1, 2), positions).swapaxes(1, 2)  # (B, T, Hi, Di)
        w = self.scorer.weights_proj(x).astype(mx.float32) * self.heads**-0.5
        kt = keys.astype(mx.float32)[:, None].swapaxes(-1, -2)  # (B, 1, Di, n)

        def score(q, w):  # Σ_h w_h · ReLU(q_h · k) / sqrt(Di): (B, t, n)
            relu = mx.maximum(q.astype(mx.float32) @ kt, 0) * self.dims**-0.5  # (B, t, Hi, n)
            return (relu * w[..., None]).sum(axis=2)

        scores = per_row(score, q, w)
        causal = mx.arange(keys.shape[1]) < ((positions + 1) // self.rate)[:, None]  # (T, n)
        scores = mx.where(causal, scores, -mx.inf)
        return causal & top_k_mask(scores, min(self.topk, keys.shape[1]))


def top_k_mask(scores: mx.array, k: int) -> mx.array:
    """The k largest of each row of `scores` (..., n) as a mask; ties go to the lower index, so
    the set never depends on how many rows share the call."""
    n = scores.shape[-1]
    if k >= n:
        return mx.ones(scores.shape, dtype=mx.bool_)
    threshold = mx.sort(scores, axis=-1)[..., n - k : n - k + 1]  # the k-th largest
    above = scores > threshold
    ties = scores == threshold
    room = k - above.sum(axis=-1, keepdims=True)
    return above | (ties & (mx.cumsum(ties.astype(mx.int32), axis=-1) <= room))


# -- attention ----------------------------------------------------------------------------------

class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of `groups` head groups (in_per_group) to its own slice."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = mx.zeros((out_features, in_per_group))

    def __call__(self, x: mx.array) -> mx.array:
        """x (..., G, I) -> (..., G, O/G)."""
        w = self.weight.reshape(self.groups, -1, x.shape[-1]).swapaxes(-1, -2)  # (G, I, O/G)
        return per_row(lambda rows: (rows[..., None, :] @ w)[..., 0, :], x)


class Attention(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str):
        super().__init__()
        H, D = config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim, self.window = H, D, config.sliding_window
        self.eps, self.o_groups = config.rms_norm_eps, config.o_groups
        self.rate = config.rate(layer_type)
        theta = config.rope_theta if layer_type == "sliding_attention" else config.compress_rope_theta
        yarn = None if layer_type == "sliding_attention" else config.compress_rope
        self._rotary = Rotary(inv_freq(config.qk_rope_head_dim, theta, yarn), yarn["attention_factor"] if yarn else 1.0)
        self.q_a_proj = RowLinear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = RowLinear(config.q_lora_rank, H * D, bias=False)
        self.kv_proj = RowLinear(config.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(H * D // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = RowLinear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = mx.zeros((H,))
        if layer_type == "compressed_sparse_attention":
            self.compressor = Compressor(config.hidden_size, D, self.rate, overlap=True, eps=config.rms_norm_eps,
                                         rotary=self._rotary)
            self.compressor.indexer = Indexer(config, self.rate, self._rotary)
        elif layer_type == "heavily_compressed_attention":
            self.compressor = Compressor(config.hidden_size, D, self.rate, overlap=False, eps=config.rms_norm_eps,
                                         rotary=self._rotary)

    def __call__(self, x: mx.array, state: CompressedAttentionState) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        pos0 = state.offset
        positions = mx.arange(pos0, pos0 + T)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unit_rms(self.q_b_proj(q_residual).reshape(B, T, H, D), self.eps).swapaxes(1, 2)
        q = self._rotary(q, positions)  # (B, H, T, D)
        kv = self._rotary(self.kv_norm(self.kv_proj(x))[:, None], positions)  # (B, 1, T, D)
        cells, _ = state.update_and_fetch(kv, kv)
        entries = chosen = None
        if "compressor" in self:
            entries = self.compressor(x, state.compressor)
            if "indexer" in self.compressor:  # every tail sees every row, entries or not
                chosen = self.compressor.indexer.select(x, q_residual, state.indexer, positions)
        if RowSplit.applies(T):
            out = mx.concatenate([self.attend_row(q[:, :, i : i + 1], cells, entries, chosen, pos0, i)
                                  for i in range(T)], axis=2)
        else:
            out = self.attend_window(q, cells, entries, chosen, pos0)
        out = self._rotary(out, positions, inverse=True).swapaxes(1, 2)  # (B, T, H, D)
        grouped = self.o_a_proj(out.reshape(B, T, self.o_groups, -1)).reshape(B, T, -1)
        return self.o_b_proj(grouped)

    def attend_window(self, q: mx.array, cells: mx.array, entries: mx.array | None, chosen: mx.array | None,
                      pos0: int) -> mx.array:
        """Every row at once: the cells any row sees, each row's own masked."""
        B, _, T, D = q.shape
        positions = mx.arange(pos0, pos0 + T)
        lo = max(0, pos0 - self.window + 1)  # the earliest cell any row of the window sees
        keys = cells[:, :, lo:]
        seen = mx.arange(lo, pos0 + T)
        mask = (seen <= positions[:, None]) & (seen > positions[:, None] - self.window)  # (T, L)
        mask = mx.broadcast_to(mask, (B, T, mask.shape[1]))
        if entries is not None:
            visible = mx.arange(entries.shape[1]) < ((positions + 1) // self.rate)[:, None]
            if chosen is not None:
                visible = visible & chosen
            keys = mx.concatenate([keys, entries[:, None].astype(keys.dtype)], axis=2)
            mask = mx.concatenate([mask, mx.broadcast_to(visible, (B, T, visible.shape[-1]))], axis=-1)
        return attend_with_sinks(q, keys, mask[:, None], self.sinks, D**-0.5)

    def attend_row(self, q: mx.array, cells: mx.array, entries: mx.array | None, chosen: mx.array | None,
                   pos0: int, i: int) -> mx.array:
        """Row i alone, over exactly the cells and entries a one-row step at its position reads
        (GPU backends: its sums then never depend on the window's other rows)."""
        p = pos0 + i
        keys = cells[:, :, max(0, p - self.window + 1) : p + 1]
        mask = mx.ones((q.shape[0], 1, 1, keys.shape[2]), dtype=mx.bool_)
        closed = (p + 1) // self.rate if entries is not None else 0
        if closed:
            keys = mx.concatenate([keys, entries[:, None, :closed].astype(keys.dtype)], axis=2)
            picked = chosen[:, None, i : i + 1, :closed] if chosen is not None else mx.ones((q.shape[0], 1, 1, closed), dtype=mx.bool_)
            mask = mx.concatenate([mask, picked], axis=-1)
        return attend_with_sinks(q, keys, mask, self.sinks, q.shape[-1] ** -0.5)


def attend_with_sinks(q: mx.array, kv: mx.array, mask: mx.array, sinks: mx.array, scale: float) -> mx.array:
    """Softmax attention of q (B, H, T, D) over kv (B, 1, L, D) (keys and values alike) where
    mask (B, 1, T, L) allows, each head's sink logit in the denominator only."""
    scores = (q @ kv.swapaxes(-1, -2)) * scale
    scores = mx.where(mask, scores, -mx.inf)
    B, H, T, _ = scores.shape
    sink = mx.broadcast_to(sinks.astype(scores.dtype)[None, :, None, None], (B, H, T, 1))
    probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    return probs.astype(kv.dtype) @ kv


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
        h = self.model.embed_tokens(tokens)
        streams = mx.broadcast_to(h[:, :, None], (*h.shape[:2], self.config.hc_mult, h.shape[-1]))
        for layer, state in zip(self.layers, states):
            streams = layer(streams, state, tokens)
        if last_only:
            streams = streams[:, -1:]
        h = self.model.norm(self.model.hc_head(streams))
        if self.config.tie_word_embeddings:
            return by_row(self.model.embed_tokens.as_linear, h)
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
