"""Matrix × up to 8 rows with each row reduced in a fixed order: row-invariant window projections.

`rows_matvec(x, w)` computes x (R, K) @ w (N, K)ᵀ for R <= 8 rows, `rows_qmatvec` the same with
an affine-quantized w (4 or 8 bits, MLX's packing: `mx.quantize`). Each output element is summed
in float32 in one fixed order — lane l of a warp takes k = l, l+32, ... with fused multiply-adds,
then a fixed butterfly of warp shuffles — that does not depend on R, so a row's result is the
same bits whether it runs alone (serial decoding) or with seven others (a window). The weights
are read once per window for all its rows.

CUDA sources (`mx.fast.cuda_kernel`); on other backends `reference_*` (pure MLX, the tests' and
the CPU's path) is what callers use. `kernels_usable()` checks the kernels once against the
reference on the running device and falls back for good when they fail.
"""

from __future__ import annotations

import logging

import mlx.core as mx

MAX_ROWS = 8
WARPS = 8  # warps per block
COLS = 4  # output columns per warp
TILE = 256  # K values staged in shared memory per step (a multiple of 32 · values per word)

log = logging.getLogger("strata.kernels")

# Shared by both kernels: block layout, per-row float32 accumulators, x staged tile by tile in
# shared memory (TILE values of every row), and the fixed warp butterfly at the end.
_HEAD = """
    constexpr int WARPS = %(warps)d, COLS = %(cols)d, TILE = %(tile)d, ROWS = %(rows)d;
    const int R = dims[0], K = dims[1], N = dims[2];
    __shared__ float xs[ROWS][TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col0 = (blockIdx.x * WARPS + warp) * COLS;
    float acc[ROWS][COLS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r)
        #pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        for (int i = threadIdx.x; i < R * TILE; i += WARPS * 32) {
            const int r = i / TILE, k = k0 + i %% TILE;
            xs[r][i %% TILE] = k < K ? static_cast<float>(x[r * K + k]) : 0.0f;
        }
        __syncthreads();
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = col0 + c;
            if (n < N) {
"""
_TAIL = """
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int n = col0 + c;
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= R) break;
            float v = acc[r][c];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && n < N) out[r * N + n] = static_cast<T>(v);
        }
    }
"""
# Lane l takes k = l, l + 32, ... of each tile: the same order for every row count.
_DENSE = _HEAD + """
                const auto* wrow = w + static_cast<size_t>(n) * K + k0;
                for (int kk = lane; kk < TILE && k0 + kk < K; kk += 32) {
                    const float wv = static_cast<float>(wrow[kk]);
                    #pragma unroll
                    for (int r = 0; r < ROWS; ++r)
                        if (r < R) acc[r][c] = fmaf(wv, xs[r][kk], acc[r][c]);
                }
""" + _TAIL
# Lane l takes packed words l, l + 32, ... of each tile (VALS values each, one group's scale and bias).
_QUANTIZED = """
    constexpr int VALS = 32 / BITS;
    constexpr unsigned int MASK = (1u << BITS) - 1u;
""" + _HEAD + """
                const int KW = K / VALS, KG = K / GS;  // words and groups per weight row
                for (int u = lane; u < TILE / VALS && k0 + u * VALS < K; u += 32) {
                    const int k = k0 + u * VALS;
                    const unsigned int word = w[static_cast<size_t>(n) * KW + k / VALS];
                    const float s = static_cast<float>(scales[static_cast<size_t>(n) * KG + k / GS]);
                    const float b = static_cast<float>(biases[static_cast<size_t>(n) * KG + k / GS]);
                    #pragma unroll
                    for (int j = 0; j < VALS; ++j) {
                        const float wv = fmaf(s, static_cast<float>((word >> (BITS * j)) & MASK), b);
                        #pragma unroll
                        for (int r = 0; r < ROWS; ++r)
                            if (r < R) acc[r][c] = fmaf(wv, xs[r][u * VALS + j], acc[r][c]);
                    }
                }
""" + _TAIL

_kernels: dict[str, object] = {}
_dims_cache: dict[tuple[int, int, int], mx.array] = {}
_state = {"usable": None, "error": None}


def _params() -> dict:
    return {"warps": WARPS, "cols": COLS, "tile": TILE, "rows": MAX_ROWS}


def _kernel(name: str, inputs: list[str], source: str):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["out"],
                                             source=source % _params())
    return _kernels[name]


def _launch(kernel, inputs, template, rows: int, N: int, dtype):
    blocks = -(-N // (WARPS * COLS))
    (out,) = kernel(inputs=inputs, template=template, grid=(blocks * WARPS * 32, 1, 1),
                    threadgroup=(WARPS * 32, 1, 1), output_shapes=[(rows, N)], output_dtypes=[dtype])
    return out


def _dims(R: int, K: int, N: int) -> mx.array:
    # Shapes travel as data, not template values: one compiled kernel serves every shape and
    # row count, so a new window size never waits for NVRTC, and every R runs the same code.
    key = (R, K, N)
    if key not in _dims_cache:
        _dims_cache[key] = mx.array(key, dtype=mx.int32)
    return _dims_cache[key]


def rows_matvec(x: mx.array, w: mx.array) -> mx.array:
    """x (R, K) @ w (N, K)ᵀ -> (R, N) in x's dtype, R <= 8, on CUDA."""
    R, K = x.shape
    N = w.shape[0]
    kernel = _kernel("strata_rows_matvec", ["dims", "x", "w"], _DENSE)
    return _launch(kernel, [_dims(R, K, N), x, w], [("T", x.dtype)], R, N, x.dtype)


def rows_qmatvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                 bits: int) -> mx.array:
    """x (R, K) @ dequantized w (N, K·bits/32 packed)ᵀ -> (R, N), R <= 8, affine 4 or 8 bits, on CUDA."""
    R, K = x.shape
    N = w.shape[0]
    kernel = _kernel("strata_rows_qmatvec", ["dims", "x", "w", "scales", "biases"], _QUANTIZED)
    template = [("T", x.dtype), ("BITS", bits), ("GS", group_size)]
    return _launch(kernel, [_dims(R, K, N), x, w, scales, biases], template, R, N, x.dtype)


def reference_matvec(x: mx.array, w: mx.array) -> mx.array:
    """What `rows_matvec` computes, in plain MLX (float32 accumulation)."""
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)


def reference_qmatvec(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """What `rows_qmatvec` computes, in plain MLX."""
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    return (x.astype(mx.float32) @ dense.T).astype(x.dtype)


def supports(K: int, *, group_size: int | None = None, bits: int | None = None) -> bool:
    """Shapes the kernels take: K a multiple of 32 (and of the group size), 4 or 8 bits."""
    if K % 32:
        return False
    return bits is None or (bits in (4, 8) and group_size in (32, 64, 128) and K % group_size == 0)


def kernels_usable() -> bool:
    """True on CUDA once both kernels matched the reference and were row-invariant on a probe
    (checked once per process); False elsewhere or after any failure (logged once)."""
    if _state["usable"] is not None:
        return _state["usable"]
    cuda = getattr(mx, "cuda", None)
    if not (mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()):
        _state["usable"] = False
        return False
    try:
        _state["usable"] = _probe()
    except Exception as e:  # NVRTC compile errors and launch failures come as several types
        _state["error"] = f"{type(e).__name__}: {e}"
        _state["usable"] = False
    if not _state["usable"]:
        log.warning("row-invariant CUDA kernels disabled (%s); decode windows run row by row",
                    _state["error"] or "probe mismatch")
    return _state["usable"]


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return {"usable": bool(_state["usable"]), "error": _state["error"]}


def _probe() -> bool:
    key = mx.random.key(7)
    K, N = 512, 200
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.random.normal((MAX_ROWS, K), key=key).astype(dtype)
        w = (mx.random.normal((N, K), key=mx.random.key(8)) * K**-0.5).astype(dtype)
        qw, qs, qb = mx.quantize(w, 64, 4)
        cases = (
            (lambda a: rows_matvec(a, w), lambda a: reference_matvec(a, w)),
            (lambda a: rows_qmatvec(a, qw, qs, qb, group_size=64, bits=4),
             lambda a: reference_qmatvec(a, qw, qs, qb, group_size=64, bits=4)),
        )
        for kernel, reference in cases:
            together = kernel(x)
            alone = mx.concatenate([kernel(x[i : i + 1]) for i in range(MAX_ROWS)])
            expected = reference(x)
            mx.eval(together, alone, expected)
            if not mx.array_equal(together, alone).item():
                _state["error"] = f"rows differ with the row count ({dtype})"
                return False
            tol = 5e-3 if dtype == mx.float32 else 3e-2  # the reference may run at TF32
            if not mx.allclose(together.astype(mx.float32), expected.astype(mx.float32), rtol=tol, atol=tol).item():
                _state["error"] = f"kernel and reference disagree ({dtype})"
                return False
    return True
