"""A window's greedy tokens on CUDA: each row's argmax of the logits in two small kernels
(`argmax_pieces`), the tokens written straight into MLX's pool for the host to read (pooled.py).

MLX's argmax (`arg_reduce_general`) runs one block a row: the 80B shape's 151,936 bfloat16 logits
took 26 µs at T = 1 and at T = 8 under ncu on the H100 (tree d08725f), at the end of every window
and serial step, where nothing overlaps it. Here a warp takes a chunk of CHUNK values of one row
(WARPS warps a block, a lane LANE_VALUES consecutive values in one 16-byte load at bfloat16),
and writes the chunk's best value and index; a second launch, a warp a row, reduces the row's
chunks and writes its token into the row's pooled piece (POOL_INTS rows a piece).

The answer is `mx.argmax`'s: the lowest index among the row's largest values; NaN is never
chosen (every comparison with it is false, as in MLX's reduction), and a row with no value above
-inf gives 0. A lane scans its values in ascending order keeping the first strictly larger;
lanes, warps and chunks combine by (larger, or equal with the lower index), which neither the
order nor the grouping changes, so the token of a row never depends on the other rows. Indices
travel as floats, exact below 2^24 (`takes` asks for fewer columns). The probe holds the tokens
to `reference_argmax` (which must agree with `mx.argmax` on every row without NaN) on rows with
planted ties across lanes and chunks, -inf, NaN, the largest value first and last, at the dtype
asked (bfloat16, float16 or float32); until it passes, and off CUDA, MLX's argmax runs (and
`pooled.host_pieces` copies its tokens into the pool).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import backends
from .pooled import MAX_UPLOAD_INTS, host_lists, piece_cases, piece_shapes, read_pieces
from .probe import Probe, backend, constant, dims, gpu_kernel

LANE_VALUES = 8  # a lane's consecutive values: one 16-byte load at bfloat16, two at float32
CHUNK = 32 * LANE_VALUES  # a warp's values of one row
WARPS = 4  # chunks a block
MAX_COLUMNS = 1 << 24  # indices travel as floats: exact below 2^24
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

# A warp's lanes combined: every lane ends with the warp's (best, at).
COMBINE = """    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ob = strata_xor(best, off), oa = strata_xor(at, off);
        if (ob > best || (ob == best && oa < at)) { best = ob; at = oa; }
    }
"""
# dims: R, V, C (chunks a row). Block (x, y): chunks x·WARPS.. of row y; part[r, c] = (best, index).
CHUNKS = """
    const int V = dims[1], C = dims[2];
    const int lane = thread_x & 31, chunk = block_x * (block_dim >> 5) + (thread_x >> 5);
    if (chunk >= C) return;
    const float none = neg_inf[0];
    const auto row = logits + static_cast<size_t>(block_y) * V;
    const int i0 = chunk * CHUNK + lane * LANE_VALUES;
    float v[LANE_VALUES];
    if (i0 + LANE_VALUES <= V) {
        strata_load<T, LANE_VALUES>(row + i0, strata_aligned16(logits, static_cast<size_t>(V) * sizeof(T)), v);
    } else {
        #pragma unroll
        for (int j = 0; j < LANE_VALUES; ++j) v[j] = i0 + j < V ? static_cast<float>(row[i0 + j]) : none;
    }
    float best = none, at = 0.0f;
    #pragma unroll
    for (int j = 0; j < LANE_VALUES; ++j)
        if (v[j] > best) { best = v[j]; at = static_cast<float>(i0 + j); }
""" + COMBINE + """    if (lane == 0) {
        part[(static_cast<size_t>(block_y) * C + chunk) * 2] = best;
        part[(static_cast<size_t>(block_y) * C + chunk) * 2 + 1] = at;
    }
"""


def rows_source(pieces: int) -> str:
    """The second kernel for `pieces` outputs o0.. (POOL_INTS rows each, the last one or more):
    a warp a row (block y), its lanes over the row's chunks, then the warp."""
    return ("""
    const int C = dims[2], lane = thread_x & 31, i = block_y;
    float best = neg_inf[0], at = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float b = part[(static_cast<size_t>(i) * C + c) * 2], a = part[(static_cast<size_t>(i) * C + c) * 2 + 1];
        if (b > best || (b == best && a < at)) { best = b; at = a; }
    }
""" + COMBINE + "    if (lane != 0) return;\n    const unsigned int token = static_cast<unsigned int>(at);\n"
            + piece_cases(pieces, "o{j}[i & 1] = token;"))


def launches(R: int, V: int) -> tuple[int, dict, dict]:
    """Chunks a row, and the two kernels' grids and blocks (in threads, as MLX takes them)."""
    C = -(-V // CHUNK)
    chunks = {"grid": (-(-C // WARPS) * WARPS * 32, R, 1), "threadgroup": (WARPS * 32, 1, 1)}
    rows = {"grid": (32, R, 1), "threadgroup": (32, 1, 1)}
    return C, chunks, rows


def argmax_pieces(logits: mx.array) -> list[mx.array]:
    """Each row's argmax of `logits` (R, V), as uint32 pieces of POOL_INTS rows (the last maybe
    fewer), each 8 bytes at most and so in MLX's pool: two launches. See `takes`."""
    R, V = logits.shape
    C, chunks, rows = launches(R, V)
    shapes = piece_shapes(R)
    k = len(shapes)
    first = gpu_kernel("strata_argmax_chunks_v1", ["dims", "neg_inf", "logits"], ["part"], CHUNKS)
    (part,) = first(inputs=[dims(R, V, C), constant(float("-inf")), logits],
                    template=[("T", logits.dtype), ("CHUNK", CHUNK), ("LANE_VALUES", LANE_VALUES)],
                    output_shapes=[(R, C, 2)], output_dtypes=[mx.float32], **chunks)
    second = gpu_kernel(f"strata_argmax_rows_{k}_v1", ["dims", "neg_inf", "part"], [f"o{j}" for j in range(k)],
                        rows_source(k))
    return second(inputs=[dims(R, V, C), constant(float("-inf")), part], output_shapes=shapes,
                  output_dtypes=[mx.uint32] * k, **rows)


def host_argmax(logits: mx.array) -> list[int]:
    """Each row's argmax of `logits` (R, V) as a list the host reads: the kernels where `takes`,
    else `mx.argmax` read back through the pool (pooled.host_lists)."""
    if takes(logits):
        pieces = argmax_pieces(logits)
        mx.eval(*pieces)
        return read_pieces(pieces)
    return host_lists(mx.argmax(logits, axis=-1))[0]


def device_argmax(row: mx.array) -> mx.array:
    """The argmax of one row of logits (1, V) as a (1, 1) uint32 array the next step reads on the
    device (`mx.argmax(row, axis=-1, keepdims=True)`'s shape and values)."""
    if takes(row):
        return argmax_pieces(row)[0].reshape(1, 1)
    return mx.argmax(row, axis=-1, keepdims=True)


def reference_argmax(rows: mx.array) -> list[int]:
    """What MLX's CUDA argmax gives (and the kernels): per row the lowest index of the largest
    value, NaN never chosen, 0 where no value is above -inf. (MLX's CPU argmax differs on NaN:
    its scan starts from the first value.)"""
    out = []
    for row in np.array(rows.astype(mx.float32)):
        live = ~np.isnan(row) & (row > -np.inf)
        out.append(int(np.flatnonzero(row == row[live].max())[0]) if live.any() else 0)
    return out


_probe = Probe("argmax kernels", "greedy tokens come from MLX's argmax")


def takes(logits: mx.array) -> bool:
    """Whether `argmax_pieces` may take `logits`: CUDA (where the pool is), (R, V) with
    1 <= R <= MAX_UPLOAD_INTS and V < 2^24, a float dtype of DTYPES, once the probe passed."""
    return (logits.ndim == 2 and 1 <= logits.shape[0] <= MAX_UPLOAD_INTS and 0 < logits.shape[1] < MAX_COLUMNS
            and logits.dtype in DTYPES and backend() == backends.CUDA and usable(logits.dtype))


def usable(dtype=None) -> bool:
    """Whether the kernels passed their probe at `dtype` (None: float32 and bfloat16)."""
    return _probe.usable(check, dtype)


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_rows(V: int, dtype, *, seed: int = 0) -> mx.array:
    """8 rows of V logits: random; ties for the largest value across chunks and across lanes of
    one chunk; every value -inf; NaN beside a finite largest; the largest first; the largest
    last; every value equal."""
    rows = np.array(mx.random.normal((8, V), key=mx.random.key(seed)).astype(dtype).astype(mx.float32))
    top = 100.0
    rows[1, [CHUNK + 5, 3 * CHUNK + 1, V - 2]] = top  # chunks 1 and 3 and the last: the first wins
    rows[2, [LANE_VALUES + 3, 2 * LANE_VALUES + 1, 1]] = top  # lanes of chunk 0: index 1 wins
    rows[3, :] = -np.inf
    rows[4, [0, V // 2]] = np.nan
    rows[4, V // 3] = top
    rows[5, 0] = top
    rows[6, V - 1] = top
    rows[7, :] = 1.5
    return mx.array(rows).astype(dtype)


PROBE_COLUMNS = (CHUNK * 5 + 37, 151_936)  # a last chunk cut short; Qwen3-Next's vocabulary


def check(dtypes=None) -> str | None:
    """None when the kernels pass at `dtypes` on this device, else what failed: for each probe
    width, the tokens of 8 rows, of 3 and of each row alone equal `reference_argmax`'s, which
    equals `mx.argmax`'s on every row without NaN (with NaN, MLX's backends differ: its CUDA
    argmax, which the kernels replace, never chooses it)."""
    for dtype in dtypes or (mx.float32, mx.bfloat16):
        for V in PROBE_COLUMNS:
            rows = probe_rows(V, dtype)
            expected = reference_argmax(rows)
            nan = np.isnan(np.array(rows.astype(mx.float32))).any(axis=-1)
            if any(a != e for a, e, n in zip(mx.argmax(rows, axis=-1).tolist(), expected, nan) if not n):
                return f"mx.argmax differs from the reference ({dtype}, V = {V})"
            for lo, hi in ((0, 8), (5, 8), *((r, r + 1) for r in range(8))):
                pieces = argmax_pieces(rows[lo:hi])
                got = read_pieces(pieces)
                if any(p.dtype != mx.uint32 or p.nbytes > 8 for p in pieces):
                    return f"argmax pieces of another dtype or over 8 bytes ({dtype}, V = {V})"
                if got != expected[lo:hi]:
                    return f"argmax of rows {lo}..{hi - 1} differs from the reference ({dtype}, V = {V}): {got}"
    return None
