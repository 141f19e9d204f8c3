"""DeepSeek-V4's attention block (model/deepseek_v4.py has the rest of the family): shared-KV
multi-query attention over a sliding window with per-head sinks, interleaved partial rotary (YaRN
on compressed layers) undone on the output, a grouped output projection, and the compressed
entries of CSA (overlapping windows, the lightning indexer's top-k) and HCA layers.

The compressors only say how a closed window of raw rows pools into an entry (`Compressor.pool`);
which rows are closed, kept and rolled back is the caller's state (engine/compressed_state.py).
Legend: B batch, T window rows, H heads, D head dim, n compressed entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .layer_state import CompressedAttentionState
from .layers import RMSNorm, RowLinear, RowSplit


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

    def __init__(self, config: ModelConfig, rate: int, rotary: Rotary):
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
    def __init__(self, config: ModelConfig, layer_type: str):
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
