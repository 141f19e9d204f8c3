"""A CPU short call's routed experts in numpy: routing, each pick's SwiGLU and the weighted sum.

With the rest of a layer on the host (host_layer.py), the routed experts were the one MLX piece
of a one-row step: a compiled call, array conversions and a wait for MLX's stream thread a
layer, several times the arithmetic of a small model's experts (the demo's are 64 × 256). Here
each pick is three matrix-vector products over its expert's matrices, dequantized in numpy.

The form applies by shapes alone (`forms`: SwiGLU experts, float32 or affine 4/8-bit, each
expert at most `MAX_EXPERT_BYTES` dequantized), so a checkpoint's resident and streamed experts
take it together and stay bit-identical: resident experts are read from their stacks
(dequantized once and kept, up to `KEPT_BYTES` a process), streamed ones from the slot banks
their cache serves (experts/switch.py, `StreamedSwitchGLU.host_picks`), through the same
`glu`. Larger experts stay in MLX, whose fused quantized products beat a numpy dequantization.

Row invariance (docs/design.md): each row is routed and reduced alone, each pick with the same
calls whatever other rows or picks there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .host_blas import one_thread, silu_mul
from .layers import swiglu

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MAX_EXPERT_BYTES = 2**20  # an expert's three matrices in float32, at most (the demo's: 192 KiB)
KEPT_BYTES = 256 * 2**20  # resident experts kept dequantized, a process in all


@dataclass(frozen=True)
class Form:
    """One projection's stacked matrices: (experts, out, in), `bits` 4 or 8 affine (None: float32)."""

    out: int
    inp: int
    bits: int | None = None
    group_size: int | None = None


def forms(experts) -> dict[str, Form] | None:
    """The projections' forms where `experts` (a MoE block's `switch_mlp`) computes here, else None."""
    own = getattr(experts, "host_forms", None)
    if own is not None:  # streamed experts say their own (experts/switch.py)
        found = own()
    elif getattr(experts, "activation", None) is not swiglu:
        return None
    else:
        found = {}
        for name in PROJECTIONS:
            p = experts[name]
            if isinstance(p, mx.array):
                if p.dtype != mx.float32 or p.ndim != 3:
                    return None
                found[name] = Form(p.shape[1], p.shape[2])
            elif getattr(p, "mode", None) == "affine" and "biases" in p and p.scales.dtype == mx.float32:
                found[name] = Form(p.weight.shape[1], p.weight.shape[2] * 32 // p.bits, p.bits, p.group_size)
            else:
                return None
    if found is None or set(found) != set(PROJECTIONS):
        return None
    if any(f.bits not in (None, 4, 8) for f in found.values()):
        return None
    return found if 4 * sum(f.out * f.inp for f in found.values()) <= MAX_EXPERT_BYTES else None


def applies(ffn) -> bool:
    """Whether a `SparseMoeBlock`'s routed experts run here: exact routing, `forms` found."""
    if ffn.routing_policy is not None:
        return False
    experts = ffn[ffn.experts_attribute]
    arrays = stack_arrays(experts)  # found again when these change (loading, `set_dtype`)
    held = ffn.__dict__.get("_host_forms")
    if held is None or held[0] is not experts or any(a is not b for a, b in zip(held[1], arrays)):
        held = ffn.__dict__["_host_forms"] = (experts, arrays, forms(experts))
    return held[2] is not None


def stack_arrays(experts) -> tuple:
    """A resident stack's arrays (each projection's matrices, or its weight, scales and biases),
    by which what was found or kept from them is known to be current; () for streamed experts."""
    if hasattr(experts, "host_forms") or not isinstance(experts, nn.Module):
        return ()
    parts = [experts.get(name) for name in PROJECTIONS]
    return tuple(a for p in parts
                 for a in ((p.get("weight"), p.get("scales"), p.get("biases")) if isinstance(p, nn.Module) else (p,)))


def dequantize(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """One expert's affine matrix: packed uint32 (out, in·bits/32), scales and biases (out, in/group)
    -> float32 (out, in), scale · q + bias. MLX packs values from the low bits up, little-endian."""
    packed = np.ascontiguousarray(weight).view(np.uint8)
    if bits == 4:
        q = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
        np.bitwise_and(packed, 0x0F, out=q[:, 0::2])
        np.right_shift(packed, 4, out=q[:, 1::2])
    else:
        q = packed
    out, inp = q.shape
    w = q.reshape(out, inp // group_size, group_size).astype(np.float32)
    w *= scales[..., None]
    w += biases[..., None]
    return w.reshape(out, inp)


def glu(x: np.ndarray, matrices: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """One pick: x (H,) through (gate (I, H), up (I, H), down (H, I)) -> (H,), silu(gate·x)·(up·x)."""
    gate_w, up_w, down_w = matrices
    return np.dot(down_w, silu_mul(np.dot(gate_w, x), np.dot(up_w, x)))


def route(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's router logits (E,) -> its top_k expert ids and their softmax probabilities."""
    probs = np.exp(logits - logits.max())
    probs /= np.add.reduce(probs)
    E = probs.shape[0]
    ids = np.argpartition(probs, E - top_k)[E - top_k:]
    return ids, probs[ids]


def routed(ffn, x: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """`SparseMoeBlock.routed` for rows x (N, H) and logits (N, E) -> (N, H), float32."""
    one_thread()
    k = ffn.top_k
    routes = [route(row, k) for row in logits]
    experts = ffn[ffn.experts_attribute]
    ids = np.stack([r[0] for r in routes])
    picks = experts.host_picks(x, ids) if hasattr(experts, "host_picks") else resident_picks(experts, x, ids)
    out = np.empty_like(x)
    for n, (_, weights) in enumerate(routes):
        if ffn.norm_topk_prob:
            weights = weights / np.add.reduce(weights)
        out[n] = np.add.reduce(picks[n] * weights[:, None], axis=0)
    return out


def resident_picks(experts, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """x (N, H), expert ids (N, k) -> each pick's output (N, k, H), from the resident stacks."""
    out = np.empty((*ids.shape, x.shape[-1]), dtype=np.float32)
    of = Kept.of_stacks(experts).matrices
    for n, row in enumerate(ids.tolist()):
        for j, e in enumerate(row):
            out[n, j] = glu(x[n], of(e))
    return out


class Kept:
    """A resident expert stack's numpy views and the experts dequantized from them, made once per
    set of arrays (a plain object in the stack module's `__dict__`, so no parameter)."""

    total = 0  # bytes kept dequantized in this process, every stack

    __slots__ = ("sources", "views", "kept", "size")

    def __init__(self, sources: tuple, projections: list):
        mx.eval([p if isinstance(p, mx.array) else p.parameters() for p in projections])
        self.sources, self.views, self.kept, self.size = sources, host_views(projections), {}, 0

    def __del__(self):
        Kept.total -= self.size

    @classmethod
    def of_stacks(cls, experts) -> Kept:
        sources = stack_arrays(experts)  # scales too: `set_dtype` replaces them, not the weights
        held = experts.__dict__.get("_host_kept")
        if held is None or any(a is not b for a, b in zip(held.sources, sources)):
            held = experts.__dict__["_host_kept"] = cls(sources, [experts[name] for name in PROJECTIONS])
        return held

    def matrices(self, e: int) -> tuple[np.ndarray, ...]:
        """Expert `e`'s three float32 matrices (kept while the process's budget lasts)."""
        held = self.kept.get(e)
        if held is None:
            held = expert_matrices(self.views, e)
            size = sum(m.nbytes for m, v in zip(held, self.views) if not isinstance(v, np.ndarray))
            if Kept.total + size <= KEPT_BYTES:
                self.kept[e] = held
                self.size += size
                Kept.total += size
        return held


def host_views(projections: list) -> list:
    """Each projection's stack as numpy: a float32 (E, out, in) array, or the quantized form's
    (weight, scales, biases, bits, group_size); a projection is an array or anything with those
    attributes (`QuantizedExperts`)."""
    return [np.asarray(p) if isinstance(p, mx.array)
            else (np.asarray(p.weight), np.asarray(p.scales), np.asarray(p.biases), p.bits, p.group_size)
            for p in projections]


def expert_matrices(views: list, e: int) -> tuple[np.ndarray, ...]:
    """Expert (or slot) `e`'s three float32 matrices from `host_views`."""
    return tuple(v[e] if isinstance(v, np.ndarray) else dequantize(v[0][e], v[1][e], v[2][e], v[3], v[4])
                 for v in views)
