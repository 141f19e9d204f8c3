"""Kimi delta attention (KDA, Kimi-Linear's linear layers): the gated delta rule with a decay per
key channel instead of one per head.

Legend: T rows, H heads (keys and values alike), D head dim, C = H·D, K conv kernel. Per row:

    S = diag(exp(g))·S;  S += k ⊗ β·(v − Sᵀk);  y = Sᵀq        g (H, D) <= 0, S (H, D, D)

The state kind is GDN's (engine/state.py: `GDNState`): the same S shape (B, H, Dk, Dv) in float32
and conv history, so a window's rows run from scratch copies and commit folds only the kept rows,
with the scan the window ran (`kda_step_scan` for decode windows, `chunked_kda_scan` for prompt
chunks of MIN_CHUNKED_ROWS or more). Module and parameter names are mlx-lm's (`q_conv.conv`, ...).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import gdn_window

from .gdn_chunked import MIN_CHUNKED_ROWS, default_chunk, unit_lower_inverse
from .layer_state import GDNRows, RecurrentState
from .layers import RMSNorm, RowLinear

l2_normalize = gdn_window.reference_l2_normalize


def f32(x: mx.array) -> mx.array:
    """x in float32 (itself when it is already: a cast is one more op per step)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def kda_step_scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """The rule one row at a time, float32. rows: q, k (B, T, H, D) l2-normalised (q scaled by
    D^-0.5), v (B, T, H, D), g (B, T, H, D) log-decays, beta (B, T, H); state (B, H, D, D).
    Returns outputs (B, T, H, D) and the state after the last row."""
    decay = mx.exp(rows.g)
    S, outputs = state, []
    for t in range(rows.q.shape[1]):
        k_t = rows.k[:, t, :, :, None]  # (B, H, Dk, 1)
        S = S * decay[:, t, :, :, None]
        memory = (S * k_t).sum(axis=-2)  # (B, H, Dv)
        delta = (rows.v[:, t] - memory) * rows.beta[:, t, :, None]
        S = S + k_t * delta[:, :, None, :]
        outputs.append((S * rows.q[:, t, :, :, None]).sum(axis=-2))
    return mx.stack(outputs, axis=1), S


def chunked_kda_scan(rows: GDNRows, state: mx.array, *, chunk: int | None = None) -> tuple[mx.array, mx.array]:
    """`kda_step_scan` in chunks of `chunk` rows (default `gdn_chunked.default_chunk()`), the WY form
    of model/gdn_chunked.py with the decay a diagonal matrix: with G_i the cumulative log-decay
    inside a chunk (per key channel) and S0 the chunk's start,

        (I + A)·U = diag(β)·V − diag(β)·(K ⊙ exp(G))·S0,   A_ij = β_i Σ_d k_id k_jd exp(G_id − G_jd)  (j < i)
        Y = (Q ⊙ exp(G))·S0 + M·U,  M_ij = Σ_d q_id k_jd exp(G_id − G_jd)  (j <= i)
        S ← exp(G_C)·S0 + (K ⊙ exp(G_C − G))ᵀ·U

    The pairwise decays exp(G_i − G_j) are taken as differences (never as a product of exp(G_i)
    and exp(−G_j), which overflows when a channel forgets fast), one chunk at a time so that the
    (C, C, D) decay block stays small.
    """
    B, T, H, D = rows.k.shape
    q, k, v = (a.astype(mx.float32) for a in (rows.q, rows.k, rows.v))
    g, beta = rows.g.astype(mx.float32), rows.beta.astype(mx.float32)
    C = chunk or default_chunk()
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padded rows have k = v = β = 0 and g = 0: they leave the state unchanged
        q, k, v, g = (mx.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (q, k, v, g))
        beta = mx.pad(beta, [(0, 0), (0, pad), (0, 0)])

    def chunks(a: mx.array) -> mx.array:  # (B, N·C, H, ...) -> (B, H, N, C, ...)
        return mx.moveaxis(a.reshape(B, N, C, H, *a.shape[3:]), 3, 1)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    G = mx.cumsum(g, axis=-2)  # (B, H, N, C, D)
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))[..., None]
    strict = mx.tril(mx.ones((C, C), dtype=mx.float32), k=-1)
    eye = mx.eye(C, dtype=mx.float32)
    S = state.astype(mx.float32)
    outputs = []
    for n in range(N):
        Gn, qn, kn, vn, bn = G[:, :, n], q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n]
        decay = mx.exp(mx.where(causal, Gn[:, :, :, None] - Gn[:, :, None], -mx.inf))  # (B, H, C, C, D)
        kj = kn[:, :, None] * decay  # k_j exp(G_i − G_j), at [i, j]
        A = bn[..., None] * (kn[:, :, :, None] * kj).sum(axis=-1) * strict
        inv = unit_lower_inverse(A + eye)
        u0 = inv @ (bn[..., None] * vn)
        w = inv @ (bn[..., None] * mx.exp(Gn) * kn)
        u = u0 - w @ S
        attn = (qn[:, :, :, None] * kj).sum(axis=-1)  # (B, H, C, C), zero above the diagonal
        outputs.append((qn * mx.exp(Gn)) @ S + attn @ u)
        last = Gn[:, :, -1:]  # (B, H, 1, D)
        S = mx.exp(last).swapaxes(-1, -2) * S + (kn * mx.exp(last - Gn)).swapaxes(-1, -2) @ u
    y = mx.stack(outputs, axis=2)  # (B, H, N, C, D)
    return mx.moveaxis(y, 1, 3).reshape(B, N * C, H, D)[:, :T], S


class ShortConv(nn.Module):
    """mlx-lm's `ShortConv1d` parameters: a depthwise conv weight `conv.weight` (C, K, 1), no bias."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.conv = nn.Module()
        self.conv.weight = mx.zeros((channels, kernel, 1))


class KimiDeltaAttention(nn.Module):
    """A KDA layer: q/k/v projections, a causal conv and silu each, l2-normalised q and k, the
    forget gate g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias) per channel, β = sigmoid(b_proj(x)),
    the rule above, then an RMSNorm gated by sigmoid(g_b(g_a(x))) and `o_proj`."""

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.q_proj = RowLinear(hidden_size, width, bias=False)
        self.k_proj = RowLinear(hidden_size, width, bias=False)
        self.v_proj = RowLinear(hidden_size, width, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(width, conv_kernel) for _ in range(3))
        self.f_a_proj = RowLinear(hidden_size, head_dim, bias=False)
        self.f_b_proj = RowLinear(head_dim, width, bias=False)
        self.b_proj = RowLinear(hidden_size, num_heads, bias=False)
        self.g_a_proj = RowLinear(hidden_size, head_dim, bias=False)
        self.g_b_proj = RowLinear(head_dim, width, bias=False)
        self.A_log = mx.zeros((1, 1, num_heads, 1))
        self.dt_bias = mx.zeros((width,))
        self.o_norm = RMSNorm(head_dim, eps)
        self.o_proj = RowLinear(width, hidden_size, bias=False)

    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        """x (B, T, H) -> the core's inputs (conv inputs [q | k | v], forget logits, β logits)
        and the tail's (the output gate)."""
        raw = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        return (raw, self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)), (self.g_b_proj(self.g_a_proj(x)),)

    def core(self, raw: mx.array, forget: mx.array, b: mx.array, state: RecurrentState) -> mx.array:
        """Causal conv over the state's history and the rule from its state -> (B, T, H, D) float32."""
        B, T, _ = raw.shape
        H, D = self.num_heads, self.head_dim
        window = state.conv_window(raw)
        mixed = nn.silu(gdn_window.reference_causal_conv(window, self.conv_weight()))
        q, k, v = (a.reshape(B, T, H, D) for a in mx.split(mixed, 3, axis=-1))
        q = l2_normalize(q) * D**-0.5
        k = l2_normalize(k)
        g = f32(forget).reshape(B, T, H, D) + f32(self.dt_bias).reshape(H, D)
        g = -mx.exp(f32(self.A_log).reshape(H, 1)) * nn.softplus(g)
        scan = chunked_kda_scan if T >= MIN_CHUNKED_ROWS else kda_step_scan
        return state.recur(GDNRows(q, k, f32(v), g, mx.sigmoid(f32(b))), scan)

    def conv_weight(self) -> mx.array:
        """The three convs' weights as one (3C, K), made again only when a weight array changes."""
        parts = (self.q_conv.conv.weight, self.k_conv.conv.weight, self.v_conv.conv.weight)
        cached = self.__dict__.get("_conv_weight")
        if cached is None or any(a is not b for a, b in zip(cached[0], parts)):
            cached = self.__dict__["_conv_weight"] = (parts, mx.concatenate(parts)[..., 0])
        return cached[1]

    def tail(self, y: mx.array, gate: mx.array) -> mx.array:
        """Rule outputs (B, T, H, D) float32 -> the gated norm in float32 -> (B, T, hidden)."""
        B, T = y.shape[:2]
        gate = gate.reshape(B, T, self.num_heads, self.head_dim)
        out = mx.fast.rms_norm(y, self.o_norm.weight.astype(mx.float32), self.o_norm.eps)
        out = (out * mx.sigmoid(gate.astype(mx.float32))).astype(gate.dtype)
        return self.o_proj(out.reshape(B, T, -1))

    def __call__(self, x: mx.array, state: RecurrentState) -> mx.array:
        core_in, tail_in = self.head(x)
        return self.tail(self.core(*core_in, state), *tail_in)
