"""Gated-delta-rule linear attention (the GDN layers of Qwen3-Next).

Legend: T = rows, Hk/Hv = key/value heads, Dk/Dv = head dims, C = conv channels (2·Hk·Dk + Hv·Dv),
K = conv kernel. The layer never owns its state: the caller's `RecurrentState` (the engine's
`GDNState`) supplies the conv history and the recurrent state, and decides which rows reach
committed state.

The math between the projections lives in metal_shaders/gdn_window.py: its `reference_*` are
this layer's MLX ops, and on CUDA a decode window (T <= WINDOW_ROWS) takes its two
row-invariant kernels instead (`gdn_prepare`, `gdn_scan`): ~37 tiny ops become two calls; its
gated norm takes metal_shaders/gated_norm.py's kernel there (`GatedRMSNorm`).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import gdn_window

from .gdn_chunked import MIN_CHUNKED_ROWS, chunked_scan_over_streams
from .layer_state import GDNRows, RecurrentState
from .compiled import LayerCompile, traced_on_host
from .layers import WINDOW_ROWS, ColumnMap, GatedRMSNorm, RowLinear, RowSplit, host_window, project, stack, stacked

l2_normalize = gdn_window.reference_l2_normalize


def gated_delta_scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule, one row at a time, in float32.

    Per row: S = S·exp(g); S += k ⊗ (v - Sᵀk)·β; y = Sᵀq. Folding kept rows repeats exactly these
    operations, which is why a fold reproduces serial decoding.

    Args:
        rows: post-conv inputs; q, k are already l2-normalised and q scaled by Dk^-0.5.
        state: (B, Hv, Dk, Dv) float32.

    Returns:
        outputs (B, T, Hv, Dv) float32 and the state after the last row.
    """
    return gdn_window.reference_scan(rows.q, rows.k, rows.v, rows.g, rows.beta, state)


@lru_cache
def scan_row(t: int) -> Callable:
    """Row t of the gated delta rule (`gdn_window.reference_scan`'s loop body), compiled:
    (q, k (B, T, Hv, Dk), v (B, T, Hv, Dv), decay, beta (B, T, Hv), S (B, Hv, Dk, Dv)) -> row t's
    y (B, Hv, Dv) and the new S. The row is taken inside the trace (no view ops outside it)."""
    def step(q, k, v, decay, beta, S):
        k_t = k[:, t, :, :, None]
        S = S * decay[:, t, :, None, None]
        delta = (v[:, t] - (S * k_t).sum(axis=-2)) * beta[:, t, :, None]
        S = S + k_t * delta[:, :, None, :]
        return (S * q[:, t, :, :, None]).sum(axis=-2), S
    return mx.compile(step)


def compiled_gated_delta_scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`gated_delta_scan` with each row one call of a compiled `scan_row`: a CPU decode window's
    scan (and its commit folds) as a few fused kernels a row instead of ~25 ops. Each call
    computes one row with the arithmetic of serial decoding's one-row call, so a window's rows
    and final state are the serial ones bit for bit (one trace over several rows would fuse a
    row's update into the next row's arithmetic)."""
    q, k = rows.q, rows.k
    Hk, Hv = k.shape[2], rows.v.shape[2]
    if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    decay = mx.exp(rows.g)
    outputs, S = [], state
    for t in range(q.shape[1]):
        y, S = scan_row(t)(q, k, rows.v, decay, rows.beta, S)
        outputs.append(y)
    return mx.stack(outputs, axis=1), S


@lru_cache
def compiled_prepare(num_k_heads: int, head_k_dim: int):
    """`gdn_window.reference_prepare` for these heads, compiled (traced per window size)."""
    return mx.compile(partial(gdn_window.reference_prepare, num_k_heads=num_k_heads, head_k_dim=head_k_dim))


def kernel_gated_delta_scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`gated_delta_scan` in one CUDA kernel call (metal_shaders/gdn_window.py), for decode windows."""
    return gdn_window.gdn_scan(rows.q, rows.k, rows.v, rows.g, rows.beta, state)


@lru_cache
def projection_columns(nk: int, nv: int, dk: int, dv: int) -> tuple[mx.array, ...]:
    """Column indices that take, from the fused projections, the conv inputs [q | k | v] (C),
    z (Hv·Dv), b (Hv) and a (Hv), each shaped (1, 1, n). Per key head the checkpoint stores [q dk | k dk | v | z]
    (v, z: nv/nk value heads each) in `in_proj_qkvz` and [b | a] (nv/nk each) in `in_proj_ba`."""
    pv = nv // nk * dv  # value channels per key head
    width = 2 * dk + 2 * pv
    head = mx.arange(nk)[:, None] * width
    q, k = head + mx.arange(dk), head + dk + mx.arange(dk)
    v, z = head + 2 * dk + mx.arange(pv), head + 2 * dk + pv + mx.arange(pv)
    raw = mx.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    per = nv // nk
    ba_head = mx.arange(nk)[:, None] * 2 * per
    b, a = (ba_head + mx.arange(per)).reshape(-1), (ba_head + per + mx.arange(per)).reshape(-1)
    columns = tuple(c.reshape(1, 1, -1).astype(mx.uint32) for c in (raw, z, b, a))  # (1, 1, n): any B, T
    mx.eval(columns)
    return columns


@lru_cache
def stacked_columns(nk: int, nv: int, dk: int, dv: int) -> ColumnMap:
    """The columns of the stacked projection [qkvz | ba] (`layers.StackedRows`) that make
    [conv inputs | z | b | a], in that order and split into the four (`RowLinear.mapped`: one
    launch on a GPU window, each part contiguous; else one gather)."""
    raw, z, b, a = (c.reshape(-1) for c in projection_columns(nk, nv, dk, dv))
    width = 2 * nk * dk + 2 * nv * dv  # in_proj_qkvz's columns; in_proj_ba's follow them
    bounds = (raw.size, raw.size + z.size, raw.size + z.size + b.size)
    return ColumnMap(mx.concatenate([raw, z, b + width, a + width]), bounds)


class CausalConv1d(nn.Module):
    """Depthwise causal conv without bias; `weight` is (C, K)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel))

    def __call__(self, window: mx.array) -> mx.array:
        """(B, K-1+T, C) history-prefixed inputs -> (B, T, C). Elementwise, so exact for any T."""
        return gdn_window.reference_causal_conv(window, self.weight)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be divisible by "
                f"linear_num_key_heads ({num_k_heads})"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_kernel = conv_kernel
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = RowLinear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = RowLinear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = CausalConv1d(conv_dim, conv_kernel)
        self.dt_bias = mx.ones((num_v_heads,))
        self.A_log = mx.zeros((num_v_heads,))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowLinear(self.value_dim, hidden_size, bias=False)

    def stack_linears(self) -> None:
        """Stack the two input projections where their forms allow (`layers.stack_rows`, at load)."""
        stack(self, "_input_rows", "in_proj_qkvz", "in_proj_ba")
        self.tile_norm_weight()

    def tile_norm_weight(self) -> None:
        """Keep the gated norm's weight tiled over the value heads (made at load, never inside a
        trace): a decode window's z then stays as its projection gives it (`gated_norm`)."""
        tiled = mx.tile(self.norm.weight, self.num_v_heads)
        mx.eval(tiled)
        self.__dict__["_norm_by_channel"] = (self.norm.weight, tiled)

    def norm_by_channel(self) -> mx.array | None:
        """The tiled norm weight of `tile_norm_weight`, while the norm still holds the weight it
        was made from; else None (z is then reshaped to heads, as before)."""
        held = self.__dict__.get("_norm_by_channel")
        return held[1] if held is not None and held[0] is self.norm.weight else None

    def project(self, x: mx.array):
        """Split the fused projections; the checkpoint groups them per key head.

        Each output is one gather of columns (`projection_columns`): the same values as
        splitting per head and concatenating, in 5-9 ops instead of 13 (on the H200 each op costs
        ~10 µs of host dispatch, docs/benchmarks.md, "Ops per decode step"). A decode window
        (T <= WINDOW_ROWS) whose two projections stack (`layers.StackedRows`) takes one matmul
        that writes all four outputs in order (`RowLinear.mapped`: on a GPU the column-mapped
        kernel, elsewhere a matmul and one gather), then a split: the same values. Not on the
        CPU's host path (numpy reads x once for both anyway), nor for prompt chunks, whose
        matmuls are not launch-bound (and a wider BLAS call may block its sums otherwise).
        """
        B, T, _ = x.shape
        rows = None if host_window(x) or B * T > WINDOW_ROWS else stacked(self, "_input_rows")
        if rows is None:
            qkvz, ba = project(x, self.in_proj_qkvz, self.in_proj_ba)
            return traced_on_host(self, "_split", self.split, x.size // x.shape[-1], x.dtype)(qkvz, ba)
        columns = stacked_columns(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        raw, z, b, a = rows.fused.mapped(x, columns)
        return raw, self.gate_by_heads(z), b, a

    def gate_by_heads(self, z: mx.array) -> mx.array:
        """z (B, T, Hv·Dv) from stacked projections: as it is where the norm's tiled weight is
        kept (`gated_norm` takes it so), else reshaped to (B, T, Hv, Dv)."""
        if self.norm_by_channel() is not None:
            return z
        return z.reshape(*z.shape[:2], self.num_v_heads, self.head_v_dim)

    def split(self, qkvz: mx.array, ba: mx.array) -> tuple[mx.array, ...]:
        """The fused projections' outputs -> conv inputs, z, b, a (see `project`)."""
        raw_cols, z_cols, b_cols, a_cols = projection_columns(self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                                              self.head_v_dim)
        B, T, _ = qkvz.shape
        take = partial(mx.take_along_axis, axis=-1)  # one GatherAxis each (mx.take adds a transpose, a squeeze)
        z = take(qkvz, z_cols).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return take(qkvz, raw_cols), z, take(ba, b_cols), take(ba, a_cols)

    def takes_kernels(self, rows: int, dtype=None) -> bool:
        """Whether a window of `rows` rows runs the GDN window kernels (CUDA, where they passed
        their probe; RowSplit "never" keeps every window on MLX ops, as for the matmuls)."""
        return (RowSplit.kernel_may_take(rows) and gdn_window.supports(self.head_k_dim, self.head_v_dim)
                and gdn_window.usable(dtype))

    # A layer call is head (pure), core (the state's part), tail (pure): decoder_layer.py
    # compiles head and tail for decode windows.
    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        """x (B, T, H) -> the core's inputs (conv inputs, b, a) and the tail's (z: (B, T, Hv, Dv),
        or (B, T, Hv·Dv) from stacked projections, `gate_by_heads`)."""
        raw, z, b, a = self.project(x)
        return (raw, b, a), (z,)

    def core(self, raw: mx.array, b: mx.array, a: mx.array, state: RecurrentState) -> mx.array:
        """Causal conv over the state's history and the gated-delta recurrence from its state."""
        T = raw.shape[1]
        is_kernel = self.takes_kernels(T, raw.dtype)
        heads = {"num_k_heads": self.num_k_heads, "head_k_dim": self.head_k_dim}
        if is_kernel:  # the kernel joins history and rows itself (no concatenate's two copies)
            q, k, v, g, beta, window = gdn_window.gdn_prepare(state.conv_history(raw), raw, self.conv1d.weight, a, b,
                                                              self.A_log, self.dt_bias, **heads)
            state.take_window(window)
        else:
            prepare = (compiled_prepare(self.num_k_heads, self.head_k_dim) if LayerCompile.applies_to_state(T)
                       else partial(gdn_window.reference_prepare, **heads))
            q, k, v, g, beta = prepare(state.conv_window(raw), self.conv1d.weight, a, b, self.A_log, self.dt_bias)
        # Prompt chunks take the chunked form; decode windows keep the exact per-row scan (the
        # state's commit folds reuse the same `scan`, so they repeat the window's arithmetic).
        if is_kernel:
            scan = kernel_gated_delta_scan
        elif LayerCompile.applies_to_state(T):
            scan = compiled_gated_delta_scan
        else:
            scan = chunked_scan_over_streams if T >= MIN_CHUNKED_ROWS else gated_delta_scan
        return state.recur(GDNRows(q, k, v, g, beta), scan)

    def tail(self, y: mx.array, z: mx.array) -> mx.array:
        """Recurrence outputs (B, T, Hv, Dv) float32 -> (B, T, H)."""
        return self.out_proj(self.tail_input(y, z))

    def tail_input(self, y: mx.array, z: mx.array) -> mx.array:
        """The tail less its output projection (`out_projection`): the gated norm, (B, T, Hv·Dv)."""
        return traced_on_host(self, "_gated_norm", self.gated_norm, y.shape[0] * y.shape[1], z.dtype)(y, z)

    def gated_norm(self, y: mx.array, z: mx.array) -> mx.array:
        """rms_norm(y) · weight · silu(z) over each value head -> (B, T, Hv·Dv) in z's dtype. On a
        GPU a decode window (serial steps too) takes one kernel (`GatedRMSNorm.takes_kernel`) for
        the cast, norm, reshape and gate product of MLX's ops."""
        B, T = y.shape[:2]
        if z.ndim == 3:  # a decode window's z as its projection gave it (`gate_by_heads`)
            tiled = self.norm_by_channel()
            if tiled is not None:
                return self.norm.over_heads(y, z, tiled)
            z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.norm(y, z).reshape(B, T, -1)  # float32 rows, rounded to the model dtype inside (z's)

    @property
    def out_projection(self) -> nn.Module:
        return self.out_proj

    def __call__(self, x: mx.array, state: RecurrentState) -> mx.array:
        core_in, tail_in = self.head(x)
        return self.tail(self.core(*core_in, state), *tail_in)
