"""Matrix × up to 8 rows with each row reduced in a fixed order: row-invariant window projections.

`rows_matvec(x, w)` computes x (R, K) @ w (N, K)ᵀ for R <= 8 rows, `rows_qmatvec` the same with
an affine-quantized w (4 or 8 bits, MLX's packing: `mx.quantize`); their column-mapped forms
(`rows_matvec_mapped`, `rows_qmatvec_mapped`) write the columns a map names, in its order, each
the plain kernel's bits, and the GLU forms silu(gate) · up of two matrices. Each output element
is summed in float32 in one fixed order — lane l of a warp takes the 16-byte weight chunks l, l+32, ...
with fused multiply-adds, then the fixed tree of a xor butterfly over the warp — that does not depend on R,
so a row's result is the same bits whether it runs alone (serial decoding) or with seven others
(a window). The weights are read once per window for all its rows (on CUDA with 128-bit
loads), several output columns per warp; x is read as needed (it is small and stays in cache).

One body per kernel for CUDA and Metal (backends.py); on the CPU `reference_*` (pure MLX, the
tests' path too) is what callers use. `kernels_usable()` checks the kernels once against the
reference on the running device and falls back for good when they fail.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from . import rows_mma
from .columns import ColumnLayout, joined, probe_layout, segment_index
from .probe import PROBE_DTYPES, Probe, dims, gpu_kernel
from .rows_mma import reference_glu, rows

MAX_ROWS = rows_mma.MAX_ROWS
MAX_PICKS = rows_mma.MAX_PICKS  # routed-expert picks one call takes (a window's rows x top-k)
WARPS = 4  # warps per block (128 threads): small blocks spread a 512-column matrix over the SMs
COLS = 4  # output columns per warp: each x value loaded feeds COLS columns

# Every body: warp w of block b owns columns (b·WARPS + w)·COLS ... + COLS-1; lane l takes the
# 128-bit chunks u = l, l + 32, ... of each weight row, in that order, each chunk's values in
# order, one float32 fused multiply-add per value and row; then the xor butterfly's tree over the
# 32 lanes (offsets 16 to 1; each step adds the same two operands in both lanes, `_TAIL`). That
# order is a function of K alone: not of R (ROWS), COLS, the grid or the other rows, so a row's
# result is the same bits in a window of 8 as alone. Slot r's accumulators are touched only by
# x row `row[r]`, the r-th of the R rows this block serves.
_ROWS_PLAIN = """
    const int R = dims[0];  // <= ROWS
    int row[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) row[r] = r;
    auto wq = w;
    auto sq = scales;
    auto bq = biases;
"""
# Routed experts: x row m (one pick) goes through expert idx[m]. Block (column block, m) serves
# pick m and the next same-expert picks, ROWS at most, when m opens a run of ROWS picks of its
# expert; so each expert's weights are read once for all the picks that chose it (up to ROWS),
# and a pick's arithmetic never depends on which other picks share its block. The picks are
# staged in shared memory first (one load each, by the whole block): every thread scans them,
# and at 80 picks the scans from global memory cost more than the block's dot products.
_ROWS_GATHER = """
    const int M = dims[0];
    const int m = block_y;
""" + rows_mma.stage_picks("ROWS") + """    int row[ROWS];
    int R = 0;
    for (int i = m; i < M && R < ROWS; ++i)
        if (picks[i] == e) row[R++] = i;
    auto wq = w + static_cast<size_t>(e) * dims[2] * (dims[1] / (32 / BITS));
    auto sq = scales + static_cast<size_t>(e) * dims[2] * (dims[1] / GS);
    auto bq = biases + static_cast<size_t>(e) * dims[2] * (dims[1] / GS);
"""
_HEAD = """
    const int K = dims[1], N = dims[2];
    const int lane = thread_x & 31;
    const int n0 = (block_x * (block_dim >> 5) + (thread_x >> 5)) * COLS;
    if (n0 >= N) return;
    const bool xvec = strata_aligned16(x, static_cast<size_t>(K) * sizeof(T));
    float acc[ROWS][COLS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r)
        #pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
"""
# The tail sums each accumulator over the warp's 32 lanes with the xor butterfly's tree (offsets
# 16, 8, 4, 2, 1, each step lane + partner), so every sum is the butterfly's bits. But where the
# butterfly sums every (row, column) value in every lane (five shuffles each: 160 a warp at 8 rows
# and 4 columns, more than the dot products themselves at K = 512), each step here sends half of
# the values still held and keeps the other half, the partner's share added (a reduce-scatter):
# V values take V - 1 shuffles plus one per step left after one value remains (6 at 1 row, 31 at
# 8). A value of lane l's kept half is summed over the same lanes, in the same order, as the
# butterfly sums it, since both lanes of a step add the same two operands. It carries the
# block's R rows rounded up to a power of two (a block of the 8-row compile serving one pick
# pays for one row); rows past R hold zeros and are never written. After the steps, lane l
# holds values (l >> (5 - STEPS)) · P + p, p < P (P = V / 32 where V > 32, else 1).
def _scatter_tail(write: str) -> str:
    """The tail's body lines: the reduce-scatter of acc's first RV rows for each row count RV
    (1, 2, 4, 8, up to ROWS), then `write` once per value p a lane holds, which sees `v` (the
    sum), `i` (its flat index: row i / COLS, column i % COLS), `r`, `c` and `lead` (whether
    this lane is the first of those holding it)."""
    # the five steps written out, so each step's count of values (h) is a constant before any
    # loop is unrolled: with a loop over the steps, nvcc kept acc in local memory at 8 rows
    steps = "".join(f"""        {{
            constexpr int off = {off}, h = V >> {s + 1};
            const bool upper = (lane & off) != 0;
            if (h == 0) acc[0][0] += strata_xor(acc[0][0], off);
            #pragma unroll
            for (int j = 0; j < h; ++j) {{
                const float lo = acc[j / COLS][j % COLS], hi = acc[(j + h) / COLS][(j + h) % COLS];
                acc[j / COLS][j % COLS] = (upper ? hi : lo) + strata_xor(upper ? lo : hi, off);
            }}
        }}
""" for s, off in enumerate((16, 8, 4, 2, 1)))
    cases = []
    for k in (1, 2, 4, 8):
        cases.append(f"""    if (ROWS >= {k} && RV == {k}) {{
        constexpr int V = (ROWS < {k} ? ROWS : {k}) * COLS;
        constexpr int STEPS = V >= 32 ? 5 : V >= 16 ? 4 : V >= 8 ? 3 : V >= 4 ? 2 : V >= 2 ? 1 : 0;
        constexpr int P = V > 32 ? V / 32 : 1;
{steps}        const bool lead = (lane & ((1 << (5 - STEPS)) - 1)) == 0;
        #pragma unroll
        for (int p = 0; p < P; ++p) {{
            const float v = acc[p / COLS][p % COLS];
            const int i = (lane >> (5 - STEPS)) * P + p, r = i / COLS, c = i % COLS;
{write}
        }}
    }}
""")
    return ("    const int RV = R > 4 ? 8 : R > 2 ? 4 : R > 1 ? 2 : 1;  // rows summed: R up to a power of two\n"
            + "".join(cases))


# A row's output index: row[r] for a runtime r, read without indexing the array by it (which
# would put `row` in local memory).
_OUT_ROW = """            int out_row = row[0];
            #pragma unroll
            for (int q = 1; q < ROWS; ++q) if (q == r) out_row = row[q];
"""
_TAIL = _scatter_tail(_OUT_ROW + """            if (lead && r < R && n0 + c < N) out[static_cast<size_t>(out_row) * N + n0 + c] = static_cast<T>(v);""")
# Dense: a chunk is 16 bytes of one weight row (8 bf16 or 4 float32 values).
DENSE = """
    const int R = dims[0];  // <= ROWS
    int row[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) row[r] = r;
""" + _HEAD + """
    constexpr int CHUNK = 16 / static_cast<int>(sizeof(TW));
    const int KC = K / CHUNK;
    const bool wvec = strata_aligned16(w, static_cast<size_t>(K) * sizeof(TW));
    #pragma unroll (ROWS > 2 ? 1 : 2)
    for (int u = lane; u < KC; u += 32) {
        float wv[COLS][CHUNK];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + c < N ? n0 + c : n0;  // a missing column repeats a real one, unused
            strata_load<TW, CHUNK>(w + static_cast<size_t>(n) * K + u * CHUNK, wvec, wv[c]);
        }
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= R) break;
            float xv[CHUNK];
            strata_load<T, CHUNK>(x + static_cast<size_t>(row[r]) * K + u * CHUNK, xvec, xv);
            #pragma unroll
            for (int j = 0; j < CHUNK; ++j)
                #pragma unroll
                for (int c = 0; c < COLS; ++c) acc[r][c] = fmaf(wv[c][j], xv[j], acc[r][c]);
        }
    }
""" + _TAIL
# Affine-quantized: a chunk is 4 packed words (32 values at 4 bits, 16 at 8), inside one group
# (GS is a multiple of the chunk); value = scale · q + bias, as one fused multiply-add.
_QUANTIZED_BODY = _HEAD + """
    constexpr int VALS = 32 / BITS, CHUNK = 4 * VALS;
    const int KW = K / VALS, KC = K / CHUNK, KG = K / GS;
    const bool wvec = strata_aligned16(wq, static_cast<size_t>(KW) * 4);
    #pragma unroll (ROWS > 2 ? 1 : 2)
    for (int u = lane; u < KC; u += 32) {
        uint4 q[COLS];
        float s[COLS], b[COLS];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + c < N ? n0 + c : n0;
            q[c] = strata_words(wq + static_cast<size_t>(n) * KW + u * 4, wvec);
            const size_t g = static_cast<size_t>(n) * KG + (u * CHUNK) / GS;
            s[c] = static_cast<float>(sq[g]);
            b[c] = static_cast<float>(bq[g]);
        }
        #pragma unroll
        for (int word = 0; word < 4; ++word) {
            float wv[COLS][VALS];
            #pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const unsigned int bits = word == 0 ? q[c].x : word == 1 ? q[c].y : word == 2 ? q[c].z : q[c].w;
                #pragma unroll
                for (int j = 0; j < VALS; ++j) wv[c][j] = fmaf(s[c], strata_quant<BITS>(bits, j), b[c]);
            }
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= R) break;
                float xv[VALS];
                strata_load<T, VALS>(x + static_cast<size_t>(row[r]) * K + u * CHUNK + word * VALS, xvec, xv);
                #pragma unroll
                for (int j = 0; j < VALS; ++j)
                    #pragma unroll
                    for (int c = 0; c < COLS; ++c) acc[r][c] = fmaf(wv[c][j], xv[j], acc[r][c]);
            }
        }
    }
""" + _TAIL
QUANTIZED = _ROWS_PLAIN + _QUANTIZED_BODY
# Affine routed experts whose picks may share x rows: pick m reads x row m / dims[3] (dims[3]
# picks a row: a window's top-k picks all read their token's row, so the caller passes the
# window's rows, not k copies of each). Only where x is read changes, never the arithmetic: a
# pick's bits are those of a call that had its row copied.
_X_ROW = "x + static_cast<size_t>(row[r]) * K"
assert _QUANTIZED_BODY.count(_X_ROW) == 1
GATHER_QUANTIZED = _ROWS_GATHER + """
    int xrow[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) xrow[r] = r < R ? row[r] / dims[3] : 0;
""" + _QUANTIZED_BODY.replace(_X_ROW, "x + static_cast<size_t>(xrow[r]) * K")
# MXFP4 (MLX's "mxfp4" mode, GPT-OSS's experts): groups of 32 e2m1 codes, 8 to a word, low nibble
# first, each group with one uint8 e8m0 scale (2^(s - 127)); a chunk (4 words) is one group.
# Per chunk, column and row, p sums code · x over the group's 32 values in order (fused
# multiply-adds), then acc = fma(p · 2^14, scale, acc): the scale is one multiply per group, not
# per value. A code is decoded as code · 2^-14, exact in float32, by one of three forms (DECODE),
# all giving the same value, so the same bits: 0 (`f16`) moves a nibble pair's sign, 2 exponent
# bits and mantissa bit to the sign, low exponent and top mantissa bits of two fp16 halves and
# converts them (fp16 subnormals are e2m1's too, and the exponent biases, 15 and 1, differ by
# 14: the half is code · 2^-14); 1 (`lut`) reads a 16-entry table in shared memory; 2 (`bits`)
# computes it from the code's fields (the first kernel's arithmetic). The order of operations
# is a function of K alone, as in the affine body.
_E2M1_BITS = ("(0.5f * strata_u2f(((C) & 6u) == 0u ? ((C) & 1u) : (2u + ((C) & 1u)) << ((((C) >> 1) & 3u) - 1u))"
              " * (((C) & 8u) ? -6.103515625e-05f : 6.103515625e-05f))")
_MXFP4_BODY = _HEAD.replace("(block_x *", "(column_block *") + """
    const int KW = K / 8, KC = K / 32;
    const bool wvec = strata_aligned16(wq, static_cast<size_t>(KW) * 4);
    #pragma unroll (ROWS > 2 ? 1 : 2)
    for (int u = lane; u < KC; u += 32) {
        uint4 q[COLS];
        float s[COLS];
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int n = n0 + c < N ? n0 + c : n0;
            q[c] = strata_words(wq + static_cast<size_t>(n) * KW + u * 4, wvec);
            s[c] = strata_e8m0(sq[static_cast<size_t>(n) * KC + u]);
        }
        float p[ROWS][COLS];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r)
            #pragma unroll
            for (int c = 0; c < COLS; ++c) p[r][c] = 0.0f;
        #pragma unroll
        for (int word = 0; word < 4; ++word) {
            float wv[COLS][8];  // code · 2^-14
            #pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const unsigned int bits = word == 0 ? q[c].x : word == 1 ? q[c].y : word == 2 ? q[c].z : q[c].w;
                if (DECODE == 0) {
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) {  // nibbles k and k + 4: magnitude to bits 9-11, sign to 15
                        const unsigned int mag = k < 3 ? bits << (9 - 4 * k) : bits >> 3;
                        const unsigned int h = (mag & 0x0E000E00u) | ((bits << (12 - 4 * k)) & 0x80008000u);
                        wv[c][k] = strata_f16lo(h);
                        wv[c][k + 4] = strata_f16hi(h);
                    }
                } else {
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const unsigned int code = (bits >> (4 * j)) & 15u;
                        wv[c][j] = DECODE == 1 ? e2m1[code] : E2M1_BITS(code);
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= R) break;
                float xv[8];
                strata_load<T, 8>(x + static_cast<size_t>(row[r]) * K + u * 32 + word * 8, xvec, xv);
                #pragma unroll
                for (int j = 0; j < 8; ++j)
                    #pragma unroll
                    for (int c = 0; c < COLS; ++c) p[r][c] = fmaf(wv[c][j], xv[j], p[r][c]);
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= R) break;
            #pragma unroll
            for (int c = 0; c < COLS; ++c) acc[r][c] = fmaf(p[r][c] * 16384.0f, s[c], acc[r][c]);
        }
    }
""" + _TAIL
# The gather prelude with MXFP4's pointers (8 codes a word, one scale per 32, no biases), the
# `lut` form's table, filled before the block's barrier, and the grid's order (PICKS_X): 1 puts
# the picks on the grid's fast axis, so the blocks of every pick of one column block are
# launched together, and picks of one expert read its rows from L2 instead of memory again; 0
# puts the column blocks there (all of pick 0's blocks, then pick 1's, ...), as the affine kernel.
_ROWS_GATHER_FP4 = (_ROWS_GATHER.replace("(32 / BITS)", "8").replace("(dims[1] / GS)", "(dims[1] / 32)")
                    .replace("    const int m = block_y;\n", "    const int m = PICKS_X ? block_x : block_y;\n"
                             "    const int column_block = PICKS_X ? block_y : block_x;\n")
                    .replace("    auto bq = biases + static_cast<size_t>(e) * dims[2] * (dims[1] / 32);\n", "")
                    .replace("    strata_sync();\n", "    STRATA_SHARED float e2m1[16];\n"
                             "    if (DECODE == 1 && thread_x < 16) e2m1[thread_x] = E2M1_BITS(static_cast<unsigned int>(thread_x));\n"
                             "    strata_sync();\n", 1))
GATHER_MXFP4 = _ROWS_GATHER_FP4 + _MXFP4_BODY
MXFP4_DECODES = {"f16": 0, "lut": 1, "bits": 2}
MXFP4_ORDERS = {"picks": 1, "columns": 0}  # the grid's fast axis: PICKS_X
MXFP4_HEADER = f"#define E2M1_BITS(C) {_E2M1_BITS}\n"

# GLU forms: one launch computes, for its columns n, gate_n·x and up_n·x of two
# matrices of one form and writes act(gate) · up. A warp's COLS accumulators hold HALF = COLS / 2
# columns of each: accumulator c < HALF sums gate row n0 + c, accumulator HALF + c up row n0 + c,
# each with the very loads, fused multiply-adds and butterfly of the plain body (the order is
# still a function of K alone), so each sum is the plain kernel's float32 value bit for bit. Lane
# c then rounds both sums to T, as the plain kernels' outputs are, and writes
# T(STRATA_GLU(gate, up)): silu(gate) · up in float32, rounded once (today's compiled `swiglu`
# rounds its sigmoid, product and result to T on their own; MLX's sigmoid differs by backend).
# Output columns a warp (HALF), read at each call: it moves no sum, so scripts/lab/glu_unroll.py
# times others; 2 holds as many accumulators as the plain forms.
GLU_COLS = 2
GLU_HEADER = rows_mma.GLU_HEADER
# Each gate sum and its up sum (flat indices i and i + HALF) end in lanes PAIR apart: one more
# shuffle gives a lane both.
_GLU_TAIL = _scatter_tail(_OUT_ROW + """            const float other = strata_xor(v, (HALF << (5 - STEPS)) / P);
            if (lead && c < HALF && r < R && n0 + c < N) {
                const float gate = static_cast<float>(static_cast<T>(v)), up = static_cast<float>(static_cast<T>(other));
                out[static_cast<size_t>(out_row) * N + n0 + c] = static_cast<T>(STRATA_GLU(gate, up));
            }""")


def _glu(body: str, swaps: dict[str, str]) -> str:
    """The GLU form of a plain body: HALF columns a warp, accumulator c's row from the gate's
    arrays below HALF and from the up's (`<name>_up`) above, `swaps` (each text once) saying how
    the body reads them; the plain tail replaced by the GLU's."""
    assert body.endswith(_TAIL)
    body = body[: -len(_TAIL)] + _GLU_TAIL
    swaps = {"(thread_x >> 5)) * COLS;": "(thread_x >> 5)) * HALF;",
             "const int n = n0 + c < N ? n0 + c : n0;": "const int n = n0 + c % HALF < N ? n0 + c % HALF : n0;",
             **swaps}
    for old, new in swaps.items():
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return "    constexpr int HALF = COLS / 2;\n" + body


_QUANTIZED_GLU_SWAPS = {
    "strata_aligned16(wq, static_cast<size_t>(KW) * 4)":
        "strata_aligned16(wq, static_cast<size_t>(KW) * 4) && strata_aligned16(wq_up, static_cast<size_t>(KW) * 4)",
    "strata_words(wq + ": "strata_words((c < HALF ? wq : wq_up) + ",
    "static_cast<float>(sq[g])": "static_cast<float>((c < HALF ? sq : sq_up)[g])",
    "static_cast<float>(bq[g])": "static_cast<float>((c < HALF ? bq : bq_up)[g])",
}
DENSE_GLU = _glu(DENSE, {
    "strata_aligned16(w, static_cast<size_t>(K) * sizeof(TW))":
        "strata_aligned16(w, static_cast<size_t>(K) * sizeof(TW)) && strata_aligned16(w_up, static_cast<size_t>(K) * sizeof(TW))",
    "strata_load<TW, CHUNK>(w + ": "strata_load<TW, CHUNK>((c < HALF ? w : w_up) + ",
})
# The up's arrays beside the gate's: as they stand (plain rows), or at expert e (routed experts).
_PLAIN_POINTERS = "    auto bq = biases;\n"
_GATHER_POINTERS = "    auto bq = biases + static_cast<size_t>(e) * dims[2] * (dims[1] / GS);\n"
_GATHER_UP_POINTERS = """    auto wq_up = w_up + static_cast<size_t>(e) * dims[2] * (dims[1] / (32 / BITS));
    auto sq_up = scales_up + static_cast<size_t>(e) * dims[2] * (dims[1] / GS);
    auto bq_up = biases_up + static_cast<size_t>(e) * dims[2] * (dims[1] / GS);
"""
assert QUANTIZED.count(_PLAIN_POINTERS) == GATHER_QUANTIZED.count(_GATHER_POINTERS) == 1
QUANTIZED_GLU = _glu(QUANTIZED.replace(_PLAIN_POINTERS, _PLAIN_POINTERS + "    auto wq_up = w_up;\n"
                                       "    auto sq_up = scales_up;\n    auto bq_up = biases_up;\n"),
                     _QUANTIZED_GLU_SWAPS)
# The routed GLU's lane loop unrolls UNROLL iterations at ROWS <= 2 (a template value, the
# process's: when loads are issued, never the sum). At the 80B shape (K 2,048: two iterations a
# lane) nvcc gives 2 (all loads first) 128 registers a thread, 4 blocks an SM, and 4 (no
# unrolling there) 64: twice the warps. scripts/lab/glu_unroll.py on the H100 at 22ead51, the
# 80B shape's 10 picks a row, medians of 3 rounds: 4 0.029 / 0.093 ms at 1 / 8 rows against 2's
# 0.036 / 0.105 and 1's 0.038 / 0.106, faster in every round, every setting the same bits.
GLU_UNROLL = 4
GATHER_QUANTIZED_GLU = _glu(GATHER_QUANTIZED.replace(_GATHER_POINTERS, _GATHER_POINTERS + _GATHER_UP_POINTERS),
                            {**_QUANTIZED_GLU_SWAPS,
                             "#pragma unroll (ROWS > 2 ? 1 : 2)": "#pragma unroll (ROWS > 2 ? 1 : UNROLL)"})

# Column-mapped forms: output column j is computed from weight row col_map[j] (for quantized
# weights its scales' and biases' rows too), so one launch writes a projection's columns in the
# order its consumers read them (GDN's [conv inputs | z | b | a] from the stacked [qkvz | ba]),
# with no gather after it, each of its parts contiguous (columns.py says where a column lands).
# Only which weight row a column reads and where its value lands change, never the arithmetic:
# out's segment rows are the plain kernel's out[r, col_map[j]] bit for bit. The weight rows are
# read once per thread, before the reduction; N is the map's column count.
_PLAIN_ROW = "const int n = n0 + c < N ? n0 + c : n0;"
_MAPPED_ROWS = """    int mapped[COLS];  // the weight row of output column n0 + c (a missing column repeats a real one's)
    #pragma unroll
    for (int c = 0; c < COLS; ++c) mapped[c] = static_cast<int>(col_map[n0 + c < N ? n0 + c : n0]);
"""
_EARLY_EXIT = "    if (n0 >= N) return;\n"
_PLAIN_OUT = "out[static_cast<size_t>(out_row) * N + n0 + c]"
_SEGMENT_OUT = f"out[{segment_index('out_row', 'n0 + c')}]"


def _mapped(body: str) -> str:
    """The column-mapped form of a plain body (see above)."""
    assert body.count(_PLAIN_ROW) == body.count(_EARLY_EXIT) == 1 and _PLAIN_OUT in body  # one write a row count
    return (body.replace(_EARLY_EXIT, _EARLY_EXIT + _MAPPED_ROWS).replace(_PLAIN_ROW, "const int n = mapped[c];")
            .replace(_PLAIN_OUT, _SEGMENT_OUT))


DENSE_MAPPED = _mapped(DENSE)
QUANTIZED_MAPPED = _mapped(QUANTIZED)

_probe = Probe("row-invariant matrix kernels", "decode windows run row by row")
_glu_probe = Probe("row-invariant GLU kernels", "decode windows run gate, up and the activation apart")
_mapped_probe = Probe("row-invariant column-mapped matrix kernels",
                      "decode windows gather the plain kernels' columns")


def launch_config(rows: int, N: int, *, cols: int = COLS) -> dict:
    """Grid, block and template values of one call: `rows` rows into N columns.

    ROWS, the row capacity compiled in, is the next of 1, 2, 4, 8 (the 1-row call of serial
    decoding carries no unused accumulators; four compiles per dtype and kind cover every
    window); the row count, K and N travel as data (`dims`), so every weight shape of a model
    shares those compiles.
    """
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows_matvec takes 1..{MAX_ROWS} rows, got {rows}")
    blocks = -(-N // (WARPS * cols))
    return {"grid": (blocks * WARPS * 32, 1, 1), "threadgroup": (WARPS * 32, 1, 1),
            "template": [("ROWS", row_capacity(rows)), ("COLS", cols)]}


def row_capacity(rows: int) -> int:
    """The compiled row count that serves `rows`: 1, 2, 4 or 8."""
    return 1 << (rows - 1).bit_length()


HEADER = rows_mma.PICKS_HEADER


def _kernel(name: str, inputs: list[str], body: str, extra: str = ""):
    return gpu_kernel(name, inputs, ["out"], body, HEADER + extra)


def _launch(kernel, inputs, template, lead: tuple[int, ...], rows: int, N: int, dtype, cols: int):
    config = launch_config(rows, N, cols=cols)
    (out,) = kernel(inputs=inputs, template=template + config["template"], grid=config["grid"],
                    threadgroup=config["threadgroup"], output_shapes=[(*lead, N)], output_dtypes=[dtype])
    return out


def rows_matvec(x: mx.array, w: mx.array, *, cols: int = COLS, tensor_cores: bool = True) -> mx.array:
    """x (..., K) @ w (N, K)ᵀ -> (..., N) in x's dtype, at most 8 rows, on a GPU (`cols`:
    columns per warp). `tensor_cores`: bfloat16 rows and weights go to rows_mma's form where its
    probe passed (each process one form per dtype, so a row's bits never depend on the window)."""
    R, K = rows(x)
    if tensor_cores and w.dtype == mx.bfloat16 and rows_mma.supports(x, K, form="dense"):
        return rows_mma.rows_matvec(x, w)
    N = w.shape[0]
    kernel = _kernel("strata_rows_matvec_v4", ["dims", "x", "w"], DENSE)
    template = [("T", x.dtype), ("TW", w.dtype)]
    return _launch(kernel, [dims(R, K, N), x, w], template, x.shape[:-1], R, N, x.dtype, cols)


def rows_qmatvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                 bits: int, cols: int = COLS, tensor_cores: bool = True) -> mx.array:
    """x (..., K) @ dequantized w (N, K·bits/32 packed)ᵀ -> (..., N), at most 8 rows, affine 4 or 8
    bits, on a GPU (`tensor_cores` as `rows_matvec`'s)."""
    R, K = rows(x)
    if tensor_cores and rows_mma.supports(x, K, group_size=group_size, bits=bits, form="affine"):
        return rows_mma.rows_qmatvec(x, w, scales, biases, group_size=group_size, bits=bits)
    N = w.shape[0]
    kernel = _kernel("strata_rows_qmatvec_v4", ["dims", "x", "w", "scales", "biases"], QUANTIZED)
    # Every input dtype is a template value: MLX names (and caches) a compile by these alone.
    template = [("T", x.dtype), ("TS", scales.dtype), ("BITS", bits), ("GS", group_size)]
    return _launch(kernel, [dims(R, K, N), x, w, scales, biases], template, x.shape[:-1], R, N, x.dtype, cols)


def _mapped_launch(kernel, inputs, template, x: mx.array, R: int, layout: ColumnLayout, cols: int) -> mx.array:
    config = launch_config(R, layout.N, cols=cols)
    (out,) = kernel(inputs=inputs, template=template + config["template"], grid=config["grid"],
                    threadgroup=config["threadgroup"], output_shapes=[(R * layout.N,)], output_dtypes=[x.dtype])
    return out


def rows_matvec_mapped(x: mx.array, w: mx.array, layout: ColumnLayout, *, cols: int = COLS,
                       tensor_cores: bool = True) -> list[mx.array]:
    """`mx.split(rows_matvec(x, w)[..., columns], bounds, -1)` in one launch (`layout`: the
    columns and the split): output column j computed from weight row columns[j] (each < w's rows),
    the same bits as the plain kernel's column, each segment contiguous (`tensor_cores`: rows_mma's
    form, as `rows_matvec`'s)."""
    R, K = rows(x)
    if tensor_cores and w.dtype == mx.bfloat16 and rows_mma.supports(x, K, form="mapped"):
        return layout.parts(rows_mma.rows_matvec_mapped(x, w, layout), x.shape[:-1])
    kernel = _kernel("strata_rows_matvec_mapped_v3", ["dims", "x", "w", "col_map"], DENSE_MAPPED)
    template = [("T", x.dtype), ("TW", w.dtype)]
    out = _mapped_launch(kernel, [dims(R, K, layout.N), x, w, layout.data], template, x, R, layout, cols)
    return layout.parts(out, x.shape[:-1])


def rows_qmatvec_mapped(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, layout: ColumnLayout, *,
                        group_size: int, bits: int, cols: int = COLS, tensor_cores: bool = True) -> list[mx.array]:
    """`rows_qmatvec`'s columns in one launch, as `rows_matvec_mapped` (each column's scales and
    biases from its weight row's)."""
    R, K = rows(x)
    if tensor_cores and rows_mma.supports(x, K, group_size=group_size, bits=bits, form="mapped"):
        out = rows_mma.rows_qmatvec_mapped(x, w, scales, biases, layout, group_size=group_size, bits=bits)
        return layout.parts(out, x.shape[:-1])
    kernel = _kernel("strata_rows_qmatvec_mapped_v3", ["dims", "x", "w", "scales", "biases", "col_map"],
                     QUANTIZED_MAPPED)
    template = [("T", x.dtype), ("TS", scales.dtype), ("BITS", bits), ("GS", group_size)]
    out = _mapped_launch(kernel, [dims(R, K, layout.N), x, w, scales, biases, layout.data], template, x, R, layout,
                         cols)
    return layout.parts(out, x.shape[:-1])


def rows_gather_qmatvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, experts: mx.array, *,
                        group_size: int, bits: int, share: int | None = None, cols: int = COLS,
                        tensor_cores: bool = True) -> mx.array:
    """Routed experts: x (..., K) of M rows, experts (M,) -> (..., N), row m times dequantized w[experts[m]]ᵀ,
    w (E, N, K·bits/32 packed), affine 4 or 8 bits, on a GPU. Picks that share rows: x of R rows
    and experts (M,) with M = k·R, k > 1 -> (..., k, N), pick m times x row m // k (a window's
    top-k, without k copies of each row; the same bits as the copied rows). Each expert is read once for up to
    `share` picks of it (1, 2, 4 or 8); a pick's result is the same bits whatever the other picks
    are and whatever `share` is. The default, 1, gives every pick its own blocks: at T = 8 on the
    80B shape (80 picks, ~76 experts) it runs the gate and down projections in 0.060 and 0.086 ms
    against 0.090 and 0.177 with the 8-pick compile (docs/benchmarks.md, kernel_bench); an expert
    picked twice is read twice, the second time mostly from L2. `tensor_cores` as `rows_matvec`'s."""
    if tensor_cores and rows_mma.supports(x, x.shape[-1], group_size=group_size, bits=bits, form="routed"):
        return rows_mma.rows_gather_qmatvec(x, w, scales, biases, experts, group_size=group_size, bits=bits,
                                            share=share)
    R, K = rows(x)
    M = experts.size
    if M > MAX_PICKS or M % R:
        raise ValueError(f"rows_gather_qmatvec takes at most {MAX_PICKS} picks, a multiple of its {R} rows; got {M}")
    N, per = w.shape[1], M // R
    kernel = _kernel("strata_rows_gather_qmatvec_v4", ["dims", "x", "w", "scales", "biases", "idx"],
                     GATHER_QUANTIZED)
    config = launch_config(share or 1, N, cols=cols)
    template = [("T", x.dtype), ("TS", scales.dtype), ("TI", experts.dtype), ("BITS", bits), ("GS", group_size)]
    shape = (*x.shape[:-1], N) if per == 1 else (*x.shape[:-1], per, N)
    (out,) = kernel(inputs=[dims(M, K, N, per), x, w, scales, biases, experts], template=template + config["template"],
                    grid=(config["grid"][0], M, 1), threadgroup=config["threadgroup"], output_shapes=[shape],
                    output_dtypes=[x.dtype])
    return out


def glu_launch_config(rows: int, N: int, *, cols: int | None = None) -> dict:
    """`launch_config` of a GLU form: `cols` output columns a warp (None: GLU_COLS as the module
    holds it at the call), two accumulators each (COLS)."""
    cols = cols or GLU_COLS
    config = launch_config(rows, N, cols=cols)
    return {**config, "template": [("ROWS", row_capacity(rows)), ("COLS", 2 * cols)]}


def _glu_launch(kernel, inputs, template, shape: tuple[int, ...], rows: int, N: int, dtype, cols: int | None, *,
                grid_y: int = 1):
    config = glu_launch_config(rows, N, cols=cols)
    (out,) = kernel(inputs=inputs, template=template + config["template"], grid=(config["grid"][0], grid_y, 1),
                    threadgroup=config["threadgroup"], output_shapes=[shape], output_dtypes=[dtype])
    return out


def rows_glu_matvec(x: mx.array, w_gate: mx.array, w_up: mx.array, *, cols: int | None = None) -> mx.array:
    """silu(x @ w_gateᵀ) · (x @ w_upᵀ), w_gate and w_up (N, K) of one dtype, -> (..., N) in x's
    dtype, at most 8 rows, on a GPU, in one launch: each product the bits of `rows_matvec`'s,
    joined as GLU_HEADER says."""
    R, K = rows(x)
    N = w_gate.shape[0]
    kernel = _kernel("strata_rows_glu_matvec_v2", ["dims", "x", "w", "w_up"], DENSE_GLU, GLU_HEADER)
    template = [("T", x.dtype), ("TW", w_gate.dtype)]
    return _glu_launch(kernel, [dims(R, K, N), x, w_gate, w_up], template, (*x.shape[:-1], N), R, N, x.dtype, cols)


def rows_glu_qmatvec(x: mx.array, gate: tuple[mx.array, mx.array, mx.array], up: tuple[mx.array, mx.array, mx.array],
                     *, group_size: int, bits: int, cols: int | None = None, tensor_cores: bool = True) -> mx.array:
    """`rows_glu_matvec` over affine-quantized gate and up, each (weight, scales, biases) of
    one quantization: each product the bits of `rows_qmatvec`'s (`tensor_cores`: rows_mma's
    form, as `rows_matvec`'s)."""
    if tensor_cores and rows_mma.supports(x, x.shape[-1], group_size=group_size, bits=bits, form="plain-glu"):
        return rows_mma.rows_glu_qmatvec(x, gate, up, group_size=group_size, bits=bits)
    R, K = rows(x)
    N = gate[0].shape[0]
    kernel = _kernel("strata_rows_glu_qmatvec_v2", ["dims", "x", "w", "scales", "biases", "w_up", "scales_up",
                                                    "biases_up"], QUANTIZED_GLU, GLU_HEADER)
    template = [("T", x.dtype), ("TS", gate[1].dtype), ("BITS", bits), ("GS", group_size)]
    return _glu_launch(kernel, [dims(R, K, N), x, *gate, *up], template, (*x.shape[:-1], N), R, N, x.dtype, cols)


def rows_gather_glu_qmatvec(x: mx.array, gate: tuple[mx.array, mx.array, mx.array],
                            up: tuple[mx.array, mx.array, mx.array], experts: mx.array, *, group_size: int, bits: int,
                            share: int | None = None, cols: int | None = None,
                            tensor_cores: bool = True) -> mx.array:
    """`rows_gather_qmatvec`'s routed experts, gate and up (each (weight (E, N, K·bits/32),
    scales, biases) of one quantization) in one launch: -> silu(gate) · up, each product the
    bits of `rows_gather_qmatvec`'s, picks that share rows as there (`tensor_cores`: rows_mma's
    form, as `rows_matvec`'s)."""
    if tensor_cores and rows_mma.supports(x, x.shape[-1], group_size=group_size, bits=bits, form="glu"):
        return rows_mma.rows_gather_glu_qmatvec(x, gate, up, experts, group_size=group_size, bits=bits, share=share)
    R, K = rows(x)
    M = experts.size
    if M > MAX_PICKS or M % R:
        raise ValueError(f"rows_gather_glu_qmatvec takes at most {MAX_PICKS} picks, a multiple of its {R} rows; got {M}")
    N, per = gate[0].shape[1], M // R
    kernel = _kernel("strata_rows_gather_glu_qmatvec_v2", ["dims", "x", "w", "scales", "biases", "w_up", "scales_up",
                                                           "biases_up", "idx"], GATHER_QUANTIZED_GLU, GLU_HEADER)
    template = [("T", x.dtype), ("TS", gate[1].dtype), ("TI", experts.dtype), ("BITS", bits), ("GS", group_size),
                ("UNROLL", GLU_UNROLL)]
    shape = (*x.shape[:-1], N) if per == 1 else (*x.shape[:-1], per, N)
    return _glu_launch(kernel, [dims(M, K, N, per), x, *gate, *up, experts], template, shape, share or 1, N, x.dtype,
                       cols, grid_y=M)


def rows_gather_mxfp4matvec(x: mx.array, w: mx.array, scales: mx.array, experts: mx.array, *,
                            share: int | None = None, cols: int = COLS, decode: str = "f16",
                            order: str = "picks", tensor_cores: bool = False) -> mx.array:
    """`rows_gather_qmatvec` for MXFP4 experts (MLX's "mxfp4" mode: w (E, N, K/8) uint32, scales
    (E, N, K/32) uint8): one call for a window's picks; a pick's bits never depend on the other
    picks, on their count, on `share` (1, 2, 4 or 8 picks of one expert per block; the default,
    1, gives each pick its own blocks), on `cols`, on `decode` (how a code becomes a float:
    `MXFP4_DECODES`; all give the same value) or on `order` (the grid's fast axis: "picks" or
    "columns"; which blocks run side by side, so which share an expert's rows in L2). (MLX
    0.32's CUDA gather_qmm sends fewer than 8 picks to its gather_qmv and 8 or more to a tiled
    GEMM: a decode window's rows would not keep their serial arithmetic, and a GEMM tile per
    one-row pick is slow.) `tensor_cores`: rows_mma's form, off by default: decoding e2m1 codes
    to bfloat16 one value at a time made it 2.2x slower than this kernel's fp16-pair decode at one
    row on the H200 (docs/benchmarks.md, "Window projections on tensor cores")."""
    M, K = rows(x)
    if tensor_cores and rows_mma.supports(x, K):
        return rows_mma.rows_gather_mxfp4matvec(x, w, scales, experts, share=share, picks_x=order == "picks")
    if M > MAX_PICKS:
        raise ValueError(f"rows_gather_mxfp4matvec takes at most {MAX_PICKS} picks, got {M}")
    if decode not in MXFP4_DECODES:
        raise ValueError(f"decode is one of {', '.join(MXFP4_DECODES)}, got {decode!r}")
    if order not in MXFP4_ORDERS:
        raise ValueError(f"order is one of {', '.join(MXFP4_ORDERS)}, got {order!r}")
    N = w.shape[1]
    kernel = _kernel("strata_rows_gather_mxfp4matvec_v3", ["dims", "x", "w", "scales", "idx"], GATHER_MXFP4,
                     MXFP4_HEADER)
    config = launch_config(share or 1, N, cols=cols)
    picks_x = MXFP4_ORDERS[order]
    template = [("T", x.dtype), ("TI", experts.dtype), ("DECODE", MXFP4_DECODES[decode]), ("PICKS_X", picks_x)]
    threads = config["threadgroup"][0]
    grid = (M * threads, config["grid"][0] // threads, 1) if picks_x else (config["grid"][0], M, 1)
    (out,) = kernel(inputs=[dims(M, K, N), x, w, scales, experts], template=template + config["template"],
                    grid=grid, threadgroup=config["threadgroup"], output_shapes=[(*x.shape[:-1], N)],
                    output_dtypes=[x.dtype])
    return out


def reference_gather_mxfp4matvec(x, w, scales, experts) -> mx.array:
    """What `rows_gather_mxfp4matvec` computes, in plain MLX."""
    dense = mx.dequantize(w[experts], scales[experts], group_size=32, bits=4, mode="mxfp4",
                          dtype=mx.float32)  # (M, N, K)
    return (dense @ x.astype(mx.float32)[:, :, None])[..., 0].astype(x.dtype)


def reference_gather_qmatvec(x, w, scales, biases, experts, *, group_size: int, bits: int) -> mx.array:
    """What `rows_gather_qmatvec` computes, in plain MLX."""
    dense = mx.dequantize(w[experts], scales[experts], biases[experts], group_size=group_size,
                          bits=bits).astype(mx.float32)  # (M, N, K)
    return (dense @ x.astype(mx.float32)[:, :, None])[..., 0].astype(x.dtype)


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


def kernels_usable(dtype=None) -> bool:
    """True on a GPU (CUDA, Metal) once the kernels matched the reference and were row-invariant
    on a probe at `dtype` (None: float32 and bfloat16; checked once per process, or kept from an
    earlier one: probe.Probe); False elsewhere or after any failure (logged once)."""
    return _probe.usable(_check, dtype)


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def glu_usable(dtype=None) -> bool:
    """`kernels_usable` for the GLU forms (`rows_glu_matvec`, `rows_glu_qmatvec`,
    `rows_gather_glu_qmatvec`): their own probe, so a failure turns off only them."""
    return _glu_probe.usable(_check_glu, dtype)


def glu_status() -> dict:
    return _glu_probe.status()


def mapped_usable(dtype=None) -> bool:
    """`kernels_usable` for the column-mapped forms (`rows_matvec_mapped`, `rows_qmatvec_mapped`):
    their own probe, so a failure turns off only them (callers then gather the plain kernels'
    columns)."""
    return _mapped_probe.usable(_check_mapped, dtype)


def mapped_status() -> dict:
    return _mapped_probe.status()


def near_reference(got: mx.array, expected: mx.array, dtype) -> bool:
    """Whether a probe's kernel output is within its dtype's tolerance of the reference (which
    may run at TF32 on a GPU): 5e-3 in float32, 3e-2 in bfloat16, relative and absolute."""
    tol = 5e-3 if dtype == mx.float32 else 3e-2
    return mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), rtol=tol, atol=tol).item()


def _check(dtypes=PROBE_DTYPES) -> str | None:
    """None when the kernels pass on this device, else what failed."""
    key = mx.random.key(7)
    K, N = 512, 200
    for dtype in dtypes:
        x = mx.random.normal((MAX_ROWS, K), key=key).astype(dtype)
        w = (mx.random.normal((N, K), key=mx.random.key(8)) * K**-0.5).astype(dtype)
        qw, qs, qb = mx.quantize(w, 64, 4)
        cases = (
            (lambda a: rows_matvec(a, w, tensor_cores=False), lambda a: reference_matvec(a, w)),
            (lambda a: rows_qmatvec(a, qw, qs, qb, group_size=64, bits=4, tensor_cores=False),
             lambda a: reference_qmatvec(a, qw, qs, qb, group_size=64, bits=4)),
        )
        for kernel, reference in cases:
            together = kernel(x)
            alone = mx.concatenate([kernel(x[i : i + 1]) for i in range(MAX_ROWS)])
            expected = reference(x)
            partial = [kernel(x[:T]) for T in (2, 3)]  # the 2- and 4-row compiles, rows left unused
            mx.eval(together, alone, expected, partial)
            if not all(mx.array_equal(y, alone[: y.shape[0]]).item() for y in [together, *partial]):
                return f"rows differ with the row count ({dtype})"
            if not near_reference(together, expected, dtype):
                return f"kernel and reference disagree ({dtype})"
        error = _check_gather(dtype) or _check_gather_mxfp4(dtype)
        if error:
            return error
    return None


def _check_gather(dtype) -> str | None:
    # 12 picks of 6 experts, expert 3 picked 9 times: more than one block's MAX_ROWS.
    K, N = 512, 200
    experts = mx.array([3, 1, 3, 0, 3, 5, 1, 3, 3, 3, 3, 3], dtype=mx.uint32)
    M = experts.shape[0]
    x = mx.random.normal((M, K), key=mx.random.key(9)).astype(dtype)
    w = (mx.random.normal((6, N, K), key=mx.random.key(10)) * K**-0.5).astype(dtype)
    qw, qs, qb = mx.quantize(w, 64, 4)
    kernel = partial(rows_gather_qmatvec, w=qw, scales=qs, biases=qb, group_size=64, bits=4, tensor_cores=False)
    error = _picks_alone(kernel, partial(reference_gather_qmatvec, w=qw, scales=qs, biases=qb, group_size=64, bits=4),
                         x, experts, dtype, "routed-expert", share=MAX_ROWS)
    # Picks sharing rows (3 picks a row) read their row: the bits of the rows copied.
    shared, copied = kernel(x=x[::3], experts=experts), kernel(x=mx.repeat(x[::3], 3, axis=0), experts=experts)
    if error is None and not mx.array_equal(shared.reshape(copied.shape), copied).item():
        error = f"routed-expert picks sharing rows differ from copied rows ({dtype})"
    return error


def _check_gather_mxfp4(dtype) -> str | None:
    K, N = 512, 200
    experts = mx.array([3, 1, 3, 0, 3, 5, 1, 3, 3], dtype=mx.uint32)
    M = experts.shape[0]
    x = mx.random.normal((M, K), key=mx.random.key(11)).astype(dtype)
    w = (mx.random.normal((6, N, K), key=mx.random.key(12)) * K**-0.5).astype(dtype)
    qw, qs = mx.quantize(w, 32, 4, mode="mxfp4")
    return _picks_alone(partial(rows_gather_mxfp4matvec, w=qw, scales=qs, tensor_cores=False),
                        partial(reference_gather_mxfp4matvec, w=qw, scales=qs), x, experts, dtype, "MXFP4 routed-expert")


def _picks_alone(kernel, reference, x, experts, dtype, what: str, **together_kw) -> str | None:
    """None when a call's picks equal their one-pick calls bit for bit and the reference within
    tolerance, else what failed."""
    together = kernel(x=x, experts=experts, **together_kw)
    alone = mx.concatenate([kernel(x=x[m : m + 1], experts=experts[m : m + 1]) for m in range(experts.shape[0])])
    expected = reference(x=x, experts=experts)
    mx.eval(together, alone, expected)
    if not mx.array_equal(together, alone).item():
        return f"{what} picks differ with the other picks ({dtype})"
    if not near_reference(together, expected, dtype):
        return f"{what} kernel and reference disagree ({dtype})"
    return None


def _check_glu(dtypes=PROBE_DTYPES) -> str | None:
    """None when the GLU forms pass on this device, else what failed: each row (pick) equals its
    1-row call bit for bit, and silu(gate) · up of the reference's products within tolerance."""
    K, N = 512, 200
    for dtype in dtypes:
        x = mx.random.normal((MAX_ROWS, K), key=mx.random.key(13)).astype(dtype)
        wg, wu = ((mx.random.normal((N, K), key=mx.random.key(s)) * K**-0.5).astype(dtype) for s in (14, 15))
        qg, qu = mx.quantize(wg, 64, 4), mx.quantize(wu, 64, 4)
        quantized = partial(reference_qmatvec, group_size=64, bits=4)
        cases = (
            (lambda a: rows_glu_matvec(a, wg, wu), lambda a: reference_glu(reference_matvec(a, wg), reference_matvec(a, wu))),
            (lambda a: rows_glu_qmatvec(a, qg, qu, group_size=64, bits=4, tensor_cores=False),
             lambda a: reference_glu(quantized(a, *qg), quantized(a, *qu))),
        )
        for kernel, reference in cases:
            together = kernel(x)
            alone = mx.concatenate([kernel(x[i : i + 1]) for i in range(MAX_ROWS)])
            expected = reference(x)
            partial_rows = [kernel(x[:T]) for T in (2, 3)]
            mx.eval(together, alone, expected, partial_rows)
            if not all(mx.array_equal(y, alone[: y.shape[0]]).item() for y in [together, *partial_rows]):
                return f"GLU rows differ with the row count ({dtype})"
            if not near_reference(together, expected, dtype):
                return f"GLU kernel and reference disagree ({dtype})"
        error = _check_gather_glu(dtype)
        if error:
            return error
    return None


def _check_gather_glu(dtype) -> str | None:
    K, N = 512, 200
    experts = mx.array([3, 1, 3, 0, 3, 5, 1, 3, 3, 3, 3, 3], dtype=mx.uint32)
    x = mx.random.normal((experts.shape[0], K), key=mx.random.key(16)).astype(dtype)
    gate, up = (mx.quantize((mx.random.normal((6, N, K), key=mx.random.key(s)) * K**-0.5).astype(dtype), 64, 4)
                for s in (17, 18))
    kernel = partial(rows_gather_glu_qmatvec, gate=gate, up=up, group_size=64, bits=4, tensor_cores=False)

    def reference(x, experts):
        return reference_glu(*(reference_gather_qmatvec(x, *p, experts, group_size=64, bits=4) for p in (gate, up)))

    error = _picks_alone(kernel, reference, x, experts, dtype, "routed-expert GLU", share=MAX_ROWS)
    shared, copied = kernel(x=x[::3], experts=experts), kernel(x=mx.repeat(x[::3], 3, axis=0), experts=experts)
    if error is None and not mx.array_equal(shared.reshape(copied.shape), copied).item():
        error = f"routed-expert GLU picks sharing rows differ from copied rows ({dtype})"
    return error


def _check_mapped(dtypes=PROBE_DTYPES) -> str | None:
    """None when the column-mapped forms pass on this device, else what failed: each row equals
    its 1-row call bit for bit, the call (its segments side by side) equals the plain kernel's
    output gathered by the map bit for bit, and the reference's gathered columns within tolerance
    (so a probe that asks before the plain kernels' own never passes on their word alone)."""
    K, N = 512, 200
    layout = probe_layout(N)
    columns = layout.columns
    for dtype in dtypes:
        x = mx.random.normal((MAX_ROWS, K), key=mx.random.key(19)).astype(dtype)
        w = (mx.random.normal((N, K), key=mx.random.key(20)) * K**-0.5).astype(dtype)
        qw, qs, qb = mx.quantize(w, 64, 4)
        cases = (
            (lambda a: joined(rows_matvec_mapped(a, w, layout, tensor_cores=False)),
             lambda a: rows_matvec(a, w, tensor_cores=False), lambda a: reference_matvec(a, w)),
            (lambda a: joined(rows_qmatvec_mapped(a, qw, qs, qb, layout, group_size=64, bits=4, tensor_cores=False)),
             lambda a: rows_qmatvec(a, qw, qs, qb, group_size=64, bits=4, tensor_cores=False),
             lambda a: reference_qmatvec(a, qw, qs, qb, group_size=64, bits=4)),
        )
        for kernel, plain, reference in cases:
            together = kernel(x)
            alone = mx.concatenate([kernel(x[i : i + 1]) for i in range(MAX_ROWS)])
            partial_rows = [kernel(x[:T]) for T in (2, 3)]
            gathered = mx.take(plain(x), columns, axis=-1)
            expected = mx.take(reference(x), columns, axis=-1)
            mx.eval(together, alone, partial_rows, gathered, expected)
            if not all(mx.array_equal(y, alone[: y.shape[0]]).item() for y in [together, *partial_rows]):
                return f"column-mapped rows differ with the row count ({dtype})"
            if not mx.array_equal(together, gathered).item():
                return f"column-mapped kernel and the plain kernel's gathered columns differ ({dtype})"
            if not near_reference(together, expected, dtype):
                return f"column-mapped kernel and reference disagree ({dtype})"
    return None
