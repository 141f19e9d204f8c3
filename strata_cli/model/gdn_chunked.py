"""The gated delta rule in chunked form, for prompt chunks: matmuls instead of a per-row loop.

Legend: B batch, H = Hv value heads, T rows, C = CHUNK rows per chunk, N = chunks, Dk/Dv head dims.
Per row the rule is (model/gdn.py: gated_delta_scan) S_t = γ_t·S_{t-1} + k_t·u_tᵀ with
u_t = β_t·(v_t − γ_t·S_{t-1}ᵀk_t) and y_t = S_tᵀq_t, γ_t = exp(g_t). Inside a chunk that starts
from S0, with G_i the cumulative log-decay and Γ_i = exp(G_i):

    (I + A)·U = diag(β)·V − diag(β·Γ)·K·S0,   A_ij = β_i·exp(G_i − G_j)·k_iᵀk_j  (j < i)

so U = U0 − W·S0 with the WY/UT terms U0 = (I + A)⁻¹·diag(β)·V and W = (I + A)⁻¹·diag(β·Γ)·K,
computed for every chunk at once. Only the chunk states are then stepped in order,
S ← Γ_C·S0 + (K·exp(G_C − G))ᵀ·U, and every output is Y = diag(Γ)·Q·S0 + (M ⊙ QKᵀ)·U with
M_ij = exp(G_i − G_j) for j ≤ i — the form of flash-linear-attention's `chunk_gated_delta_rule`.
The triangular inverse doubles its diagonal blocks (1, 2, 4, ... C rows), log2(C) batched matmul
steps, in plain MLX ops so it runs on every backend.
"""

from __future__ import annotations

import mlx.core as mx

from .layer_state import GDNRows
from .layers import prompt_streams

CHUNK = 32  # rows per chunk (FLA uses 64): on the CPU 32 ties 16 with half its sequential steps; 64 is slower
# On a GPU the sequential chunk steps are what costs: one 80B-A3B GDN layer's 2,048-row scan takes
# 11.0 / 5.9 / 3.9 / 3.3 ms at chunks 16 / 32 / 64 / 128 on the H200 (docs/benchmarks.md, "H200:
# where a 2,048-row prompt chunk goes");
# 64 is flash-linear-attention's choice and tested to the same tolerance.
GPU_CHUNK = 64
MIN_CHUNKED_ROWS = 16  # shorter windows (every decode window: T <= 8) keep the exact per-row scan


def unit_lower_inverse(L: mx.array) -> mx.array:
    """Inverse of unit lower-triangular matrices (..., C, C), C a power of two.

    Block doubling: inv([[L11, 0], [L21, L22]]) = [[X11, 0], [-X22·L21·X11, X22]], starting from
    the unit diagonal, so each step is two batched matmuls over every block of every chunk.
    """
    C = L.shape[-1]
    lead = L.shape[:-2]
    inv = mx.ones((*lead, C, 1, 1), dtype=L.dtype)  # (..., blocks, b, b), b = 1
    b = 1
    while b < C:
        s, n = 2 * b, C // (2 * b)
        diag = mx.diagonal(L.reshape(*lead, n, s, n, s), axis1=-4, axis2=-2)  # (..., s, s, n)
        lower = mx.moveaxis(diag, -1, -3)[..., b:, :b]  # (..., n, b, b): the L21 of each block
        x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x21 = -(x22 @ lower @ x11)
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        bottom = mx.concatenate([x21, x22], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        b = s
    return inv.reshape(*lead, C, C)


def default_chunk() -> int:
    return CHUNK if mx.default_device() == mx.cpu else GPU_CHUNK


def chunked_gated_delta_scan(rows: GDNRows, state: mx.array, *, chunk: int | None = None) -> tuple[mx.array, mx.array]:
    """The gated delta rule over all rows in chunks; same contract as `gated_delta_scan`.

    Args:
        rows: post-conv inputs; q, k l2-normalised, q scaled by Dk^-0.5 (model/gdn.py).
        state: (B, Hv, Dk, Dv) float32, the state before the first row.
        chunk: rows per chunk, a power of two (default `default_chunk()`: CHUNK on the CPU,
            GPU_CHUNK elsewhere).

    Returns:
        outputs (B, T, Hv, Dv) float32 and the state after the last row.
    """
    B, T, Hk, Dk = rows.k.shape
    Hv, Dv = rows.v.shape[2], rows.v.shape[3]
    q, k = rows.q.astype(mx.float32), rows.k.astype(mx.float32)
    if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    v = rows.v.astype(mx.float32)
    g, beta = rows.g.astype(mx.float32), rows.beta.astype(mx.float32)
    C = chunk or default_chunk()
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padded rows have k = v = β = 0 and g = 0: they leave the state unchanged
        q, k, v = (mx.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (q, k, v))
        g, beta = (mx.pad(a, [(0, 0), (0, pad), (0, 0)]) for a in (g, beta))

    def chunks(a: mx.array) -> mx.array:  # (B, N·C, H, ...) -> (B, H, N, C, ...)
        a = a.reshape(B, N, C, Hv, *a.shape[3:])
        return mx.moveaxis(a, 3, 1)

    q, k, v = chunks(q), chunks(k), chunks(v)  # (B, H, N, C, D)
    g, beta = chunks(g), chunks(beta)  # (B, H, N, C)
    G = mx.cumsum(g, axis=-1)
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    diff = G[..., :, None] - G[..., None, :]  # G_i - G_j
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # (B, H, N, C, C), zero above the diagonal
    strict = mx.tril(mx.ones((C, C), dtype=mx.float32), k=-1)
    A = (beta[..., None] * decay * strict) * (k @ k.swapaxes(-1, -2))
    inv = unit_lower_inverse(A + mx.eye(C, dtype=mx.float32))
    gamma = mx.exp(G)  # (B, H, N, C)
    u0 = inv @ (beta[..., None] * v)  # (B, H, N, C, Dv)
    w = inv @ ((beta * gamma)[..., None] * k)  # (B, H, N, C, Dk)
    attn = decay * (q @ k.swapaxes(-1, -2))  # (B, H, N, C, C)
    k_out = (mx.exp(G[..., -1:] - G)[..., None] * k).swapaxes(-1, -2)  # (B, H, N, Dk, C)
    gamma_last = gamma[..., -1, None, None]  # (B, H, N, 1, 1)

    starts, us = [], []
    S = state.astype(mx.float32)
    for n in range(N):  # only the chunk states step in order
        u = u0[:, :, n] - w[:, :, n] @ S
        starts.append(S)
        us.append(u)
        S = gamma_last[:, :, n] * S + k_out[:, :, n] @ u
    S0 = mx.stack(starts, axis=2)  # (B, H, N, Dk, Dv)
    U = mx.stack(us, axis=2)  # (B, H, N, C, Dv)
    y = (gamma[..., None] * q) @ S0 + attn @ U  # (B, H, N, C, Dv)
    y = mx.moveaxis(y, 1, 3).reshape(B, N * C, Hv, Dv)
    return y[:, :T], S


def chunked_scan_over_streams(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`chunked_gated_delta_scan` on the CPU with the heads in two halves, one per CPU prompt
    stream (`layers.prompt_streams`: a core each); heads never mix, so every sum is unchanged.
    Elsewhere, or with an odd number of key heads, the plain call."""
    streams = prompt_streams()
    Hk, Hv = rows.k.shape[2], rows.v.shape[2]
    if mx.default_device() != mx.cpu or len(streams) < 2 or Hk % 2:
        return chunked_gated_delta_scan(rows, state)
    hk, hv = Hk // 2, Hv // 2  # value head h reads key head h // (Hv / Hk): the halves match
    outputs, states = [], []
    for i, stream in enumerate(streams[:2]):
        keys, values = slice(i * hk, (i + 1) * hk), slice(i * hv, (i + 1) * hv)
        half = GDNRows(rows.q[:, :, keys], rows.k[:, :, keys], rows.v[:, :, values], rows.g[:, :, values],
                       rows.beta[:, :, values])
        with mx.stream(stream):
            y, S = chunked_gated_delta_scan(half, state[:, values])
        outputs.append(y)
        states.append(S)
    return mx.concatenate(outputs, axis=2), mx.concatenate(states, axis=1)
