"""An attention layer's head after its projection in one kernel: `attention_prep`.

Legend: B batch, T rows a batch element (R = B·T <= 8 in a decode window), Hq query heads, Hkv
key/value heads, D the head size, RD the rotary size (<= D, even; 0: no rotary), W a row of the
stacked q/k/v projection: Hq·D (Hq·2D with an output gate: per head [query | gate]), then Hkv·D
of keys, then Hkv·D of values. T the model dtype (the projection's).

In MLX ops a decode window's attention head (strata_cli/model/attention.py) is a split of the
stacked projection, the gate split out of q, four reshapes, q_norm and k_norm, three transposes to
(B, heads, T, D) and two `mx.fast.rope` calls at the state's offset: ~14 launches a layer on a
GPU (~10-25 µs each on the H200, and the decode step is launch-bound). This is one call that takes
the stacked projection's output (B, T, W) row-major, the norms' weights and the offset (as data:
one compile serves every position) and writes q, k (normed and rotated) and v as
(B, heads, T, D), and the gate as (B, T, Hq·D) where the model has one.

Its arithmetic, per head of a row, in float32 unless a value is said to be rounded to T
(round to nearest even; for T = float32 every rounding is exact):

- q and k with a norm: the sum of squares of float(x) (fmaf) in a fixed order: thread i of
  THREADS takes elements i, i + THREADS, ... in turn, then a xor butterfly in each warp, then the
  warps in order 0..WARPS-1; inv = rsqrtf(sum / D + eps); n = T(float(T(x · inv)) · float(w)), as
  `mx.fast.rms_norm` spells it (the normalised value rounded to T before the weight). Without a
  norm n = x.
- rotary (not traditional, scale 1), for i < RD/2 and its partner i + RD/2 at the row's absolute
  position p = offset + t: theta = float(p) · inv_freq[i] (one float32 rounding; inv_freq is
  `cpu_rope`'s float32 table, base^(-2i/RD)), c = cosf(theta), s = sinf(theta);
  out[i] = T(fmaf(n[i], c, -(n[i + RD/2] · s))), out[i + RD/2] = T(fmaf(n[i + RD/2], c, n[i] · s));
  elements from RD on pass through (T(n)). The angle is a function of the absolute position alone,
  so a row alone at offset p and row t of a window at offset p - t get the same bits.
- v and the gate: copied.

Within TOLERANCE of the reference (the head's own MLX ops and `cpu_rope`, today's CPU short-call
rope): the sum's order, rsqrtf, the device's cosf/sinf and the fmaf move float32 values a few ulps.

Row-invariant by construction: a block serves one head of one row, and its arithmetic is a
function of that head's inputs, the weights, D, RD and the row's absolute position alone, never of
R or of other rows. Serial 1-row steps take the same kernel as windows, so serial and speculative
decoding stay identical; prompt chunks keep MLX's ops.

One body for CUDA and Metal (backends.py), reading no shapes or strides (sizes and the offset
come as data), so strata's CUDA build keeps its cubin across processes (precompiled.py);
`reference_attention_prep` (pure MLX) is what the tests and the probe hold it to; callers run
MLX's ops wherever `usable()` is False (the CPU, a failed probe).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .backends import block_reduce
from .pooled import step_dims
from .probe import Probe, cases_at, constant, dims, gpu_kernel

MAX_WARPS = 8
MAX_PER = 4  # a thread keeps D / THREADS (<= 4) values in registers: D <= 1024

# One block per (row, head slot): slots 0..Hq-1 the query heads, then Hkv key heads, then Hkv
# value heads. WARPS warps, PER values a thread, T, NORM (q_norm/k_norm) compiled in; the stacked
# projection row-contiguous. dims: T rows a batch element, Hq, Hkv, D, RD; offset: the position of
# each batch element's first row.
_BODY = """
    constexpr int THREADS = WARPS * 32;
    const int T_ROWS = dims[0], Hq = dims[1], Hkv = dims[2], D = dims[3], RD = dims[4];
    const int slots = Hq + 2 * Hkv, QW = Hq * D * (GATE ? 2 : 1), W = QW + 2 * Hkv * D;
    const int r = block_x / slots, slot = block_x % slots;
    const int b = r / T_ROWS, t = r % T_ROWS;
    const int lane = thread_x & 31, warp = thread_x >> 5;
    STRATA_SHARED float part_s[WARPS];
    STRATA_SHARED float n_s[THREADS * PER];
    const bool is_q = slot < Hq, is_v = slot >= Hq + Hkv;
    const int head = is_q ? slot : is_v ? slot - Hq - Hkv : slot - Hq;
    const int H = is_q ? Hq : Hkv;
    const auto row = static_cast<size_t>(r) * W;
    const auto in = row + (is_q ? static_cast<size_t>(head) * D * (GATE ? 2 : 1)
                                : QW + (is_v ? Hkv * D : 0) + static_cast<size_t>(head) * D);
    const auto o = ((static_cast<size_t>(b) * H + head) * T_ROWS + t) * D;
    if (is_v) {
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = thread_x + j * THREADS;
            if (i < D) v[o + i] = qkv[in + i];
        }
        return;
    }
GATE_COPY
    // every load before the sum (the norm's weight, the frequencies, the position, the epsilon):
    // one trip to memory, where loads after the sum and the barrier would each wait for their own
    const int half = RD / 2;
    const auto w = is_q ? q_weight : k_weight;
    float x[PER], wv[PER], fv[PER];
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) {
            x[j] = static_cast<float>(qkv[in + i]);
            if (NORM) wv[j] = static_cast<float>(w[i]);
            if (i < RD) fv[j] = inv_freq[i < half ? i : i - half];
        }
    }
    const float epsilon = eps[0];
    const float p = static_cast<float>(offset[b] + t);
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) s = fmaf(x[j], x[j], s);
    }
    if (NORM) {
""" + block_reduce("s", "total") + """        const float inv = rsqrtf(total / static_cast<float>(D) + epsilon);
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = thread_x + j * THREADS;
            if (i < D) {
                const float n = static_cast<float>(static_cast<T>(x[j] * inv));
                x[j] = static_cast<float>(static_cast<T>(n * wv[j]));
            }
        }
    }
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) n_s[i] = x[j];
    }
    strata_sync();
    const auto dst = is_q ? q : k;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) {
            float y = x[j];
            if (i < RD) {
                const float theta = p * fv[j];
                const float c = cosf(theta), sn = sinf(theta);
                y = i < half ? fmaf(x[j], c, -(n_s[i + half] * sn)) : fmaf(x[j], c, n_s[i - half] * sn);
            }
            dst[o + i] = static_cast<T>(y);
        }
    }
"""
_GATE_COPY = """    if (is_q) {
        const auto g = static_cast<size_t>(r) * Hq * D + static_cast<size_t>(head) * D;
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = thread_x + j * THREADS;
            if (i < D) gate[g + i] = qkv[in + D + i];
        }
    }
"""
# gate (True: the output gate's form, four outputs) -> (kernel name, outputs, body)
KERNELS = {
    True: ("strata_attention_prep_gate_v2", ["q", "k", "v", "gate"],
           "    constexpr bool GATE = true;" + _BODY.replace("GATE_COPY\n", _GATE_COPY)),
    False: ("strata_attention_prep_v2", ["q", "k", "v"],
            "    constexpr bool GATE = false;" + _BODY.replace("GATE_COPY\n", "")),
}
SOURCE, SOURCE_PLAIN = KERNELS[True][2], KERNELS[False][2]
INPUTS = ["dims", "eps", "offset", "qkv", "q_weight", "k_weight", "inv_freq"]


def supports(head_dim: int, rotary_dim: int) -> bool:
    """Head sizes the kernel takes (up to MAX_WARPS * 32 * MAX_PER: 1024) and an even rotary size
    within the head (0: no rotary)."""
    return 0 < head_dim <= MAX_WARPS * 32 * MAX_PER and 0 <= rotary_dim <= head_dim and rotary_dim % 2 == 0


def warps(head_dim: int) -> int:
    """Warps a block (WARPS, compiled in): a value a thread up to 256 elements, then 8 warps."""
    return min(MAX_WARPS, -(-head_dim // 32))


def per_thread(head_dim: int) -> int:
    """The values each thread holds (PER, compiled in: one compile per model's head size)."""
    return -(-head_dim // (warps(head_dim) * 32))


def launch(rows: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a block per (row, head slot)."""
    threads = warps(head_dim) * 32
    return {"grid": (rows * (num_heads + 2 * num_kv_heads) * threads, 1, 1), "threadgroup": (threads, 1, 1)}


def width(num_heads: int, num_kv_heads: int, head_dim: int, gate: bool) -> int:
    """W: a row of the stacked q/k/v projection."""
    return (num_heads * (2 if gate else 1) + 2 * num_kv_heads) * head_dim


@lru_cache
def inv_freq(rotary_dim: int, base: float) -> mx.array:
    """The rotary's float32 inverse frequencies, base^(-2i/RD) (`cpu_rope`'s table: transformers'
    form); a (1,) placeholder for no rotary."""
    if rotary_dim == 0:
        return mx.zeros((1,), dtype=mx.float32)
    table = 1.0 / (base ** (mx.arange(0, rotary_dim, 2, dtype=mx.float32) / rotary_dim))
    mx.eval(table)
    return table


def attention_prep(qkv: mx.array, offset: int | mx.array, *, num_heads: int, num_kv_heads: int, head_dim: int,
                   rotary_dim: int, base: float, gate: bool, q_weight: mx.array | None = None,
                   k_weight: mx.array | None = None, eps: float = 0.0) -> tuple[mx.array, ...]:
    """The attention head after its stacked projection, on a GPU, one call.

    Args:
        qkv: (B, T, W) row-major, float32 or bfloat16 (`width`).
        offset: the absolute position of row 0 (an int, or an int32 array of one per batch element).
        gate: whether each query head is [query | gate] (Qwen3-Next's output gate).
        q_weight, k_weight: q_norm's and k_norm's weights (D,) in qkv's dtype, or both None (no norm).
        eps: the norms' epsilon.

    Returns:
        q (B, Hq, T, D), k and v (B, Hkv, T, D), and with `gate` the gate (B, T, Hq·D), in qkv's
        dtype (the module docstring says how each value is rounded).
    """
    B, T, _ = qkv.shape
    D, dtype = head_dim, qkv.dtype
    norm = q_weight is not None
    if not isinstance(offset, mx.array):
        offset = step_dims(*[offset] * B, kind="offset")  # from the host: no primitive to launch
    unused = mx.zeros((1,), dtype=dtype)
    name, outputs, body = KERNELS[gate]
    kernel = gpu_kernel(name, INPUTS, outputs, body)
    shapes = [(B, num_heads, T, D), (B, num_kv_heads, T, D), (B, num_kv_heads, T, D)]
    shapes += [(B, T, num_heads * D)] if gate else []
    return tuple(kernel(
        inputs=[dims(T, num_heads, num_kv_heads, D, rotary_dim), constant(eps), offset, qkv,
                q_weight if norm else unused, k_weight if norm else unused, inv_freq(rotary_dim, base)],
        template=[("T", dtype), ("PER", per_thread(D)), ("WARPS", warps(D)), ("NORM", norm)],
        output_shapes=shapes, output_dtypes=[dtype] * len(shapes), **launch(B * T, num_heads, num_kv_heads, D)))


def reference_rope(x: mx.array, offset: int, rotary_dim: int, base: float) -> mx.array:
    """`cpu_rope`'s arithmetic (strata_cli/model/attention.py) in MLX ops: x (B, heads, T, D) at
    positions offset.., each element rounded to x's dtype."""
    if rotary_dim == 0:
        return x
    half = rotary_dim // 2
    positions = (offset + mx.arange(x.shape[-2], dtype=mx.int32)).astype(mx.float32)
    theta = positions[:, None] * inv_freq(rotary_dim, base)
    cos, sin = mx.cos(theta), mx.sin(theta)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    rotated = [(x1 * cos - x2 * sin).astype(x.dtype), (x1 * sin + x2 * cos).astype(x.dtype)]
    return mx.concatenate(rotated + ([x[..., rotary_dim:]] if x.shape[-1] > rotary_dim else []), axis=-1)


def reference_attention_prep(qkv: mx.array, offset: int, *, num_heads: int, num_kv_heads: int, head_dim: int,
                             rotary_dim: int, base: float, gate: bool, q_weight: mx.array | None = None,
                             k_weight: mx.array | None = None, eps: float = 0.0) -> tuple[mx.array, ...]:
    """What `attention_prep` computes, in plain MLX: the head's own ops (the split, the gate
    taken from q, `mx.fast.rms_norm` over D, the transposes), then `cpu_rope`'s rotary."""
    B, T, _ = qkv.shape
    D = head_dim
    qw = num_heads * D * (2 if gate else 1)
    q, k, v = mx.split(qkv, [qw, qw + num_kv_heads * D], axis=-1)
    out_gate = ()
    if gate:
        q, g = mx.split(q.reshape(B, T, num_heads, 2 * D), 2, axis=-1)
        out_gate = (g.reshape(B, T, -1),)
    q = q.reshape(B, T, num_heads, D)
    k, v = k.reshape(B, T, num_kv_heads, D), v.reshape(B, T, num_kv_heads, D)
    if q_weight is not None:
        q, k = mx.fast.rms_norm(q, q_weight, eps), mx.fast.rms_norm(k, k_weight, eps)
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    q, k = reference_rope(q, offset, rotary_dim, base), reference_rope(k, offset, rotary_dim, base)
    return (q, k, v, *out_gate)


_probe = Probe("attention-prep kernel", "attention heads run MLX's ops")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the projection's dtype (probe.Probe.takes)."""
    return _probe.takes(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(num_heads: int, num_kv_heads: int, head_dim: int, *, gate: bool, norm: bool, rows: int = 8,
                 dtype=mx.float32, seed: int = 0):
    """qkv (1, rows, W) and the norms' weights (D,) (or None) in `dtype`: one row of zeros (the sum
    of squares is 0: inv = rsqrt(eps)), one row 1e3 times larger."""
    kx, kq, kk = mx.random.split(mx.random.key(seed), 3)
    scale = mx.ones((rows, 1)).at[min(2, rows - 1)].multiply(1e3)
    qkv = mx.random.normal((rows, width(num_heads, num_kv_heads, head_dim, gate)), key=kx) * scale
    if rows > 1:
        qkv = mx.where((mx.arange(rows) == 1)[:, None], 0.0, qkv)
    weights = [(1.0 + 0.25 * mx.random.normal((head_dim,), key=key)).astype(dtype) for key in (kq, kk)]
    return qkv[None].astype(dtype), *(weights if norm else (None, None))


PROBE_EPS = 1e-6
PROBE_OFFSETS = (0, 4093)  # a window at the start, and one where float(p) · inv_freq spans many turns
# (Hq, Hkv, D, RD, gate, norm, dtype, base): Qwen3-Next-80B's attention (output gate, partial
# rotary, q/k norm), a plain layout (no gate, full rotary, no norm) and an odd one.
PROBE_CASES = ((16, 2, 256, 64, True, True, mx.bfloat16, 1e7), (4, 2, 64, 64, False, False, mx.float32, 1e4),
               (3, 1, 130, 32, True, False, mx.float32, 5e5), (16, 2, 256, 64, True, True, mx.float32, 1e7),
               (4, 2, 64, 64, False, False, mx.bfloat16, 1e4))
# within this of the reference, relative to each head's largest value (a float32 sum in another
# order, rsqrtf, the device's cosf/sinf and one fmaf move float32 values a few ulps; at bfloat16
# a rounding may flip)
TOLERANCE = {mx.float32: 2e-5, mx.bfloat16: 2.0**-7}


def within(got: mx.array, expected: mx.array, dtype) -> mx.array:
    """Whether every value is within TOLERANCE[dtype] of the reference's, relative to the largest
    |value| of its head (the last axis)."""
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    largest = mx.max(mx.abs(expected), axis=-1, keepdims=True)
    return (mx.abs(got - expected) <= TOLERANCE.get(dtype, 2.0**-7) * largest).all()


def _case_spec(case) -> dict:
    Hq, Hkv, D, RD, gate, norm, dtype, base = case
    return {"num_heads": Hq, "num_kv_heads": Hkv, "head_dim": D, "rotary_dim": RD, "base": base, "gate": gate}


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for 8 and 3 rows, each row
    equals its 1-row call at its own offset bit for bit, and every output is within TOLERANCE of
    the reference."""
    for case in (cases if dtypes is None else cases_at(cases, dtypes, index=6)):
        spec, dtype, norm = _case_spec(case), case[6], case[5]
        qkv, qw, kw = probe_inputs(case[0], case[1], case[2], gate=case[4], norm=norm, dtype=dtype)
        weights = {"q_weight": qw, "k_weight": kw, "eps": PROBE_EPS}
        for p in PROBE_OFFSETS:
            together = attention_prep(qkv, p, **spec, **weights)
            three = attention_prep(qkv[:, 5:], p + 5, **spec, **weights)
            alone = [attention_prep(qkv[:, t : t + 1], p + t, **spec, **weights) for t in range(8)]
            expected = reference_attention_prep(qkv, p, **spec, **weights)
            mx.eval(together, three, alone, expected)
            form = f"Hq={case[0]}, Hkv={case[1]}, D={case[2]}, RD={case[3]}, offset {p}, {dtype}"
            for i, out in enumerate(together):
                axis = 1 if i == 3 else 2  # the gate is (B, T, Hq·D)
                rows = mx.concatenate([a[i] for a in alone], axis=axis)
                if not (mx.array_equal(out, rows).item()
                        and mx.array_equal(three[i], mx.split(rows, [5], axis=axis)[1]).item()):
                    return f"attention_prep rows differ with the row count ({form})"
                if not within(out, expected[i], dtype).item():
                    return f"attention_prep differs from the reference ({form})"
    return None
