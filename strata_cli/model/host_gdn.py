"""A GDN mixer's call on the CPU's host path, in numpy: projections, causal conv, the gated
delta rule and the gated norm, from the layer's normed rows to its output projection's input.

On the CPU a short call (`layers.host_window`) runs its linears as numpy matrix-vector
products, and every MLX op costs ~5-10 µs of dispatch on the CPU stream's thread where the
same numpy op on a decode row costs ~1 µs (docs/benchmarks.md, "CPU decode windows through
numpy"): the mixer's ~90 small MLX ops a layer were most of a one-row step. Here the state stays
the engine's (`RecurrentState`: its conv history and recurrent state are MLX arrays, its rules
untouched); the layer reads the joined conv window back once and hands the rows to
`state.recur` with `scan`, the numpy recurrence, which the state's commit folds then repeat.

Row invariance (docs/design.md): every step is per row or per element: elementwise ops (exact,
or numpy's SIMD transcendental loops, the same arithmetic for every element of a contiguous
array), reductions over one row's own contiguous axis, and the recurrence one row a call,
each call of the same shapes whatever T is (OpenBLAS's gemv, as `host_blas.rows_linears`).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from metal_shaders.gdn_window import L2_EPS

from .gdn import GatedDeltaNet, projection_columns
from .host_blas import matvecs, sigmoid
from .layer_state import GDNRows, RecurrentState
from .layers import GatedRMSNorm, RowLinear


def applies(mixer, rows: int) -> bool:
    """Whether `mixer` is a plain float32 `GatedDeltaNet` this module computes for a call of
    `rows` rows: not where the GDN window kernels take it (the tests emulate them on the CPU)."""
    return (type(mixer) is GatedDeltaNet and not mixer.takes_kernels(rows, mx.float32)
            and type(mixer.norm) is GatedRMSNorm
            and all(type(linear) is RowLinear and "bias" not in linear and linear.weight.dtype == mx.float32
                    for linear in (mixer.in_proj_qkvz, mixer.in_proj_ba))
            and all(a.dtype == mx.float32 for a in (mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight)))


@lru_cache
def columns(nk: int, nv: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    """`gdn.projection_columns` as flat numpy indices: conv inputs, z (of in_proj_qkvz), b, a (of in_proj_ba)."""
    return tuple(np.asarray(c).reshape(-1).astype(np.intp) for c in projection_columns(nk, nv, dk, dv))


class Constants:
    """A mixer's arrays in the forms the numpy call takes, made once per set of weight arrays
    (remade when any is replaced: loading, `set_dtype`). A plain object, kept in the mixer's
    `__dict__`, so no parameter."""

    __slots__ = ("sources", "qkvz", "ba", "conv", "neg_A", "dt_bias", "norm")

    def __init__(self, mixer: GatedDeltaNet, sources: tuple):
        self.sources = sources
        self.qkvz, self.ba = np.asarray(mixer.in_proj_qkvz.weight), np.asarray(mixer.in_proj_ba.weight)
        self.conv = np.ascontiguousarray(np.asarray(mixer.conv1d.weight).T)  # (K, C): tap j's weights contiguous
        self.neg_A = -np.exp(np.asarray(mixer.A_log))
        self.dt_bias, self.norm = np.asarray(mixer.dt_bias), np.asarray(mixer.norm.weight)


def constants(mixer: GatedDeltaNet) -> Constants:
    sources = (mixer.in_proj_qkvz.weight, mixer.in_proj_ba.weight, mixer.conv1d.weight, mixer.A_log,
               mixer.dt_bias, mixer.norm.weight)
    held = mixer.__dict__.get("_host_constants")
    if held is None or any(a is not b for a, b in zip(held.sources, sources)):
        mx.eval(sources)
        held = mixer.__dict__["_host_constants"] = Constants(mixer, sources)
    return held


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x (..., D) over its last axis, as `gdn_window.reference_l2_normalize` (float32)."""
    return x / np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS))


def mix(mixer: GatedDeltaNet, normed: np.ndarray, state: RecurrentState) -> np.ndarray:
    """The normed rows (N, H) of one sequence -> the output projection's input (N, Hv·Dv):
    `GatedDeltaNet.head`, `core` and `tail_input` on the host."""
    c = constants(mixer)
    N = normed.shape[0]
    Hk, Hv, Dk, Dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    raw_cols, z_cols, b_cols, a_cols = columns(Hk, Hv, Dk, Dv)
    qkvz, ba = matvecs(normed, [c.qkvz, c.ba])
    # The conv history is the state's, joined here (B = 1).
    joined = state.conv_window_host(qkvz[None, :, raw_cols])[0]  # (K-1+N, C)
    taps = c.conv
    conv = joined[0:N] * taps[0]
    for j in range(1, taps.shape[0]):
        conv = conv + joined[j:j + N] * taps[j]
    mixed = conv * sigmoid(conv)
    key_dim = Hk * Dk
    q = l2_normalize(mixed[:, :key_dim].reshape(N, Hk, Dk)) * np.float32(Dk ** -0.5)
    k = l2_normalize(mixed[:, key_dim:2 * key_dim].reshape(N, Hk, Dk))
    v = np.ascontiguousarray(mixed[:, 2 * key_dim:]).reshape(N, Hv, Dv)
    beta = sigmoid(ba[:, b_cols])
    g = c.neg_A * np.logaddexp(ba[:, a_cols] + c.dt_bias, np.float32(0.0))  # -exp(A)·softplus(a + dt_bias)
    rows = GDNRows(*(mx.array(a[None]) for a in (q, k, v, g, beta)))
    y = np.asarray(state.recur(rows, scan))[0]  # (N, Hv, Dv); evaluated already (scan's own array)
    return gated_norm(y, qkvz[:, z_cols].reshape(N, Hv, Dv), c.norm, mixer.norm.eps).reshape(N, Hv * Dv)


def scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`gdn.gated_delta_scan` in numpy (a `Scan`): per row, S = S·exp(g); S += k ⊗ (v - Sᵀk)·β;
    y = Sᵀq, one row at a time with the same calls whatever the number of rows, so a window's
    rows, a serial step and a commit fold of kept rows compute the same bits. B = 1."""
    q, k, v, g, beta = (np.asarray(a)[0] for a in (rows.q, rows.k, rows.v, rows.g, rows.beta))
    Hk, Hv = k.shape[1], v.shape[1]
    if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads
        q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)
    S = np.asarray(state)[0]  # (Hv, Dk, Dv), read only: each row makes a new S
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        k_t = k[t][:, None, :]  # (Hv, 1, Dk)
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.matmul(k_t, S)[:, 0]) * beta[t][:, None]  # (Hv, Dv)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.matmul(q[t][:, None, :], S)[:, 0]
    return mx.array(out[None]), mx.array(S[None])


def gated_norm(y: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`GatedRMSNorm`: rms_norm(y) · weight · silu(z) over the last axis, float32 (the model dtype here)."""
    scale = np.float32(1.0) / np.sqrt(np.add.reduce(y * y, axis=-1, keepdims=True) / np.float32(y.shape[-1])
                                      + np.float32(eps))
    return (y * scale) * weight * (z * sigmoid(z))
