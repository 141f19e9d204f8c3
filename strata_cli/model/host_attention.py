"""A `GatedAttention` mixer's call on the CPU's host path, in numpy: projections, the output
gate's split, q/k norms, rotary, attention over the state's cells, the gate, from the layer's
normed rows to its output projection's input.

Why on the host: as host_gdn.py (an MLX op costs several times a numpy op on a decode row). The
keys and values stay the engine's (`AttentionState`: MLX buffers written by `update_and_fetch`,
positional rollback untouched), read back once a call as numpy views.

Row invariance (docs/design.md): row i attends over cells 0..offset+i with one batched matmul
for its scores and one for its output, the same calls (shapes, strides within a head) as a
serial step at that position; softmax reduces each row's own contiguous scores; rotary angles
are (offset + i)·freq whatever T is; the rest is elementwise.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .attention import GatedAttention
from .host_blas import matvecs, rms_norm_rows, sigmoid
from .layer_state import AttentionState
from .layers import RMSNorm, RowLinear


def applies(mixer, rows: int) -> bool:
    """Whether `mixer` is a float32 `GatedAttention` (no sinks, no other subclass) computed here
    for a call of `rows` rows: not where the attention window kernel takes it."""
    if type(mixer) is not GatedAttention or mixer.takes_kernel(rows, mx.float32):
        return False
    norms = [mixer[name] for name in ("q_norm", "k_norm") if name in mixer]
    return (all(type(linear) is RowLinear and linear.weight.dtype == mx.float32
                for linear in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
            and all(type(norm) is RMSNorm and norm.weight.dtype == mx.float32 for norm in norms))


class Constants:
    """The mixer's arrays as numpy (views), made once per set of arrays (see host_gdn.Constants)."""

    __slots__ = ("sources", "linears", "q_norm", "k_norm", "inv_freq")

    def __init__(self, mixer: GatedAttention, sources: tuple):
        self.sources = sources
        self.linears = [(np.asarray(linear.weight), None if "bias" not in linear else np.asarray(linear.bias))
                        for linear in (mixer.q_proj, mixer.k_proj, mixer.v_proj)]
        has_norms = "q_norm" in mixer
        self.q_norm = (np.asarray(mixer.q_norm.weight), mixer.q_norm.eps) if has_norms else None
        self.k_norm = (np.asarray(mixer.k_norm.weight), mixer.k_norm.eps) if has_norms else None
        dims = mixer.rotary_dim
        exponents = np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims)
        self.inv_freq = (np.float32(1.0) / np.power(np.float32(mixer.rope_theta), exponents)).astype(np.float32)


def constants(mixer: GatedAttention) -> Constants:
    sources = tuple(a for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm") if name in mixer
                    for a in mixer[name].values())
    held = mixer.__dict__.get("_host_constants")
    if held is None or len(held.sources) != len(sources) or any(a is not b for a, b in zip(held.sources, sources)):
        mx.eval(sources)
        held = mixer.__dict__["_host_constants"] = Constants(mixer, sources)
    return held


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dims: int) -> np.ndarray:
    """Rotary (not traditional) over the first `dims` of x (N, heads, D); cos, sin (N, 1, dims/2)."""
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], axis=-1)


def mix(mixer: GatedAttention, normed: np.ndarray, state: AttentionState) -> np.ndarray:
    """The normed rows (N, H) of one sequence -> the output projection's input (N, heads·D):
    `GatedAttention.head`, `core` and `tail_input` on the host."""
    c = constants(mixer)
    N = normed.shape[0]
    heads, kv_heads, D = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q, k, v = (y if b is None else y + b for y, (_, b) in zip(matvecs(normed, [w for w, _ in c.linears]), c.linears))
    gate = None
    if mixer.output_gate:  # per head: [query | gate]
        q = q.reshape(N, heads, 2 * D)
        q, gate = q[..., :D], q[..., D:].reshape(N, heads * D)
    else:
        q = q.reshape(N, heads, D)
    k, v = k.reshape(N, kv_heads, D), v.reshape(N, kv_heads, D)
    if c.q_norm is not None:
        q, k = rms_norm_rows(q, *c.q_norm), rms_norm_rows(k, *c.k_norm)
    offset = state.offset
    if mixer.rotary_dim:
        theta = (np.arange(offset, offset + N, dtype=np.int64).astype(np.float32)[:, None] * c.inv_freq)[:, None]
        cos, sin = np.cos(theta), np.sin(theta)
        q, k = rotate(q, cos, sin, mixer.rotary_dim), rotate(k, cos, sin, mixer.rotary_dim)
    keys, values = state.update_and_fetch_host(*(np.ascontiguousarray(a.transpose(1, 0, 2))[None] for a in (k, v)))
    keys, values = keys[0], values[0]  # (Hkv, L, D)
    start = keys.shape[1] - N  # row i sees cells 0..start+i
    r = heads // kv_heads
    queries = (q * np.float32(mixer.scale)).reshape(N, kv_heads, r, D)
    out = np.empty((N, kv_heads, r, D), dtype=np.float32)
    for i in range(N):
        seen = start + i + 1
        scores = np.matmul(queries[i], keys[:, :seen].transpose(0, 2, 1))  # (Hkv, r, seen)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= np.add.reduce(scores, axis=-1, keepdims=True)
        out[i] = np.matmul(scores, values[:, :seen])
    out = out.reshape(N, heads * D)
    return out if gate is None else out * sigmoid(gate)
