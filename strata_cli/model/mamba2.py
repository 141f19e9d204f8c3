"""The Mamba-2 mixer of Nemotron-H and Granite-4.0-H, as transformers defines it.

Legend: T = rows, H = heads, P = head dim, G = groups (each B, C row serves H/G consecutive
heads), N = state size, I = H·P, C = conv channels (I + 2·G·N), K = conv kernel, L = chunk rows.

in_proj gives [z (I) | xBC (C) | dt (H)]; a depthwise causal conv with bias and SiLU run over
xBC, which splits into x (H, P), B and C (G, N); dt = clip(softplus(dt + dt_bias), limits); per
head S = S·exp(dt·A) + (dt·x) ⊗ B and y = S·C + D·x, with A = -exp(A_log); then y·silu(z) is
RMS-normed per group of I/G channels and weighted, and out_proj maps it back
(transformers' `NemotronHMamba2Mixer` and `GraniteMoeHybridMambaLayer`, `torch_forward`).

The layer never owns its state: the caller's `SSMState` (the engine's `Mamba2State`) supplies
the conv history and S and decides which rows reach committed state. Decode windows (T <= 8)
run the recurrence one row at a time (`ssd_step_scan`), the scan a commit's fold repeats;
prompt chunks of MIN_CHUNKED_ROWS or more take the chunked SSD form (`ssd_chunked_scan`:
matmuls within chunks of L rows, a step per chunk), within 1e-4 of it.

The math between the projections lives in metal_shaders/mamba2_window.py: its `reference_*` are
the MLX ops this layer runs; on a GPU where they passed their start-up probe, decode windows
(serial steps included) run its row-invariant kernels instead (`mamba2_prepare`, `mamba2_scan`).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import gated_norm, mamba2_window

from .layer_state import SSMRows, SSMState
from .layers import ColumnMap, RowLinear, RowSplit

CHUNK = 64  # rows per chunk of the SSD form
MIN_CHUNKED_ROWS = 16  # shorter windows (every decode window: T <= 8) keep the per-row scan
# Whether decode windows may take the window kernels where they pass their probe: kept on only
# where measured faster than the MLX ops (scripts/bench/kernel_bench.py, docs/families.md).
WINDOW_KERNELS = True
_per_head = mamba2_window.per_head


def ssd_step_scan(rows: SSMRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """The SSD recurrence one row at a time, in float32 (without the D skip):
    metal_shaders/mamba2_window.py's `reference_scan`, whose docstring gives the math.

    Args:
        rows: the window's post-conv rows (model/layer_state.py: SSMRows).
        state: (B, H, P, N) float32.

    Returns:
        outputs (B, T, H, P) float32 and the state after the last row.
    """
    return mamba2_window.reference_scan(rows.x, rows.B, rows.C, rows.dt, rows.g, state)


def kernel_ssd_step_scan(rows: SSMRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`ssd_step_scan` in one GPU kernel call (metal_shaders/mamba2_window.py), for decode windows."""
    return mamba2_window.mamba2_scan(rows.x, rows.B, rows.C, rows.dt, rows.g, state)


def ssd_chunked_scan(rows: SSMRows, state: mx.array, *, chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The SSD recurrence over all rows in chunks; same contract as `ssd_step_scan`.

    Within a chunk that starts from S0, with G_i the cumulative log-decay up to row i:
    y_i = Σ_{j<=i} exp(G_i - G_j)·(C_i·B_j)·dt_j·x_j + exp(G_i)·S0·C_i, and the chunk ends at
    exp(G_L)·S0 + Σ_j exp(G_L - G_j)·(dt_j·x_j) ⊗ B_j. Only the chunk states step in order (the
    form of transformers' `torch_forward` and the Mamba-2 paper's SSD).

    Args:
        rows: post-conv rows; padded rows (x = dt = g = 0, B = C = 0) leave the state unchanged.
        state: (B, H, P, N) float32, the state before the first row.
        chunk: rows per chunk.
    """
    Bsz, T, H, P = rows.x.shape
    L = chunk
    n = -(-T // L)
    pad = n * L - T
    xdt = rows.x * rows.dt[..., None]
    Bh, Ch, g = _per_head(rows.B, H), _per_head(rows.C, H), rows.g
    if pad:
        xdt, Bh, Ch = (mx.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (xdt, Bh, Ch))
        g = mx.pad(g, [(0, 0), (0, pad), (0, 0)])

    def chunks(a: mx.array) -> mx.array:  # (B, n·L, H, ...) -> (B, H, n, L, ...)
        return mx.moveaxis(a.reshape(Bsz, n, L, H, *a.shape[3:]), 3, 1)

    xdt, Bh, Ch, g = chunks(xdt), chunks(Bh), chunks(Ch), chunks(g)
    G = mx.cumsum(g, axis=-1)  # (B, H, n, L)
    causal = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    decay = mx.exp(mx.where(causal, G[..., :, None] - G[..., None, :], -mx.inf))  # zero above the diagonal
    y = ((Ch @ Bh.swapaxes(-1, -2)) * decay) @ xdt  # (B, H, n, L, P)
    local = (xdt * mx.exp(G[..., -1:] - G)[..., None]).swapaxes(-1, -2) @ Bh  # (B, H, n, P, N)
    chunk_decay = mx.exp(G[..., -1])  # (B, H, n)
    starts = []
    S = state
    for i in range(n):  # only the chunk states step in order
        starts.append(S)
        S = chunk_decay[:, :, i, None, None] * S + local[:, :, i]
    S0 = mx.stack(starts, axis=2)  # (B, H, n, P, N)
    y = y + mx.exp(G)[..., None] * (Ch @ S0.swapaxes(-1, -2))
    y = mx.moveaxis(y, 1, 3).reshape(Bsz, n * L, H, P)
    return y[:, :T], S


@lru_cache
def in_proj_parts(intermediate: int, conv_dim: int, heads: int) -> ColumnMap:
    """in_proj's columns as they are, in three parts: [z | xBC | dt] (`RowLinear.mapped`)."""
    return ColumnMap(mx.arange(intermediate + conv_dim + heads), (intermediate, intermediate + conv_dim))


class Mamba2Conv(nn.Module):
    """The depthwise causal conv's parameters: `weight` (C, K) and an optional bias (C,). The
    conv itself runs in metal_shaders/mamba2_window.py (`reference_prepare` or the kernel)."""

    def __init__(self, channels: int, kernel: int, *, bias: bool):
        super().__init__()
        self.weight = mx.zeros((channels, kernel))
        if bias:
            self.bias = mx.zeros((channels,))


class GroupedGatedRMSNorm(nn.Module):
    """weight · rms_norm(y · silu(z)) over each group of `dims / groups` channels, in float32
    (the gate applied before the norm: transformers' `RMSNormGated` with `group_size`). A window
    on a GPU (serial steps too) runs it in one kernel (metal_shaders/gated_norm.py, its
    `gate_first` form) where its probe passed; elsewhere MLX's ops."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size = dims // groups
        self.eps = eps

    @property
    def groups(self) -> int:
        return self.weight.shape[0] // self.group_size

    def takes_kernel(self, y: mx.array, gate: mx.array) -> bool:
        """Whether the gated-norm kernel runs this call: 1..8 rows, y float32 and the gate and
        weight in one dtype the probe passed."""
        rows = gate.size // gate.shape[-1] if gate.ndim else 0
        return (type(self) is GroupedGatedRMSNorm and RowSplit.kernel_may_take(rows)
                and gated_norm.takes(y, gate, self.weight, groups=self.groups, group_size=self.group_size)
                and gated_norm.usable(gate.dtype))

    def __call__(self, y: mx.array, gate: mx.array) -> mx.array:
        """y (..., I) float32, gate (..., I) in the model dtype -> (..., I) in the model dtype."""
        if self.takes_kernel(y, gate):
            return gated_norm.gated_norm(y, gate, self.weight, self.eps, groups=self.groups, group_size=self.group_size,
                                         gate_first=True)
        h = y.astype(mx.float32) * nn.silu(gate.astype(mx.float32))
        h = mx.fast.rms_norm(h.reshape(*h.shape[:-1], -1, self.group_size), None, self.eps).reshape(h.shape)
        return (self.weight.astype(mx.float32) * h).astype(gate.dtype)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer between its residual adds; see the module docstring for the math.

    Args:
        time_step_limit: (min, max) of dt after the softplus.
        use_bias: a bias on in_proj and out_proj; use_conv_bias: on the conv.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        eps: float,
        time_step_limit: tuple[float, float],
        use_bias: bool = False,
        use_conv_bias: bool = True,
    ):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"the Mamba heads ({num_heads}) must be divisible by n_groups ({n_groups})")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.dt_min, self.dt_max = (float(v) for v in time_step_limit)
        self.in_proj = RowLinear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = Mamba2Conv(self.conv_dim, conv_kernel, bias=use_conv_bias)
        self.dt_bias = mx.ones((num_heads,))
        self.A_log = mx.zeros((num_heads,))
        self.D = mx.ones((num_heads,))
        self.norm = GroupedGatedRMSNorm(self.intermediate_size, n_groups, eps)
        self.out_proj = RowLinear(self.intermediate_size, hidden_size, bias=use_bias)

    def takes_kernels(self, rows: int, dtype=None) -> bool:
        """Whether a window of `rows` rows runs the Mamba-2 window kernels (a GPU where they passed
        their probe; RowSplit "never" keeps every window on MLX ops, as for the matmuls)."""
        return (WINDOW_KERNELS and RowSplit.kernel_may_take(rows) and mamba2_window.supports(self.state_size)
                and mamba2_window.usable(dtype))

    # A layer call is head (pure), core (the state's part), tail (pure): the decoder layers
    # compile head and tail for decode windows.
    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        """x (B, T, hidden) -> the core's inputs (xBC, dt) and the tail's (z). Where the
        column-mapped kernel takes the window, in_proj writes the three parts contiguous (the
        plain kernel's bits): at T > 1 column slices of one output would each cost the kernels
        that read them an MLX copy. Elsewhere in_proj's output is split (an identity map
        gathers nothing)."""
        z, xBC, dt = self.in_proj.mapped(x, in_proj_parts(self.intermediate_size, self.conv_dim, self.num_heads))
        return (xBC, dt), (z,)

    def core(self, xBC: mx.array, dt: mx.array, state: SSMState) -> mx.array:
        """The causal conv over the state's history and the SSD recurrence from its state ->
        y (B, T, I) float32, the D skip included."""
        B, T, _ = xBC.shape
        is_kernel = self.takes_kernels(T, xBC.dtype)
        shapes = {"num_heads": self.num_heads, "head_dim": self.head_dim, "n_groups": self.n_groups,
                  "state_size": self.state_size, "dt_limits": (self.dt_min, self.dt_max)}
        conv = (self.conv1d.weight, self.conv1d.get("bias"), dt, self.dt_bias, self.A_log)
        if is_kernel:  # the kernel joins history and rows itself (no concatenate's two copies)
            x, b, c, dt, g, window = mamba2_window.mamba2_prepare(state.conv_history(xBC), xBC, *conv, **shapes)
            state.take_window(window)
        else:
            x, b, c, dt, g = mamba2_window.reference_prepare(state.conv_window(xBC), *conv, **shapes)
        # Prompt chunks take the chunked form; decode windows keep the exact per-row scan (the
        # state's commit folds reuse the same `scan`, so they repeat the window's arithmetic).
        if is_kernel:
            scan = kernel_ssd_step_scan
        else:
            scan = ssd_chunked_scan if T >= MIN_CHUNKED_ROWS else ssd_step_scan
        y = state.recur(SSMRows(x, b, c, dt, g), scan) + x * self.D.astype(mx.float32)[:, None]
        return y.reshape(B, T, self.num_heads * self.head_dim)

    def tail(self, y: mx.array, z: mx.array) -> mx.array:
        """y (B, T, I) float32 -> (B, T, hidden)."""
        return self.out_proj(self.norm(y, z))

    def __call__(self, x: mx.array, state: SSMState) -> mx.array:
        core_in, tail_in = self.head(x)
        return self.tail(self.core(*core_in, state), *tail_in)
