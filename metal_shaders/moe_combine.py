"""A MoE layer's decode-window combine in one kernel: `moe_combine`.

Legend: R rows (<= 8 in a decode window), k experts a row, H hidden.

After the routed experts, MLX ops combine a window's picks with a Sum of the weights, a
compiled divide-multiply, a Sum over k (and its Squeeze and ExpandDims), then a compiled
sigmoid-add for a shared expert, and the decoder layer adds the result to its residual stream:
seven launches a layer (on the H200 ~6-25 µs each, and the step is launch-bound). This is one call:

    out[r, c] = (residual[r, c] +) sum_j picks[r, j, c] * w[r, j]  (+ shared[r, c] * sigmoid(gate[r]))

with w = weights / sum(weights) where the block renormalises (`normalize`), else the weights as
given, the gate term only where a shared expert's output and gate logits are passed, and the
residual only where the layer's stream is passed (`residual`).

The arithmetic, per output element (row r, column c), all in float32, in this order:
  total = 0; for j = 0..k-1: total = total + weights[r, j]          (only when normalising)
  acc = 0;   for j = 0..k-1: acc = fmaf(float(picks[r, j, c]), w_j, acc),
             w_j = weights[r, j] / total when normalising, else weights[r, j]
  shared:    acc = fmaf(float(shared[r, c]), 1 / (1 + expf(-float(gate[r]))), acc)
  out[r, c] = acc rounded once to the picks' dtype (round to nearest even), or, with a residual,
             float(residual[r, c]) + float(that rounded acc), rounded once more: what MLX's Add of
             the residual and the unfused combine computes (a float sum of two values of the dtype,
             one rounding), so the folded output has the bits of `residual + moe_combine(...)`.
One thread computes one element, with no exchange between threads; the block (THREADS columns)
and the grid (column tiles x rows) only place the threads. So a row's bits are a function of
that row's inputs, k and H alone, never of R: a serial 1-row step and a window's row share them.

One body for CUDA and Metal (backends.py); `reference_moe_combine` (pure MLX) is what the tests
and the probe hold the kernel to (the residual variants: to MLX's add of the residual to the plain
variant's output, bit for bit); callers run MLX's ops wherever `usable()` is False (the CPU).
Every input is read as a row-major array (no strides: metal_shaders/precompiled.py keeps the
cubin across processes); the gate logit is read at a column of each row of its input, so a
shared gate that is a column of the stacked router's output is passed as that whole output
(contiguous), not as a strided view that would need a copy.
"""

from __future__ import annotations

import mlx.core as mx

from .probe import PROBE_DTYPES, Probe, cases_at, dims, gpu_kernel

THREADS = 256  # columns a block

# dims: R, k, H, normalise (0 / 1), G (the gate input's row length), the gate's column.
# A grid of column tiles (x) by rows (y); a thread per output element.
ROUTED = """
    const int K = dims[1], H = dims[2];
    const bool normalise = dims[3] != 0;
    const int r = block_y, c = block_x * block_dim + thread_x;
    if (c >= H) return;
    float total = 0.0f;
    if (normalise) {
        for (int j = 0; j < K; ++j) total += weights[r * K + j];
    }
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
        const float w = normalise ? weights[r * K + j] / total : weights[r * K + j];
        acc = fmaf(static_cast<float>(picks[(r * K + j) * H + c]), w, acc);
    }
"""
SHARED = """
    const float g = static_cast<float>(gates[r * dims[4] + dims[5]]);
    acc = fmaf(static_cast<float>(shared[r * H + c]), 1.0f / (1.0f + expf(-g)), acc);
"""
STORE = """
    out[r * H + c] = static_cast<T_P>(acc);
"""
# The combine rounded to the dtype first, then the add as MLX's Add of two arrays of the dtype.
STORE_RESIDUAL = """
    out[r * H + c] = static_cast<T_P>(static_cast<float>(residual[r * H + c])
                                      + static_cast<float>(static_cast<T_P>(acc)));
"""
SOURCE = ROUTED + STORE
SOURCE_SHARED = ROUTED + SHARED + STORE
SOURCE_RESIDUAL = ROUTED + STORE_RESIDUAL
SOURCE_SHARED_RESIDUAL = ROUTED + SHARED + STORE_RESIDUAL
KERNELS = {  # (with a shared expert, with the residual): (name, inputs, body)
    (False, False): ("strata_moe_combine_v1", ["dims", "picks", "weights"], SOURCE),
    (True, False): ("strata_moe_combine_shared_v1", ["dims", "picks", "weights", "shared", "gates"], SOURCE_SHARED),
    (False, True): ("strata_moe_combine_residual_v1", ["dims", "picks", "weights", "residual"], SOURCE_RESIDUAL),
    (True, True): ("strata_moe_combine_shared_residual_v1",
                   ["dims", "picks", "weights", "shared", "gates", "residual"], SOURCE_SHARED_RESIDUAL),
}


def takes(picks: mx.array, weights: mx.array, shared: mx.array | None = None, gates: mx.array | None = None,
          gate_column: int = 0, residual: mx.array | None = None) -> bool:
    """Whether the kernel takes these arrays: picks (..., k, H) float32 or bfloat16, weights
    (..., k) float32, with a shared expert shared (..., H) and gates (..., G), 0 <= gate_column
    < G, and a residual (..., H), each of the picks' dtype (so the result's dtype is the one
    MLX's ops give)."""
    if picks.ndim < 2 or picks.dtype not in PROBE_DTYPES or weights.dtype != mx.float32:
        return False
    if tuple(weights.shape) != tuple(picks.shape[:-1]):
        return False
    lead = tuple(picks.shape[:-2])
    if residual is not None and (residual.dtype != picks.dtype or tuple(residual.shape) != (*lead, picks.shape[-1])):
        return False
    if shared is None:
        return gates is None
    return (gates is not None and shared.dtype == gates.dtype == picks.dtype
            and tuple(shared.shape) == (*lead, picks.shape[-1]) and tuple(gates.shape[:-1]) == lead
            and 0 <= gate_column < gates.shape[-1])


def launch(rows: int, hidden: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: column tiles by rows."""
    return {"grid": (-(-hidden // THREADS) * THREADS, rows, 1), "threadgroup": (THREADS, 1, 1)}


def moe_combine(picks: mx.array, weights: mx.array, *, normalize: bool = False, shared: mx.array | None = None,
                gates: mx.array | None = None, gate_column: int = 0, residual: mx.array | None = None) -> mx.array:
    """A MoE layer's output from its picks, on a GPU, one call (the arithmetic: module docstring).

    Args:
        picks: (..., k, H), the routed experts' outputs, float32 or bfloat16.
        weights: (..., k) float32, the picks' weights.
        normalize: weigh by weights over their sum (the block's norm_topk_prob).
        shared: (..., H) the shared expert's output, or None (no shared expert).
        gates: (..., G) whose column `gate_column` holds each row's shared-expert gate logit
            (G = 1 for a plain gate; the stacked router's output, with the gate's column).
        residual: (..., H) of the picks' dtype, added to the result (the decoder layer's stream),
            or None.

    Returns:
        (..., H) in the picks' dtype.
    """
    k, H = picks.shape[-2:]
    R = picks.size // (k * H)
    has_shared, has_residual = shared is not None, residual is not None
    name, inputs, body = KERNELS[has_shared, has_residual]
    kernel = gpu_kernel(name, inputs, ["out"], body)
    G = gates.shape[-1] if has_shared else 1
    args = [dims(R, k, H, int(normalize), G, gate_column), picks, weights]
    if has_shared:
        args += [shared, gates]
    if has_residual:
        args.append(residual)
    out, = kernel(inputs=args, template=[("T_P", picks.dtype)], output_shapes=[(*picks.shape[:-2], H)],
                  output_dtypes=[picks.dtype], **launch(R, H))
    return out


def reference_moe_combine(picks: mx.array, weights: mx.array, *, normalize: bool = False,
                          shared: mx.array | None = None, gates: mx.array | None = None,
                          gate_column: int = 0, residual: mx.array | None = None) -> mx.array:
    """What `moe_combine` computes, in plain MLX float32 (a product and a sum where the kernel
    fuses them, so within a rounding a term of it), rounded once to the picks' dtype; with a
    residual, MLX's add of it to that (the layer's unfused add)."""
    p, w = picks.astype(mx.float32), weights.astype(mx.float32)
    if normalize:
        total = w[..., :1]
        for j in range(1, w.shape[-1]):
            total = total + w[..., j : j + 1]
        w = w / total
    acc = p[..., 0, :] * w[..., 0:1]
    for j in range(1, p.shape[-2]):
        acc = acc + p[..., j, :] * w[..., j : j + 1]
    if shared is not None:
        g = gates[..., gate_column : gate_column + 1].astype(mx.float32)
        acc = acc + shared.astype(mx.float32) * (1.0 / (1.0 + mx.exp(-g)))
    out = acc.astype(picks.dtype)
    return out if residual is None else residual + out


_probe = Probe("MoE combine kernel", "MoE layers combine their picks with MLX's ops")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the picks' dtype (probe.Probe.takes)."""
    return _probe.takes(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(H: int, k: int, *, rows: int = 8, dtype=mx.float32, seed: int = 0, gate_width: int = 3):
    """Random picks (rows, k, H) in `dtype`, softmax-like weights (rows, k) float32 (positive,
    summing to well under 1, so a missing renormalisation shows), a shared output (rows, H) and
    gates (rows, gate_width) in `dtype`, the gate logits spread over both signs."""
    keys = mx.random.split(mx.random.key(seed), 4)
    picks = mx.random.normal((rows, k, H), key=keys[0]).astype(dtype)
    weights = mx.random.uniform(0.01, 0.2, (rows, k), key=keys[1])
    shared = mx.random.normal((rows, H), key=keys[2]).astype(dtype)
    gates = (mx.random.normal((rows, gate_width), key=keys[3]) * 3).astype(dtype)
    return picks, weights, shared, gates


def probe_residual(H: int, *, rows: int = 8, dtype=mx.float32, seed: int = 0) -> mx.array:
    """A random residual stream (rows, H) in `dtype`, a few times the combine's scale (as a
    layer's stream is), so the add rounds away low bits of the combine."""
    return (4 * mx.random.normal((rows, H), key=mx.random.key(seed + 1))).astype(dtype)


# (H, dtype, k): the 80B's hidden and top 10, an odd width with a column tail, a single pick
PROBE_CASES = ((2048, mx.float32, 10), (2048, mx.bfloat16, 10), (130, mx.bfloat16, 4), (130, mx.float32, 1))


def tolerance(dtype) -> float:
    """How far (relative to the element) the kernel may be from the reference beyond float32's
    reorderings: one rounding of the output dtype (a float32 sum a rounding apart can round
    to the neighbouring bfloat16)."""
    return 2.0**-7 if dtype == mx.bfloat16 else 0.0


def within(got: mx.array, expected: mx.array, dtype) -> bool:
    """|got - expected| <= tolerance(dtype)·|expected| + 1e-5 of the row's largest |expected|."""
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    scale = mx.abs(expected).max(axis=-1, keepdims=True)
    return (mx.abs(got - expected) <= tolerance(dtype) * mx.abs(expected) + 1e-5 * scale).all().item()


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: with and without a shared
    expert, renormalising or not, with and without the residual, each row of an 8-row and a
    3-row call equals its 1-row call bit for bit; without the residual the result is within
    `within` of the reference, and with it equal bit for bit to MLX's add (on this device) of
    the residual to that result: the unfused add the fold replaces, so within the reference too."""
    for H, dtype, k in (cases if dtypes is None else cases_at(cases, dtypes)):
        picks, weights, shared, gates = probe_inputs(H, k, dtype=dtype)
        residual = probe_residual(H, dtype=dtype)
        for normalize, has_shared in ((True, True), (False, False), (True, False), (False, True)):
            extra = {"shared": shared, "gates": gates, "gate_column": 1} if has_shared else {}
            unfolded = None
            for has_residual in (False, True):
                def rows(lo, hi, extra=extra, normalize=normalize, has_residual=has_residual):
                    part = {**extra, **({"shared": shared[lo:hi], "gates": gates[lo:hi]} if extra else {})}
                    part.update({"residual": residual[lo:hi]} if has_residual else {})
                    return moe_combine(picks[lo:hi], weights[lo:hi], normalize=normalize, **part)

                alone = mx.concatenate([rows(t, t + 1) for t in range(8)])
                together, three = rows(0, 8), rows(5, 8)
                expected = (residual + unfolded if has_residual
                            else reference_moe_combine(picks, weights, normalize=normalize, **extra))
                mx.eval(alone, together, three, expected)
                where = (f"H={H}, k={k}, {dtype}, normalize={normalize}, shared={has_shared}"
                         + (", residual=True" if has_residual else ""))
                if not (mx.array_equal(together, alone).item() and mx.array_equal(three, alone[5:]).item()):
                    return f"moe_combine rows differ with the row count ({where})"
                if has_residual and not mx.array_equal(together, expected).item():
                    return f"moe_combine's residual differs from MLX's add ({where})"
                if not has_residual and not within(together, expected, dtype):
                    return f"moe_combine differs from the reference ({where})"
                unfolded = together
    return None
