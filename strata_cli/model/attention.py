"""Full attention with a gated output, q/k RMSNorm and partial rotary embedding (Qwen3-Next).

Decode windows (1..8 rows) attend through metal_shaders/attention_window.py: its kernel on CUDA
(one call, row-invariant by construction), else its reference (one sdpa call per row) where
RowSplit applies; prompt chunks and the CPU's 1-row steps take MLX's sdpa (or the CPU's blocked
matmuls) whole. On a GPU a decode window's head after its stacked projection (the gate taken from
q, q/k norms, the transposes, the rotary) is one kernel too, metal_shaders/attention_prep.py, run
at the start of `core`, which holds the state's offset.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from metal_shaders import attention_prep, attention_window

from . import host_blas
from .compiled import traced_on_host
from .layer_state import AttentionState
from .layers import (
    PREFILL_MIN_ROWS,
    WINDOW_ROWS,
    CpuShortCalls,
    RMSNorm,
    RowLinear,
    RowSplit,
    host_window,
    project,
    prompt_streams,
    sigmoid_gate,
    stack,
    stacked,
)

# x · sigmoid(gate) in one launch where `core` gates eagerly (the tail's trace fuses its own)
gated_output = mx.compile(sigmoid_gate, shapeless=True)

QUERY_BLOCK = 128  # prompt rows per attention block on the CPU (64 ties it, 512 unblocked is 1.2-2x slower)


def causal_attention_cpu(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                         block: int = QUERY_BLOCK, *, sinks: mx.array | None = None,
                         window: int | None = None) -> mx.array:
    """Causal attention of a prompt chunk as plain matmuls, for MLX's CPU backend.

    q (B, Hq, T, D); keys (B, Hkv, L, D), values (B, Hkv, L, Dv), the T query rows at the last T
    cells. The same
    sums as `mx.fast.scaled_dot_product_attention` (bit-identical in float32 on the CPU), faster
    there for two reasons (docs/benchmarks.md, "CPU prefill pieces"): MLX's CPU matmul runs 2-3x
    slower with a transposed right operand, so scores use a contiguous Kᵀ with the query heads of
    a KV head stacked as rows; and each block of `block` query rows multiplies only the keys it
    can see, so the chunk's masked upper triangle is mostly never computed (nor exponentiated).
    The blocks take turns on the CPU prompt streams (`layers.prompt_streams`: a core each), or
    the whole runs in numpy where its BLAS takes float32 prompts (`host_blas`).

    `sinks` (Hq,): one more logit per query head in every row's softmax, its weight dropped
    (GPT-OSS). `window`: row i sees only the last `window` cells up to its own (a sliding
    window), and a block multiplies only the cells its rows can see.
    """
    if host_blas.HostBlas.takes(q, keys, values):
        return host_blas.causal_attention(q, keys, values, scale, block, sinks=sinks, window=window)
    B, Hq, T, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    r, P = Hq // Hkv, L - T
    Dv = values.shape[-1]
    kt = mx.contiguous(keys.swapaxes(-1, -2))  # (B, Hkv, D, L)
    q = (q * scale).reshape(B, Hkv, r, T, D)
    outs, streams = [], prompt_streams()
    sink_logits = None if sinks is None else sinks.astype(mx.float32).reshape(1, Hkv, r, 1, 1)
    for i, s in enumerate(range(0, T, block)):
        e = min(T, s + block)
        n, seen = e - s, P + e  # rows of this block; keys the block's last row sees
        first = 0 if window is None else max(0, P + s - window + 1)  # the oldest cell its first row sees
        with mx.stream(streams[i % len(streams)]):
            scores = (q[:, :, :, s:e].reshape(B, Hkv, r * n, D) @ kt[..., first:seen]).reshape(B, Hkv, r, n, -1)
            cells, rows = mx.arange(first, seen), (P + s + mx.arange(n))[:, None]
            visible = cells <= rows  # row P+s+i sees cells 0..P+s+i
            if window is not None:
                visible = visible & (cells > rows - window)
            scores = mx.where(visible, scores, -mx.inf)
            if sink_logits is not None:
                sink = mx.broadcast_to(sink_logits, (*scores.shape[:-1], 1)).astype(scores.dtype)
                scores = mx.concatenate([scores, sink], axis=-1)
            weights = mx.softmax(scores, axis=-1, precise=True)
            if sink_logits is not None:
                weights = weights[..., :-1]
            weights = weights.reshape(B, Hkv, r * n, seen - first)
            outs.append((weights @ values[:, :, first:seen]).reshape(B, Hkv, r, n, Dv))
    return mx.concatenate(outs, axis=3).reshape(B, Hq, T, Dv)


@lru_cache
def cpu_rope(dims: int, base: float) -> Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]:
    """Rotary embedding (not traditional, scale 1) of q and k at positions offset.., compiled:
    for the CPU's short calls (decode windows and short prompt chunks), where MLX runs
    `mx.fast.rope` as a ~30-op decomposition per call. A row's angles are (offset + i)·freq
    whatever T is, and each element's arithmetic is the same in every trace, so rows stay
    row-invariant."""
    half = dims // 2
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))  # transformers' form
    mx.eval(inv_freq)

    def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x1, x2 = x[..., :half], x[..., half:dims]
        rotated = [(x1 * cos - x2 * sin).astype(x.dtype), (x1 * sin + x2 * cos).astype(x.dtype)]
        return mx.concatenate(rotated + ([x[..., dims:]] if x.shape[-1] > dims else []), axis=-1)

    def rope(q: mx.array, k: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        positions = (offset + mx.arange(q.shape[-2], dtype=mx.int32)).astype(mx.float32)
        theta = positions[:, None] * inv_freq  # (T, dims/2)
        cos, sin = mx.cos(theta), mx.sin(theta)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    return mx.compile(rope)


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
        output_bias: bool | None = None,
        output_gate: bool = True,
        qk_norm: bool = True,
    ):
        """`bias`: on the q, k, v projections, and on o_proj unless `output_bias` says otherwise
        (GLM-4.x biases q, k and v only)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.scale = head_dim**-0.5
        self.output_gate = output_gate
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = RowLinear(hidden_size, q_width, bias=bias)
        self.k_proj = RowLinear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = RowLinear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, bias=bias if output_bias is None else output_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)

    def takes_prep(self, rows: int, dtype=None) -> bool:
        """Whether a window of `rows` rows (serial 1-row steps too) runs its head after the stacked
        projection in one kernel (metal_shaders/attention_prep.py): where it attends through the
        window kernel, its q/k/v stack, its layout is one the kernel takes and its probe passed.
        A subclass with its own core keeps MLX's ops (its core takes q, k and v)."""
        return (type(self).core is GatedAttention.core and self.takes_kernel(rows, dtype)
                and stacked(self, "_qkv_rows") is not None
                and attention_prep.supports(self.head_dim, self.rotary_dim) and attention_prep.usable(dtype))

    def takes_kernel(self, rows: int, dtype=None) -> bool:
        """Whether a window of `rows` rows attends through the row-invariant kernel (CUDA, where it
        passed its probe; serial decoding's 1-row steps too, so they share its arithmetic).
        RowSplit "never" keeps every window on MLX ops, as for the matmuls."""
        return (RowSplit.kernel_may_take(rows) and attention_window.supports(self.head_dim)
                and attention_window.usable(dtype))

    # A layer call is head (pure), core (the state's part), tail (pure): decoder_layer.py
    # compiles head and tail for decode windows.
    def stack_linears(self) -> None:
        """Stack q, k and v where their forms allow (`layers.stack_rows`, at load)."""
        stack(self, "_qkv_rows", "q_proj", "k_proj", "v_proj")

    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        """x (B, T, H) -> the core's inputs (q, k, v (B, heads, T, D)) and the tail's (the gate).

        A decode window's q, k and v (at most WINDOW_ROWS rows) come from one stacked projection
        where they stack (`layers.StackedRows`): one matmul (and one bias add) instead of three,
        every column the same sum as its own projection's. Not on the CPU's host path, where numpy
        reads x once for the three anyway, nor for prompt chunks, whose matmuls are not
        launch-bound (and a wider BLAS call may block its sums otherwise).
        """
        rows = None if host_window(x) or x.size // x.shape[-1] > WINDOW_ROWS else stacked(self, "_qkv_rows")
        if rows is not None and x.ndim == 3 and self.takes_prep(x.size // x.shape[-1], x.dtype):
            return (rows.outputs(x)[0],), ()  # the core's kernel takes the stacked rows as they are
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj) if rows is None else rows(x)
        return traced_on_host(self, "_head_rest", self.head_rest, x.size // x.shape[-1], x.dtype)(q, k, v)

    def head_rest(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[tuple, tuple]:
        """The head after its projections: heads split, gate taken, q/k normed, heads first."""
        B, T, _ = q.shape
        gate = ()
        if self.output_gate:  # per head: [query | gate]
            q, g = mx.split(q.reshape(B, T, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            gate = (g.reshape(B, T, -1),)
        else:
            q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return tuple(a.transpose(0, 2, 1, 3) for a in (q, k, v)), gate  # (B, heads, T, D)

    def core(self, *inputs) -> mx.array:
        """(q, k, v, state) from `head_rest`, or (qkv, state): a GPU decode window's stacked
        projection (B, T, W), which `prepared` turns into the same q, k, v and gate in one kernel.
        Rotary at the state's offset, the window's KV written, attention -> (B, T, heads·D),
        gated here where the kernel gave the gate (the tail then gets none)."""
        *arrays, state = inputs
        if len(arrays) == 1:
            q, k, v, *gate = self.prepared(arrays[0], state.offset)
            out = self.attend(q, k, v, state)
            return gated_output(out, *gate) if gate else out
        q, k, v = arrays
        q, k = self.rotary_qk(q, k, state.offset)
        return self.attend(q, k, v, state)

    def prepared(self, qkv: mx.array, offset: int) -> tuple[mx.array, ...]:
        """The stacked projection (B, T, W) -> q, k (normed, at the rotary of positions offset..),
        v (B, heads, T, D), and the gate (B, T, heads·D) where the model gates: one kernel."""
        norms = {"q_weight": self.q_norm.weight, "k_weight": self.k_norm.weight,
                 "eps": self.q_norm.eps} if "q_norm" in self else {}
        return attention_prep.attention_prep(
            qkv, offset, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rotary_dim=self.rotary_dim, base=float(self.rope_theta), gate=self.output_gate, **norms)

    def rotary_qk(self, q: mx.array, k: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """q, k (B, heads, T, D) at the rotary of positions offset.. (none where rotary_dim is 0)."""
        T = q.shape[2]
        if self.rotary_dim and CpuShortCalls.applies(T):
            q, k = cpu_rope(self.rotary_dim, float(self.rope_theta))(q, k, mx.array(offset, dtype=mx.int32))
        elif self.rotary_dim:  # 0: no positional embedding (Nemotron-H, Granite-4.0-H's NoPE)
            q = mx.fast.rope(q, self.rotary_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
            k = mx.fast.rope(k, self.rotary_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        return q, k

    def attend(self, q: mx.array, k: mx.array, v: mx.array, state: AttentionState) -> mx.array:
        """The window's KV written, its rows' attention over the cells they see -> (B, T, heads·D)."""
        B, _, T, _ = q.shape
        keys, values = state.update_and_fetch(k, v)
        if self.takes_kernel(T, q.dtype):
            out = attention_window.attention_window(q, keys, values, self.scale)  # (B, T, heads, D)
        elif RowSplit.applies(T):
            # Each query row alone over the cells it sees (0..offset+i): serial decoding's call.
            out = attention_window.reference_attention_window(q, keys, values, self.scale)
        elif T >= PREFILL_MIN_ROWS and mx.default_device() == mx.cpu:
            out = causal_attention_cpu(q, keys, values, self.scale).transpose(0, 2, 1, 3)
        else:
            # Row i sees cells 0..offset+i: a causal mask aligned to the last key.
            mask = "causal" if T > 1 else None
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
            out = out.transpose(0, 2, 1, 3)
        return out.reshape(B, T, -1)

    def tail(self, out: mx.array, gate: mx.array | None = None) -> mx.array:
        """Attention output (B, T, heads·D), gated where the model gates it -> (B, T, H)."""
        return self.o_proj(self.tail_input(out, gate))

    def tail_input(self, out: mx.array, gate: mx.array | None = None) -> mx.array:
        """The tail less its output projection (`out_projection`): the gate, where there is one."""
        return out if gate is None else sigmoid_gate(out, gate)

    @property
    def out_projection(self) -> nn.Module:
        return self.o_proj

    def __call__(self, x: mx.array, state: AttentionState) -> mx.array:
        core_in, tail_in = self.head(x)
        return self.tail(self.core(*core_in, state), *tail_in)
