"""A pre-norm layer's residual add and the RMSNorm after it in one kernel: `add_norm`.

Legend: R rows (<= 8 in a decode window), H the hidden size.

In MLX ops a decoder layer's middle, `h = x + mixer_out` then `rms_norm(h) * weight`, is two
launches (Add, RMSNorm; on the H200 ~10 µs each, and the step is launch-bound); this is one call
that takes x and y (..., H) and the norm's weight (H,) and returns both h and the normed h.

Its arithmetic, for T the inputs' dtype (float32 or bfloat16):

- h = T(float(x) + float(y)): the float32 sum rounded once to T. For bfloat16 that is the
  correctly rounded bfloat16 sum (a float32 sum of two bfloat16 values rounded to bfloat16 is
  rounded correctly: 24 >= 2 * 8 + 2 bits), which is what MLX's `x + y` gives on every backend
  (the tests check its bits against MLX's on the CPU, the probe on the running device).
- the sum of squares of float(h) in float32 (fmaf), in a fixed order: thread i of THREADS
  takes elements i, i + THREADS, ... in turn, then a xor butterfly in each warp, then the warps
  in order 0..WARPS-1. inv = rsqrtf(sum / H + eps).
- normed = T(float(T(float(h) * inv)) * float(weight)): the normalised value rounded once to T,
  then times the weight rounded to T, as mx.fast.rms_norm spells it (its CPU form and its GPU
  kernels round the normalised value to the output dtype before the weight). Bit for bit with
  it where the sums agree; the sum's order and rsqrtf differ, so within a rounding of T.

Row-invariant by construction: a block serves one row, and its arithmetic is a function of that
row's x, y, the weight and H alone, never of R. Serial 1-row steps take the same kernel as
windows, so serial and speculative decoding stay identical; prompt chunks keep MLX's ops.

One body for CUDA and Metal (backends.py), reading no shapes or strides (H comes in `dims`), so
strata's CUDA build keeps its cubin across processes (precompiled.py); `reference_add_norm`
(pure MLX) is what the tests and the probe hold it to; callers run MLX's ops wherever `usable()`
is False (the CPU, a failed probe).
"""

from __future__ import annotations

import mlx.core as mx

from .backends import block_reduce
from .probe import Probe, cases_at, constant, dims, gpu_kernel

WARPS = 8
THREADS = WARPS * 32
MAX_PER = 32  # a thread keeps its H / THREADS (<= 32) values of h in registers: H <= 8192

# One block per row, THREADS threads; inputs row-contiguous (R, H). PER (compiled in) is the
# values a thread holds; T the dtype of x, y, the weight and both outputs. dims: R, H.
SOURCE = """
    const int H = dims[1];
    const int r = block_x, lane = thread_x & 31, warp = thread_x >> 5;
    STRATA_SHARED float part_s[WARPS];
    const auto row = static_cast<size_t>(r) * H;
    // every load before the first store: the outputs may alias the inputs as far as the compiler
    // knows, so a load after a store waits for it, and PER loads would be PER trips to memory
    float xv[PER], yv[PER], wv[PER];
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < H) {
            xv[j] = static_cast<float>(x[row + i]);
            yv[j] = static_cast<float>(y[row + i]);
            wv[j] = static_cast<float>(weight[i]);
        }
    }
    const float epsilon = eps[0];
    float v[PER];
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < H) {
            const T rounded = static_cast<T>(xv[j] + yv[j]);
            h[row + i] = rounded;
            v[j] = static_cast<float>(rounded);
            s = fmaf(v[j], v[j], s);
        }
    }
""" + block_reduce("s", "total") + """    const float inv = rsqrtf(total / static_cast<float>(H) + epsilon);
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < H) {
            const T n = static_cast<T>(v[j] * inv);
            normed[row + i] = static_cast<T>(static_cast<float>(n) * wv[j]);
        }
    }
"""
HEADER = f"#define WARPS {WARPS}\n#define THREADS {THREADS}\n"


def supports(hidden: int) -> bool:
    """Hidden sizes the kernel takes: up to THREADS * MAX_PER (8192; every MoE family's so far)."""
    return 0 < hidden <= THREADS * MAX_PER


def takes(x: mx.array, y: mx.array, weight: mx.array) -> bool:
    """Whether the kernel takes these operands: x and y of one shape and dtype (no broadcast, no
    promotion), a weight (H,) of that dtype, a supported H."""
    return (x.ndim >= 1 and x.shape == y.shape and x.dtype == y.dtype == weight.dtype
            and weight.shape == (x.shape[-1],) and supports(x.shape[-1]))


def per_thread(hidden: int) -> int:
    """The values each thread holds (PER, compiled in: one compile per model's H)."""
    return -(-hidden // THREADS)


def launch(rows: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a block per row."""
    return {"grid": (rows * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def add_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """h = x + y and rms_norm(h) * weight of every row, on a GPU, one call.

    Args:
        x, y: (..., H), one shape, float32 or bfloat16.
        weight: (H,), x's dtype.
        eps: the norm's epsilon.

    Returns:
        h and normed, both (..., H) in x's dtype (the module docstring says how each is rounded).
    """
    H = x.shape[-1]
    R = x.size // H
    kernel = gpu_kernel("strata_add_norm_v2", ["dims", "eps", "x", "y", "weight"], ["h", "normed"], SOURCE, HEADER)
    # The dtype is a template value too (MLX caches a compile by name and template alone).
    h, normed = kernel(inputs=[dims(R, H), constant(eps), x, y, weight], template=[("T", x.dtype),
                                                                                   ("PER", per_thread(H))],
                       output_shapes=[x.shape] * 2, output_dtypes=[x.dtype] * 2, **launch(R))
    return h, normed


def reference_add_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """What `add_norm` computes, in plain MLX: h = x + y, then mx.fast.rms_norm's own CPU form
    over h (float32 mean of squares, rsqrt, rounded to the dtype, times the weight)."""
    h = x + y
    h32 = h.astype(mx.float32)
    inv = mx.rsqrt(mx.mean(mx.square(h32), axis=-1, keepdims=True) + eps)
    return h, (h32 * inv).astype(h.dtype) * weight


_probe = Probe("add-norm kernel", "decoder layers add and norm with MLX's ops")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the layer's dtype (probe.Probe.takes)."""
    return _probe.takes(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(H: int, *, rows: int = 8, dtype=mx.float32, seed: int = 0):
    """x, y (rows, H) and a weight (H,) in `dtype`: y of x's scale (the residual's adds carry
    bits), one row of zeros in both (the sum of squares is 0: inv = rsqrt(eps)), one row 1e3
    times larger (mantissa bits lost in h)."""
    kx, ky, kw = mx.random.split(mx.random.key(seed), 3)
    scale = mx.ones((rows, 1)).at[min(2, rows - 1)].multiply(1e3)
    x = mx.random.normal((rows, H), key=kx) * scale
    y = mx.random.normal((rows, H), key=ky) * scale
    if rows > 1:
        zero = mx.arange(rows)[:, None] == 1
        x, y = mx.where(zero, 0.0, x), mx.where(zero, 0.0, y)
    weight = 1.0 + 0.25 * mx.random.normal((H,), key=kw)
    return x.astype(dtype), y.astype(dtype), weight.astype(dtype)


PROBE_EPS = 1e-6
PROBE_CASES = ((2048, mx.float32), (130, mx.bfloat16), (2048, mx.bfloat16), (130, mx.float32))
# normed within this of the reference, relative to each element (a float32 sum in another order
# and the device's rsqrt move the float32 value a few ulps: at bfloat16 two roundings may flip)
TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 2.0**-6}


def within(got: mx.array, expected: mx.array, dtype) -> mx.array:
    """Whether every normed value is within TOLERANCE[dtype] of the reference's, relatively."""
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    return (mx.abs(got - expected) <= TOLERANCE.get(dtype, 2.0**-6) * mx.abs(expected)).all()


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for 8 and 3 rows (and a
    (1, 8, H) window), each row equals its 1-row call bit for bit; h equals MLX's x + y bit for
    bit and normed is within TOLERANCE of the reference's."""
    for H, dtype in (cases if dtypes is None else cases_at(cases, dtypes, index=1)):
        x, y, weight = probe_inputs(H, dtype=dtype)
        alone = [add_norm(x[t : t + 1], y[t : t + 1], weight, PROBE_EPS) for t in range(8)]
        together = add_norm(x, y, weight, PROBE_EPS)
        three = add_norm(x[5:], y[5:], weight, PROBE_EPS)
        window = add_norm(x[None], y[None], weight, PROBE_EPS)
        expected = reference_add_norm(x, y, weight, PROBE_EPS)
        mx.eval(alone, together, three, window, expected)
        alone = [mx.concatenate(parts) for parts in zip(*alone)]
        for got, one, part, view in zip(together, alone, three, window):
            if not (mx.array_equal(got, one).item() and mx.array_equal(part, one[5:]).item()
                    and mx.array_equal(view[0], one).item()):
                return f"add_norm rows differ with the row count (H={H}, {dtype})"
        if not mx.array_equal(together[0], expected[0]).item():
            return f"add_norm h differs from x + y (H={H}, {dtype})"
        if not within(together[1], expected[1], dtype).item():
            return f"add_norm normed differs from the reference (H={H}, {dtype})"
    return None
