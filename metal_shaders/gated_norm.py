"""A recurrent layer's gated RMSNorm over groups of channels in one kernel: `gated_norm`.

Legend: R rows (<= 8 in a decode window), G groups a row (GDN: the value heads Hv), D channels a
group (GDN: Dv), C = G·D, T the model dtype (the gate's).

The tail of a Gated DeltaNet layer (strata_cli/model/gdn.py) norms each head of the recurrence's
float32 output y and gates it with silu(z). In MLX ops that is four launches a layer on a GPU (a
compiled cast of y to T and back, `mx.fast.rms_norm`, a Reshape, a compiled weight · silu(gate)
product; ~10-25 µs each on the H200, and the decode step is launch-bound); this is one call that
takes y (R, G, D) float32, the gate z (R, C) in T and the weight, (D,) or tiled (C,), and returns
(R, C) in T. Mamba-2's grouped norm (strata_cli/model/mamba2.py, `gate_first`) gates y before
the norm and weighs after it; the same body takes it.

Its arithmetic, per group of a row, in float32 unless a value is said to be rounded to T
(round to nearest even; for T = float32 every rounding is exact):

- the norm's input: GDN x = float(T(y)), y rounded to T first, as `rounded_f32` does; Mamba-2
  x = y · silu(float(z)).
- the sum of squares of x (fmaf) in a fixed order: thread i of THREADS takes elements i,
  i + THREADS, ... in turn, then a xor butterfly in each warp, then the warps in order 0..WARPS-1.
  inv = rsqrtf(sum / D + eps).
- GDN: n = T(x · inv); p = T(float(weight) · float(n)); out = T(float(p) · silu(float(z))), as
  `silu_gate_f32` spells it (its product in T, then the gate in float32).
  Mamba-2: out = T(float(weight) · (x · inv)).
- silu(g) = g · s, s = 1 - e for g >= 0 and e for g < 0, e = 1 / (1 + expf(|g|)): MLX's own
  sigmoid form (its CPU and Metal kernels), with the device's expf. Where the sums and expf agree
  the output is MLX's bits; the sum's order, rsqrtf and expf differ from MLX's (the CPU's exp is a
  polynomial), so within TOLERANCE of the reference.

Row-invariant by construction: a block serves one group of one row, and its arithmetic is a
function of that group's y, z, the weight and D alone, never of R or of other rows. Serial 1-row
steps take the same kernel as windows, so serial and speculative decoding stay identical; prompt
chunks keep MLX's ops.

One body for CUDA and Metal (backends.py), reading no shapes or strides (sizes come in `dims`),
so strata's CUDA build keeps its cubin across processes (precompiled.py); `reference_gated_norm`
(pure MLX: the layers' own ops) is what the tests and the probe hold it to; callers run MLX's ops
wherever `usable()` is False (the CPU, a failed probe).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .backends import block_reduce
from .probe import Probe, cases_at, constant, dims, gpu_kernel

MAX_WARPS = 8
MAX_PER = 32  # a thread keeps its D / THREADS (<= 32) values of x in registers: D <= 8192

# One block per (row, group), WARPS warps (compiled in, with PER: the values a thread holds);
# inputs row-contiguous. T: z's, the weight's and out's dtype; GATE_FIRST: Mamba-2's order.
# dims: R, G, D, the weight's step between groups (0: a (D,) weight, D: a tiled (C,) one).
SOURCE = """
    constexpr int THREADS = WARPS * 32;
    const int G = dims[1], D = dims[2];
    const int lane = thread_x & 31, warp = thread_x >> 5;
    STRATA_SHARED float part_s[WARPS];
    const auto base = static_cast<size_t>(block_x) * D;
    const auto wbase = static_cast<size_t>(block_x % G) * dims[3];
    // every load first (the epsilon too): one trip to memory before the sum, none after it
    float v[PER], gv[PER], wv[PER];
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) {
            v[j] = y[base + i];
            gv[j] = static_cast<float>(z[base + i]);
            wv[j] = static_cast<float>(weight[wbase + i]);
        }
    }
    const float epsilon = eps[0];
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) {
            if (GATE_FIRST) {
                const float g = gv[j];
                const float e = 1.0f / (1.0f + expf(fabsf(g)));
                v[j] = v[j] * (g * (g < 0.0f ? e : 1.0f - e));
            } else {
                v[j] = static_cast<float>(static_cast<T>(v[j]));
            }
            s = fmaf(v[j], v[j], s);
        }
    }
""" + block_reduce("s", "total") + """    const float inv = rsqrtf(total / static_cast<float>(D) + epsilon);
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = thread_x + j * THREADS;
        if (i < D) {
            const float w = wv[j];
            if (GATE_FIRST) {
                out[base + i] = static_cast<T>(w * (v[j] * inv));
            } else {
                const T p = static_cast<T>(w * static_cast<float>(static_cast<T>(v[j] * inv)));
                const float g = gv[j];
                const float e = 1.0f / (1.0f + expf(fabsf(g)));
                out[base + i] = static_cast<T>(static_cast<float>(p) * (g * (g < 0.0f ? e : 1.0f - e)));
            }
        }
    }
"""
INPUTS = ["dims", "eps", "y", "z", "weight"]


def supports(group_size: int) -> bool:
    """Group sizes the kernel takes: up to MAX_WARPS * 32 * MAX_PER (8192)."""
    return 0 < group_size <= MAX_WARPS * 32 * MAX_PER


def warps(group_size: int) -> int:
    """Warps a block (WARPS, compiled in): a value a thread up to 256 channels, then 8 warps."""
    return min(MAX_WARPS, -(-group_size // 32))


def per_thread(group_size: int) -> int:
    """The values each thread holds (PER, compiled in: one compile per model's group size)."""
    return -(-group_size // (warps(group_size) * 32))


def launch(rows: int, groups: int, group_size: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a block per (row, group)."""
    threads = warps(group_size) * 32
    return {"grid": (rows * groups * threads, 1, 1), "threadgroup": (threads, 1, 1)}


def takes(y: mx.array, z: mx.array, weight: mx.array, *, groups: int, group_size: int) -> bool:
    """Whether the kernel takes these operands: y float32 of z's size, z (..., C) or (..., G, D),
    a weight in z's dtype of D or of C values, a supported size D."""
    C = groups * group_size
    z_ok = z.ndim >= 1 and z.shape[-1] == C or z.ndim >= 2 and z.shape[-2:] == (groups, group_size)
    return (z_ok and y.dtype == mx.float32 and y.size == z.size
            and weight.dtype == z.dtype and weight.shape in ((group_size,), (C,)) and supports(group_size))


def gated_norm(y: mx.array, z: mx.array, weight: mx.array, eps: float, *, groups: int, group_size: int,
               gate_first: bool = False) -> mx.array:
    """The gated norm of every row's groups, on a GPU, one call.

    Args:
        y: float32, z's size (GDN: (..., G, D)).
        z: (..., C), C = groups · group_size, or (..., groups, group_size); float32 or bfloat16.
        weight: (group_size,) or (C,), z's dtype.
        eps: the norm's epsilon.
        gate_first: Mamba-2's form (the gate before the norm, the weight after); else GDN's.

    Returns:
        z's shape in z's dtype (the module docstring says how each value is rounded).
    """
    R = z.size // (groups * group_size)
    step = 0 if weight.size == group_size else group_size
    kernel = gpu_kernel("strata_gated_norm_v2", INPUTS, ["out"], SOURCE)
    # The dtype is a template value too (MLX caches a compile by name and template alone).
    (out,) = kernel(inputs=[dims(R, groups, group_size, step), constant(eps), y, z, weight],
                    template=[("T", z.dtype), ("PER", per_thread(group_size)), ("WARPS", warps(group_size)),
                              ("GATE_FIRST", gate_first)],
                    output_shapes=[z.shape], output_dtypes=[z.dtype], **launch(R, groups, group_size))
    return out


def _silu_f32(z: mx.array) -> mx.array:
    return nn.silu(z.astype(mx.float32))


def reference_gated_norm(y: mx.array, z: mx.array, weight: mx.array, eps: float, *, groups: int, group_size: int,
                         gate_first: bool = False) -> mx.array:
    """What `gated_norm` computes, in plain MLX: the layers' own ops (GDN: `GatedRMSNorm`'s cast
    of y to T and back, `mx.fast.rms_norm`, then T(weight · T(normed)) · silu(z) in float32;
    Mamba-2: `GroupedGatedRMSNorm`'s y · silu(z), the norm, then weight · normed in float32)."""
    lead = z.shape[:-1] if z.shape[-1] == groups * group_size else z.shape[:-2]
    grouped = (*lead, groups, group_size)
    w = weight.reshape(-1, group_size)  # (1, D) or (G, D): broadcast over the groups or one each
    if gate_first:
        h = y.reshape(grouped) * _silu_f32(z.reshape(grouped))
        return (w.astype(mx.float32) * mx.fast.rms_norm(h, None, eps)).astype(z.dtype).reshape(z.shape)
    x = y.reshape(grouped).astype(z.dtype).astype(mx.float32)
    normed = mx.fast.rms_norm(x, None, eps).astype(z.dtype)
    return ((w * normed).astype(mx.float32) * _silu_f32(z.reshape(grouped))).astype(z.dtype).reshape(z.shape)


_probe = Probe("gated-norm kernel", "recurrent layers' gated norms run MLX's ops")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the gate's (the model's) dtype (probe.Probe.takes)."""
    return _probe.takes(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(groups: int, group_size: int, *, rows: int = 8, dtype=mx.float32, tiled: bool = False,
                 seed: int = 0):
    """y (rows, G, D) float32, z (rows, G·D) in `dtype` and a weight ((D,), or (G·D,) `tiled`) in
    `dtype`: gates from -8 to 8 (silu's both sides), one row of zeros in y (the sum of squares is
    0: inv = rsqrt(eps)), one row 1e3 times larger (y's float32 bits beyond T's)."""
    ky, kz, kw = mx.random.split(mx.random.key(seed), 3)
    scale = mx.ones((rows, 1, 1)).at[min(2, rows - 1)].multiply(1e3)
    y = mx.random.normal((rows, groups, group_size), key=ky) * scale
    if rows > 1:
        y = mx.where((mx.arange(rows) == 1)[:, None, None], 0.0, y)
    z = mx.clip(2.0 * mx.random.normal((rows, groups * group_size), key=kz), -8, 8)
    weight = 1.0 + 0.25 * mx.random.normal((groups * group_size if tiled else group_size,), key=kw)
    return y, z.astype(dtype), weight.astype(dtype)


PROBE_EPS = 1e-6
# (groups, group size, dtype, gate_first, tiled weight): Qwen3-Next-80B's heads (32 x 128), an odd
# size, Nemotron-H's groups (8 x 1024, Mamba-2's form, tiled as its weight is) and a wide odd one.
PROBE_CASES = ((32, 128, mx.bfloat16, False, False), (3, 130, mx.float32, False, True),
               (8, 1024, mx.bfloat16, True, True), (2, 1000, mx.float32, True, True),
               (32, 128, mx.float32, False, False), (3, 130, mx.bfloat16, False, True))
# out within this of the reference, relative to each value (a float32 sum in another order, the
# device's rsqrt and expf move float32 values a few ulps: at bfloat16 up to three roundings may flip)
TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 2.0**-5}


def within(got: mx.array, expected: mx.array, dtype) -> mx.array:
    """Whether every value is within TOLERANCE[dtype] of the reference's, relatively."""
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    return (mx.abs(got - expected) <= TOLERANCE.get(dtype, 2.0**-5) * mx.abs(expected)).all()


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for 8 and 3 rows (and a
    (1, 8, C) window), each row equals its 1-row call bit for bit, and the output is within
    TOLERANCE of the reference."""
    for G, D, dtype, gate_first, tiled in (cases if dtypes is None else cases_at(cases, dtypes, index=2)):
        y, z, weight = probe_inputs(G, D, dtype=dtype, tiled=tiled)
        spec = {"groups": G, "group_size": D, "gate_first": gate_first}
        alone = mx.concatenate([gated_norm(y[t : t + 1], z[t : t + 1], weight, PROBE_EPS, **spec) for t in range(8)])
        together = gated_norm(y, z, weight, PROBE_EPS, **spec)
        three = gated_norm(y[5:], z[5:], weight, PROBE_EPS, **spec)
        window = gated_norm(y[None], z[None], weight, PROBE_EPS, **spec)
        expected = reference_gated_norm(y, z, weight, PROBE_EPS, **spec)
        mx.eval(alone, together, three, window, expected)
        form = f"G={G}, D={D}, {dtype}{', gate first' if gate_first else ''}"
        if not (mx.array_equal(together, alone).item() and mx.array_equal(three, alone[5:]).item()
                and mx.array_equal(window[0], alone).item()):
            return f"gated_norm rows differ with the row count ({form})"
        if not within(together, expected, dtype).item():
            return f"gated_norm differs from the reference ({form})"
    return None
