"""Full attention with a gated output, q/k RMSNorm and partial rotary embedding (Qwen3-Next)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .layer_state import AttentionState
from .layers import Linear, RMSNorm


class GatedAttention(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        rope_theta: float,
        eps: float,
        bias: bool = False,
        output_gate: bool = True,
        qk_norm: bool = True,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.scale = head_dim**-0.5
        self.output_gate = output_gate
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = Linear(hidden_size, q_width, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)

    def __call__(self, x: mx.array, state: AttentionState) -> mx.array:
        B, T, _ = x.shape
        q = self.q_proj(x)
        if self.output_gate:  # per head: [query | gate]
            q, gate = mx.split(q.reshape(B, T, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            gate = gate.reshape(B, T, -1)
        else:
            q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, heads, T, D)

        offset = state.offset
        q = mx.fast.rope(q, self.rotary_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.rotary_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        keys, values = state.update_and_fetch(k, v)
        # Row i sees cells 0..offset+i: a causal mask aligned to the last key.
        mask = "causal" if T > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
        if self.output_gate:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)
