"""Gated-delta-rule linear attention (the GDN layers of Qwen3-Next).

Legend: T = rows, Hk/Hv = key/value heads, Dk/Dv = head dims, C = conv channels (2·Hk·Dk + Hv·Dv),
K = conv kernel. The layer never owns its state: the caller's `RecurrentState` (the engine's
`GDNState`) supplies the conv history and the recurrent state, and decides which rows reach
committed state.

The math between the projections lives in metal_shaders/gdn_window.py: its `reference_*` are
this layer's MLX ops, and on CUDA a decode window (T <= WINDOW_ROWS) takes its two
row-invariant kernels instead (`gdn_prepare`, `gdn_scan`): ~37 tiny ops become two calls.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import gdn_window

from .gdn_chunked import MIN_CHUNKED_ROWS, chunked_gated_delta_scan
from .layer_state import GDNRows, RecurrentState
from .layers import WINDOW_ROWS, GatedRMSNorm, RowLinear, RowSplit

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


def kernel_gated_delta_scan(rows: GDNRows, state: mx.array) -> tuple[mx.array, mx.array]:
    """`gated_delta_scan` in one CUDA kernel call (metal_shaders/gdn_window.py), for decode windows."""
    return gdn_window.gdn_scan(rows.q, rows.k, rows.v, rows.g, rows.beta, state)


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

    def project(self, x: mx.array):
        """Split the fused projections; the checkpoint groups them per key head."""
        B, T, _ = x.shape
        nk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        per_head_v = self.num_v_heads // nk * dv
        qkvz = self.in_proj_qkvz(x).reshape(B, T, nk, -1)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per_head_v], axis=-1)
        ba = self.in_proj_ba(x).reshape(B, T, nk, -1)
        b, a = mx.split(ba, 2, axis=-1)
        raw = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        return (
            raw,
            z.reshape(B, T, self.num_v_heads, dv),
            b.reshape(B, T, self.num_v_heads),
            a.reshape(B, T, self.num_v_heads),
        )

    def takes_kernels(self, rows: int) -> bool:
        """Whether a window of `rows` rows runs the GDN window kernels (CUDA, where they passed
        their probe; RowSplit "never" keeps every window on MLX ops, as for the matmuls)."""
        return (0 < rows <= WINDOW_ROWS and RowSplit.mode != "never"
                and gdn_window.supports(self.head_k_dim, self.head_v_dim) and gdn_window.usable())

    def __call__(self, x: mx.array, state: RecurrentState) -> mx.array:
        B, T, _ = x.shape
        raw, z, b, a = self.project(x)
        window = state.conv_window(raw)
        is_kernel = self.takes_kernels(T)
        prepare = gdn_window.gdn_prepare if is_kernel else gdn_window.reference_prepare
        q, k, v, g, beta = prepare(window, self.conv1d.weight, a, b, self.A_log, self.dt_bias,
                                   num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim)
        # Prompt chunks take the chunked form; decode windows keep the exact per-row scan (the
        # state's commit folds reuse the same `scan`, so they repeat the window's arithmetic).
        if is_kernel:
            scan = kernel_gated_delta_scan
        else:
            scan = chunked_gated_delta_scan if T >= MIN_CHUNKED_ROWS else gated_delta_scan
        y = state.recur(GDNRows(q, k, v, g, beta), scan)
        y = self.norm(y.astype(x.dtype), z)
        return self.out_proj(y.reshape(B, T, -1))
