"""Prompt-sized float32 matmuls on the CPU through numpy's BLAS.

MLX's Linux CPU wheels bundle the reference (netlib) BLAS: one core, about 1.3 GMAC/s for any
float32 product, 2-3x slower still with a transposed operand. numpy's wheels bundle OpenBLAS,
which on the same 2-core machine runs a prompt chunk's products 40-80x faster
(docs/benchmarks.md, "CPU prefill through numpy's BLAS"). So the CPU prompt path (rows of at
least `layers.PREFILL_MIN_ROWS`) hands its float32 matmuls to numpy: `np.asarray` of an MLX
array is a view (evaluated first), and only the product is copied back.

Prompt chunks are shared by serial and speculative decoding, so their sums may round differently
from MLX's without touching identity; decode windows (at most 8 rows) never come here. Routed
experts never come here either: OpenBLAS rounds a row differently with the number of rows it
shares a call with, and streamed experts, served in passes of picks, must stay bit-identical to
resident ones. On macOS MLX's CPU matmul is Accelerate's, so `auto` keeps MLX there.

`HostBlas.mode`: "auto" (numpy except on macOS), "numpy", "mlx" (never); the environment
variable STRATA_PROMPT_BLAS sets it for a process (benchmarks compare the two).

OpenBLAS runs on one thread here unless OPENBLAS_NUM_THREADS says otherwise: on a 2-core machine
its second thread makes prefill slower (4.7 s against 3.4 s for 3,000 tokens) and, spinning after
the last product, slows the first decode steps by about 13% (docs/benchmarks.md, "CPU prefill
through numpy's BLAS").
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache

import mlx.core as mx
import numpy as np
from threadpoolctl import threadpool_limits

MODES = ("auto", "numpy", "mlx")


class HostBlas:
    mode = os.environ.get("STRATA_PROMPT_BLAS", "auto")
    # Whether decode windows' float32 linears run here too (`rows_linears`): the same mode
    # decides; benchmarks turn this off to compare with MLX's compiled window.
    windows = os.environ.get("STRATA_WINDOW_BLAS", "numpy") != "mlx"

    @classmethod
    def takes(cls, *arrays: mx.array) -> bool:
        """Whether a CPU prompt matmul over `arrays` (inputs and weights) runs in numpy."""
        return all(cls.takes_dtype(a.dtype) for a in arrays)

    @classmethod
    def takes_dtype(cls, dtype: mx.Dtype) -> bool:
        """Whether a CPU matmul in `dtype` runs in numpy."""
        if cls.mode not in MODES:
            raise ValueError(f"STRATA_PROMPT_BLAS must be one of {', '.join(MODES)}, got {cls.mode!r}")
        if cls.mode == "mlx" or dtype != mx.float32:
            return False
        return cls.mode == "numpy" or sys.platform != "darwin"


@lru_cache(maxsize=1)
def one_thread() -> None:
    """Limit numpy's BLAS to one thread for the process, once, unless the user chose a count."""
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        threadpool_limits(limits=1, user_api="blas")


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (N, K)ᵀ (+ bias) -> (..., N), float32."""
    one_thread()
    K, N = x.shape[-1], weight.shape[0]
    y = np.asarray(x).reshape(-1, K) @ np.asarray(weight).T
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y).reshape(*x.shape[:-1], N)


def causal_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, block: int, *,
                     sinks: mx.array | None = None, window: int | None = None) -> mx.array:
    """`attention.causal_attention_cpu`'s blocked causal attention, in numpy (same contract,
    sinks and sliding window included).

    q (B, Hq, T, D); keys (B, Hkv, L, D), values (B, Hkv, L, Dv), the T query rows at the last T
    cells. The
    query heads of a KV head are stacked as rows, and each block of `block` query rows multiplies
    only the keys it can see; softmax in float32 with the row maximum subtracted.
    """
    one_thread()
    B, Hq, T, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    r, P = Hq // Hkv, L - T
    qs = (np.asarray(q) * np.float32(scale)).reshape(B, Hkv, r, T, D)
    kt, v = np.asarray(keys).swapaxes(-1, -2), np.asarray(values)  # (B, Hkv, D, L), (B, Hkv, L, Dv)
    Dv = v.shape[-1]
    sink = None if sinks is None else np.asarray(sinks.astype(mx.float32)).reshape(1, Hkv, r, 1, 1)
    out = np.empty((B, Hkv, r, T, Dv), dtype=np.float32)
    for s in range(0, T, block):
        e = min(T, s + block)
        n, seen = e - s, P + e  # rows of this block; keys its last row sees
        first = 0 if window is None else max(0, P + s - window + 1)  # the oldest cell its first row sees
        scores = (qs[:, :, :, s:e].reshape(B, Hkv, r * n, D) @ kt[..., first:seen]).reshape(B, Hkv, r, n, -1)
        cells, rows = np.arange(first, seen), (P + s + np.arange(n))[:, None]
        hidden = cells > rows  # row P+s+i sees 0..P+s+i
        if window is not None:
            hidden |= cells <= rows - window
        scores[..., hidden] = -np.inf
        top = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink)
        scores -= top
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        if sink is not None:
            total += np.exp(sink - top)
        scores /= total
        out[:, :, :, s:e] = (scores.reshape(B, Hkv, r * n, seen - first) @ v[:, :, first:seen]).reshape(B, Hkv, r, n, Dv)
    return mx.array(out.reshape(B, Hq, T, Dv))


class HostView:
    """A weight's numpy view (`np.asarray` of the evaluated MLX array: no copy), made once per
    weight array; remade when the module's weight is replaced (loading, `set_dtype`). A plain
    object, so `nn.Module` never takes it for a parameter."""

    __slots__ = ("source", "value")

    def __init__(self):
        self.source = self.value = None

    def of(self, weight: mx.array) -> np.ndarray:
        if self.source is not weight:
            self.source, self.value = weight, np.asarray(weight)
        return self.value


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x: sigmoid -> 0
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) · up, elementwise (exp overflows to inf for very negative gates: silu -> -0)."""
    with np.errstate(over="ignore"):
        return gate / (np.float32(1.0) + np.exp(-gate)) * up


def rms_norm_rows(rows: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm over the last axis times `weight`, float32: each row reduced alone along its
    contiguous axis (the ufunc's reduce: np.mean's sum and division without its Python wrapper)."""
    mean = np.add.reduce(rows * rows, axis=-1, keepdims=True) / np.float32(rows.shape[-1])
    return rows * (np.float32(1.0) / np.sqrt(mean + np.float32(eps))) * weight


def logits(rows: np.ndarray, norm_weight: np.ndarray, eps: float, weight: np.ndarray) -> np.ndarray:
    """A decoder's head on numpy rows (N, H): the final RMS norm, then each row's logits (N, V)."""
    return matvecs(rms_norm_rows(rows, norm_weight, eps), [weight])[0]


def matvecs(rows: np.ndarray, weights: list[np.ndarray]) -> list[np.ndarray]:
    """rows (N, K) @ weight (M, K)ᵀ for each weight, one matrix-vector product a row (see `rows_linears`)."""
    outs = []
    for w in weights:
        y = np.empty((rows.shape[0], w.shape[0]), dtype=np.float32)
        for i, row in enumerate(rows):
            np.dot(w, row, out=y[i])
        outs.append(y)
    return outs


def rows_linears(x: mx.array, weights: list[tuple[np.ndarray | mx.array, mx.array | None]]) -> list[mx.array]:
    """x (..., K) @ weight (N, K)ᵀ (+ bias) for each (weight, bias), each row of x its own
    matrix-vector product: a decode window's linears.

    OpenBLAS's gemv computes a row's outputs the same way whatever other rows there are (and
    wherever the row lies in memory), so a window row gets the bits a one-row serial step gets
    (row invariance, docs/design.md), 5-7x faster than MLX's reference BLAS on these shapes.
    Projections of one input share the one read of x back from MLX.
    """
    one_thread()
    K = x.shape[-1]
    rows = np.asarray(x).reshape(-1, K)
    outs = []
    for (weight, bias), y in zip(weights, matvecs(rows, [np.asarray(weight) for weight, _ in weights])):
        if bias is not None:
            y += np.asarray(bias)
        outs.append(mx.array(y).reshape(*x.shape[:-1], y.shape[-1]))
    return outs
