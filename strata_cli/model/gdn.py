"""Gated-delta-rule linear attention (the GDN layers of Qwen3-Next).

Legend: T = rows, Hk/Hv = key/value heads, Dk/Dv = head dims, C = conv channels (2·Hk·Dk + Hv·Dv),
K = conv kernel. The layer never owns its state: the caller's `RecurrentState` (the engine's
`GDNState`) supplies the conv history and the recurrent state, and decides which rows reach
committed state.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .gdn_chunked import MIN_CHUNKED_ROWS, chunked_gated_delta_scan
from .layer_state import GDNRows, RecurrentState
from .layers import GatedRMSNorm, RowLinear

L2_EPS = 1e-6  # the reference's l2norm epsilon, added to sum(x^2)


def l2_normalize(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    return x32 * mx.rsqrt((x32 * x32).sum(axis=-1, keepdims=True) + L2_EPS)


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
    Hk, Hv = rows.k.shape[2], rows.v.shape[2]
    q, k = rows.q, rows.k
    if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    decay = mx.exp(rows.g)
    outputs = []
    for t in range(len(rows)):
        k_t = k[:, t, :, :, None]  # (B, Hv, Dk, 1)
        state = state * decay[:, t, :, None, None]
        memory = (state * k_t).sum(axis=-2)  # (B, Hv, Dv)
        delta = (rows.v[:, t] - memory) * rows.beta[:, t, :, None]
        state = state + k_t * delta[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(axis=-2))
    return mx.stack(outputs, axis=1), state


class CausalConv1d(nn.Module):
    """Depthwise causal conv without bias; `weight` is (C, K)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel))

    def __call__(self, window: mx.array) -> mx.array:
        """(B, K-1+T, C) history-prefixed inputs -> (B, T, C). Elementwise, so exact for any T."""
        K = self.weight.shape[1]
        T = window.shape[1] - (K - 1)
        out = window[:, 0:T] * self.weight[:, 0]
        for j in range(1, K):
            out = out + window[:, j : j + T] * self.weight[:, j]
        return out


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

    def __call__(self, x: mx.array, state: RecurrentState) -> mx.array:
        B, T, _ = x.shape
        raw, z, b, a = self.project(x)
        mixed = nn.silu(self.conv1d(state.conv_window(raw)))
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(B, T, self.num_k_heads, self.head_k_dim)) * self.head_k_dim**-0.5
        k = l2_normalize(k.reshape(B, T, self.num_k_heads, self.head_k_dim))
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim).astype(mx.float32)
        beta = mx.sigmoid(b.astype(mx.float32))
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            a.astype(mx.float32) + self.dt_bias.astype(mx.float32)
        )
        # Prompt chunks take the chunked form; decode windows keep the exact per-row scan.
        scan = chunked_gated_delta_scan if T >= MIN_CHUNKED_ROWS else gated_delta_scan
        y = state.recur(GDNRows(q, k, v, g, beta), scan)
        y = self.norm(y.astype(x.dtype), z)
        return self.out_proj(y.reshape(B, T, -1))
