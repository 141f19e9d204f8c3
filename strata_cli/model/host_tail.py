"""A CPU decode window's layer tail on the host: from the mixer's output to the MoE's input and
its shared expert, in numpy, with one read of the window's rows back from MLX.

On the CPU backend a short call's linears run as numpy matrix-vector products (layers.py:
`host_window`), and every read of an MLX array into numpy is a hand-off to MLX's CPU stream
thread and back. The layer's tail — output projection, residual add, post norm, the router's
and the shared expert's projections, the shared expert's SwiGLU and down projection — has no
state and nothing but rows, so it all runs here after one read; the routed experts too where
host_experts.py takes them (small experts, resident or streamed alike), else in MLX on its
stream thread while this one computes the shared expert. Every step is per row (matrix-vector
products, row-wise norms, elementwise), so a row computes what it computes alone (row
invariance, docs/design.md).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import host_blas, host_experts
from .host_blas import matvecs, sigmoid, silu_mul
from .layers import RMSNorm, RowLinear, host_weight
from .moe import SparseMoeBlock, add_gated


def applies(layer, x: mx.array) -> bool:
    """Whether `layer` (a `PreNormLayer`) may run its tail here for rows `x`: a plain float32
    tail — the mixer's `tail_input` and `out_projection`, a plain `RMSNorm` post norm, a
    `SparseMoeBlock` with a shared expert — on the host path."""
    mixer, ffn = layer.mixer, layer.ffn
    if type(ffn) is not SparseMoeBlock or "shared_expert" not in ffn or not hasattr(mixer, "tail_input"):
        return False
    shared = ffn.shared_expert
    linears = (mixer.out_projection, ffn.gate, shared.gate_proj, shared.up_proj, shared.down_proj,
               ffn.shared_expert_gate)
    return (type(layer.post_attention_layernorm) is RMSNorm
            and all(type(linear) is RowLinear and "bias" not in linear and linear.weight.dtype == mx.float32
                    for linear in linears))


def tail(layer, x: mx.array, mixed: mx.array, *tail_in: mx.array) -> mx.array:
    """`PreNormLayer.tail(x, mixed, *tail_in)` with its stateless rows in numpy (see above)."""
    pre = layer.mixer.tail_input(mixed, *tail_in)
    mx.eval(pre, x)
    host_blas.one_thread()
    rows_x = np.asarray(x).reshape(-1, x.shape[-1])
    return finish(layer, rows_x, np.asarray(pre).reshape(rows_x.shape[0], -1), x.shape)


def finish(layer, rows_x: np.ndarray, pre: np.ndarray, shape: tuple) -> mx.array:
    """The tail from the output projection's input `pre` (N, ·) and the layer's input rows
    `rows_x` (N, H), both numpy -> the layer's output (`shape`), its routed experts in MLX."""
    mixer, ffn = layer.mixer, layer.ffn
    shared = ffn.shared_expert
    [out] = matvecs(pre, [host_weight(mixer.out_projection)])
    h = rows_x + out
    norm = layer.post_attention_layernorm
    normed = host_blas.rms_norm_rows(h, host_weight(norm), norm.eps)
    # The router first: routed experts left to MLX then run on its stream thread while this
    # one computes the shared expert; each product is the same matrix-vector call either way.
    [logits] = matvecs(normed, [host_weight(ffn.gate)])
    on_host = host_experts.applies(ffn)
    if on_host:
        y = host_experts.routed(ffn, normed, logits)
    else:
        y = ffn.routed_rows(mx.array(normed), mx.array(logits))
        mx.async_eval(y)
    gate, up, shared_gate = matvecs(normed, [host_weight(shared.gate_proj), host_weight(shared.up_proj),
                                             host_weight(ffn.shared_expert_gate)])
    [shared_out] = matvecs(silu_mul(gate, up), [host_weight(shared.down_proj)])
    if on_host:
        return mx.array((h + (y + shared_out * sigmoid(shared_gate))).reshape(shape))
    return (mx.array(h) + add_gated(y, mx.array(shared_out), mx.array(shared_gate))).reshape(shape)
