"""Window projections on tensor cores (CUDA, bfloat16): every call carries 8 rows, so a row's
arithmetic is the same whether it runs alone or in a window of 8.

The forms of rows_matvec.py (affine 4/8-bit and dense bfloat16 matrices, routed experts, their GLU
join, MXFP4 experts) computed with `mma.sync.m16n8k16` (bf16 inputs, float32 accumulators):
output columns are the MMA's 16 rows (A, the weights, dequantized to bfloat16), a window's rows
its 8 columns (B, x; a row past R is zeros). Output element (column n, row r) is then a function of
weight row n and x row r alone: the tensor core forms each output element from its own A row and B
column, and the K loop (chunks of 32 values, 4 lanes × 32 per step, 8 MMAs a step, in order)
depends on K alone (a tile's SPLIT warps take every SPLIT-th step of it, their partial sums added
in warp order: SPLIT and the other loop settings are the process's, never the window's). A 1-row
call pays for 8 rows of MMA, which costs little next to reading the weights; a window's 8 rows
cost about what one does, where rows_matvec's FMA forms do 8x the multiplies and
loads (the 80B shape's head at 8 rows: 0.17 against 0.33 ms on the H200; docs/benchmarks.md,
"Window projections on tensor cores").

Where the values differ from rows_matvec's: a dequantized weight is rounded to bfloat16 (as
`mx.dequantize` at bfloat16 rounds it; MXFP4 and bfloat16 weights are exact), and the tensor
core's float32 sum of 16 products is its own. Neither depends on the rows, so serial and
speculative decoding stay identical; they are a different rounding of the same product.

Fragment layout (PTX ISA, mma.m16n8k16 .bf16): lane = 4·g + q. A: (row g | g + 8, k 2q, 2q + 1)
and (row g | g + 8, k 2q + 8, 2q + 9); B: (k 2q, 2q + 1 | 2q + 8, 2q + 9, column g); D: (row g |
g + 8, columns 2q, 2q + 1). The MMA's k index is not the weights' order: in a step, lane q holds the
32 values of chunk u = step · 4 + q (one 16-byte load of 4-bit weights), and MMA j takes its values
4j ... 4j + 3 as its k 2q, 2q + 1, 2q + 8, 2q + 9, for A and for B alike (a permutation of the
sum's terms that is a function of K alone).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mlx.core as mx

from . import backends, probe
from .columns import ColumnLayout, joined, probe_layout, segment_index
from .probe import Probe, dims, gpu_kernel

ENV = "STRATA_TENSOR_CORES"  # 0: the FMA forms everywhere (a comparison, a suspect GPU); 1: every form; a list
# rows_matvec's calls these kernels can take: plain dense and affine matrices, routed experts, their
# GLU join, the GLU of one affine pair (shared experts, MLPs), column-mapped projections
FORMS = ("dense", "affine", "routed", "glu", "plain-glu", "mapped")
# All but the routed GLU join, whose FMA form was faster at both 1 and 8 rows on the H100 at 1c3c6e6
# (mma_loop's experts_glu: 0.025 / 0.081 ms against 0.029 / 0.085; the 80B shape's T = 8 window
# 3.10 / 3.16 ms against 3.29 / 3.22 in two alternating rounds; docs/benchmarks.md). Its picks
# share no weights (one pick a block), so the MMA amortises nothing over a window's rows.
DEFAULT_FORMS = tuple(f for f in FORMS if f != "glu")
MAX_ROWS = 8  # B's columns: a window's rows (or one expert's picks)
MAX_PICKS = 256  # routed-expert picks one call takes (a window's rows x top-k)


class Loop(NamedTuple):
    """A form's K loop: warps a block; warps summing one tile's K (1, each warp its own tile, or
    `warps`, one tile a block read in that many streams); K steps a warp loads before it
    multiplies any (when loads are issued, never the sum)."""
    warps: int
    split: int
    unroll: int


# The K loop of each kind of form, the process's (never the window's). Routed experts: each warp
# its own tile over all of K (mma_loop on the H100 at ba1cd33, 8 and 1 rows: the routed down
# projection 0.054 and 0.025 ms against 4/4/1's 0.072 and 0.032; docs/benchmarks.md). The plain
# forms: one tile a block of 8 warps, each a stream of K (ncu on the H100 at 22ead51, the 80B
# shape's plain projections and shared GLU over 8 layers: 8/8/1 358 / 380 µs at T = 1 / T = 8
# against 4/4/1's 403 / 422, the column-mapped ones alike; 16/16/1, 8/8/2 and 4/4/4 slower).
LOOPS = {"plain": Loop(8, 8, 1), "routed": Loop(4, 1, 1)}
PLAIN_COLS = 16  # output columns a tile: the MMA's 16 rows
GLU_COLS = 8  # GLU forms: A rows 0-7 gate columns, 8-15 the same columns of up

# The instructions the bodies name, as PTX (the emulator, scripts/lab/mma_emulate.py, supplies
# them in software).
CUDA_HELPERS = r"""
// d += A (16 x 16) · B (16 x 8): a0..a3 and b0, b1 the lane's fragments, bf16 pairs (low half first)
__device__ __forceinline__ void strata_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float strata_bits_float(unsigned u) { return __uint_as_float(u); }
// two floats as a bf16 pair, each rounded to nearest even: lo in the low half
__device__ __forceinline__ unsigned strata_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
"""
# How a chunk (32 values of one weight row, or of one x row) becomes 16 bf16 pairs, per form.
PICKS_HEADER = f"#define MAX_PICKS {MAX_PICKS}\n"  # the routed-experts bodies' staging size
COMMON = "\n" + PICKS_HEADER + r"""// 32 bfloat16 values (raw bits) as 16 pairs
template <typename V>
__device__ __forceinline__ void strata_pairs(const V* p, bool vec, unsigned (&out)[16]) {
    if (vec) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
            out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
        }
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
        #pragma unroll
        for (int i = 0; i < 16; ++i) out[i] = h[2 * i] | (static_cast<unsigned>(h[2 * i + 1]) << 16);
    }
}
// A lane's chunk of one weight row, per form: `load` reads chunk u's raw words (and scale), `pair(i)`
// converts them to bf16 pair i of 16. Apart, so a warp can have the loads of UNROLL steps in flight
// before it converts and multiplies any of them, and converts a pair only as its MMA takes it
// (16 converted pairs a row held at once cost an SM blocks).
// Dense bfloat16 rows: the raw words are the pairs.
template <typename V>
struct strata_dense_chunk {
    unsigned p[16];
    __device__ __forceinline__ void load(const V* w, int u, bool vec) { strata_pairs(w + u * 32, vec, p); }
    __device__ __forceinline__ unsigned pair(int i) const { return p[i]; }
};
// Affine-quantized rows (BITS 4 or 8, group GS >= 32): scale · q + bias, rounded to bf16
template <int BITS, int GS, typename S>
struct strata_affine_chunk {
    static constexpr int VALS = 32 / BITS, WORDS = 32 / VALS;
    unsigned q[WORDS];
    float scale, bias;
    __device__ __forceinline__ void load(const unsigned* w, const S* s, const S* b, int u, bool vec) {
        scale = static_cast<float>(s[(u * 32) / GS]);
        bias = static_cast<float>(b[(u * 32) / GS]);
        #pragma unroll
        for (int i = 0; i < WORDS / 4; ++i) {
            const uint4 v = strata_words(w + u * WORDS + 4 * i, vec);
            q[4 * i] = v.x; q[4 * i + 1] = v.y; q[4 * i + 2] = v.z; q[4 * i + 3] = v.w;
        }
    }
    __device__ __forceinline__ unsigned pair(int i) const {
        return strata_bf16x2(fmaf(scale, strata_quant<BITS>(q[(2 * i) / VALS], (2 * i) % VALS), bias),
                             fmaf(scale, strata_quant<BITS>(q[(2 * i + 1) / VALS], (2 * i + 1) % VALS), bias));
    }
};
// an e2m1 code (sign, 2 exponent bits, 1 mantissa bit) as a float, exact
__device__ __forceinline__ float strata_e2m1(unsigned c) {
    const unsigned e = (c >> 1) & 3u, m = c & 1u;
    const unsigned bits = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
    return strata_bits_float(bits | ((c & 8u) << 28));
}
// MXFP4 rows (a chunk is one group: 32 codes, 8 a word, low nibble first, one e8m0 scale):
// code · 2^(s - 127), exact in bfloat16
struct strata_mxfp4_chunk {
    uint4 v;
    float scale;
    __device__ __forceinline__ void load(const unsigned* w, const unsigned char* s, int u, bool vec) {
        scale = strata_e8m0(s[u]);
        v = strata_words(w + u * 4, vec);
    }
    __device__ __forceinline__ unsigned pair(int i) const {
        const unsigned word = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w, at = 8 * (i % 4);
        return strata_bf16x2(strata_e2m1(word >> at) * scale, strata_e2m1(word >> (at + 4)) * scale);
    }
};
"""

# The preludes say, per lane: `xg` (x row of B's column g, or null: zeros), `o0`, `o1` (the
# output rows of D's columns 2q and 2q + 1, -1 for none), and the weight pointers of the form.
_LANES = """
    const int K = dims[1], N = dims[2];
    const int lane = thread_x & 31, g = lane >> 2, q = lane & 3;
"""
_PLAIN = _LANES + """
    const int R = dims[0];
    const T* xg = g < R ? x + static_cast<size_t>(g) * K : nullptr;
    const int o0 = 2 * q < R ? 2 * q : -1, o1 = 2 * q + 1 < R ? 2 * q + 1 : -1;
    const int column_block = block_x;
"""


def stage_picks(share: str) -> str:
    """Kernel lines shared by every routed-experts body (here and in rows_matvec): the call's
    picks staged in shared memory (`picks`, M of them), `e` the expert of pick m, and a return for
    a block whose pick m does not open a run of `share` picks of e (the template value that
    bounds a block's picks of one expert)."""
    return f"""    STRATA_SHARED int picks[MAX_PICKS];
    for (int i = thread_x; i < M; i += block_dim) picks[i] = static_cast<int>(idx[i]);
    strata_sync();
    const int e = picks[m];
    if ({share} > 1) {{
        int before = 0;
        for (int i = 0; i < m; ++i) before += picks[i] == e;
        if (before % {share}) return;
    }}
"""


# Routed experts: block (column block, m) serves pick m and the next picks of its expert, SHARE
# at most, when m opens a run of SHARE picks of it (as rows_matvec's gather: each expert read
# once for the picks that share its block, a pick's arithmetic never depending on which).
# Pick p reads x row p / dims[3]. PICKS_X: the picks on the grid's fast axis.
_GATHER = _LANES + """
    const int M = dims[0];
    const int m = PICKS_X ? block_x : block_y;
    const int column_block = PICKS_X ? block_y : block_x;
""" + stage_picks("SHARE") + """    // the pick in B's column s: the s-th pick of e from m on (-1: none); a block of one pick has
    // m alone (said outright: the scan's registers cost an SM a block of the 80B shape's down)
    auto pick_at = [&](int s) {
        if (s >= SHARE) return -1;
        if (SHARE == 1) return m;
        for (int i = m, c = 0; i < M; ++i)
            if (picks[i] == e && c++ == s) return i;
        return -1;
    };
    const int pg = pick_at(g);
    const T* xg = pg >= 0 ? x + static_cast<size_t>(pg / dims[3]) * K : nullptr;
    const int o0 = pick_at(2 * q), o1 = pick_at(2 * q + 1);
"""
# Where a block's A rows come from: `na`, `nb` (weight rows of A rows g and g + 8) and each
# form's per-row pointers. Plain: 16 output columns a tile; GLU: 8, gate row n in A row g, the
# up's row n in A row g + 8. A block of WARPS warps holds WARPS / SPLIT tiles, each summed over K
# by SPLIT warps (`kw`, this warp's share); SPLIT is 1 or WARPS, so a block's warps either all
# share one tile (and the return below) or never wait on each other after it.
_TILE = """
    const int warp = thread_x >> 5, kw = warp % SPLIT;
    const int n0 = (column_block * (WARPS / SPLIT) + warp / SPLIT) * TILE_COLS;
    if (n0 >= N) return;
"""
_COLUMNS_PLAIN = _TILE.replace("TILE_COLS", "16") + """    const int na = n0 + g < N ? n0 + g : n0, nb = n0 + g + 8 < N ? n0 + g + 8 : n0;
"""
_COLUMNS_GLU = _TILE.replace("TILE_COLS", "8") + """    const int na = n0 + g < N ? n0 + g : n0, nb = na;
"""
# Column-mapped: A row g reads weight row col_map[n0 + g] (columns.py; a missing column repeats
# the tile's first)
_COLUMNS_MAPPED = (_TILE.replace("TILE_COLS", "16")
                   + """    const int na = static_cast<int>(col_map[n0 + g < N ? n0 + g : n0]);
    const int nb = static_cast<int>(col_map[n0 + g + 8 < N ? n0 + g + 8 : n0]);
""")
# The K loop: a warp takes steps kw, kw + SPLIT, ... (a step: 4 chunks, lane q chunk q of it), in
# that order, UNROLL steps at a time, loading all of them (at a real chunk: one past K reads chunk
# 0, then counts zeros) before it converts and multiplies any. UNROLL changes when loads are
# issued, never the sum; a step past K adds zeros (an MMA of zeros). The SPLIT warps of a tile
# then add their partial sums in warp order.
_LOOP = """
    const int KC = K / 32;
    const bool xvec = strata_aligned16(x, static_cast<size_t>(K) * 2);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int u0 = 4 * kw; u0 < KC; u0 += 4 * SPLIT * UNROLL) {
        CHUNK ca[UNROLL], cb[UNROLL];
        unsigned xv[UNROLL][16];
        #pragma unroll
        for (int st = 0; st < UNROLL; ++st) {
            const int u = u0 + 4 * SPLIT * st + q, at = u < KC ? u : 0;
LOAD_A
            if (xg) strata_pairs(xg + at * 32, xvec, xv[st]);
            else {
                #pragma unroll
                for (int i = 0; i < 16; ++i) xv[st][i] = 0u;
            }
        }
        #pragma unroll
        for (int st = 0; st < UNROLL; ++st) {
            const bool live = u0 + 4 * SPLIT * st + q < KC;
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned a0 = live ? ca[st].pair(2 * j) : 0u, a1 = live ? ca[st].pair(2 * j + 1) : 0u;
                const unsigned b0 = live ? cb[st].pair(2 * j) : 0u, b1 = live ? cb[st].pair(2 * j + 1) : 0u;
                const unsigned x0 = live ? xv[st][2 * j] : 0u, x1 = live ? xv[st][2 * j + 1] : 0u;
                strata_mma(d, a0, b0, a1, b1, x0, x1);
            }
        }
    }
    if (SPLIT > 1) {  // the tile's warps' partial sums, added in warp order by its first warp
        STRATA_SHARED float part[WARPS][32][4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) part[warp][lane][i] = d[i];
        strata_sync();
        if (kw != 0) return;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            float sum = part[warp][lane][i];
            #pragma unroll
            for (int w = 1; w < SPLIT; ++w) sum += part[warp + w][lane][i];
            d[i] = sum;
        }
    }
"""
# D's values: d[0], d[1] column na, rows o0, o1; d[2], d[3] column nb, rows o0, o1.
_WRITE_PLAIN = """
    if (n0 + g < N) {
        if (o0 >= 0) out[static_cast<size_t>(o0) * N + n0 + g] = static_cast<T>(d[0]);
        if (o1 >= 0) out[static_cast<size_t>(o1) * N + n0 + g] = static_cast<T>(d[1]);
    }
    if (n0 + g + 8 < N) {
        if (o0 >= 0) out[static_cast<size_t>(o0) * N + n0 + g + 8] = static_cast<T>(d[2]);
        if (o1 >= 0) out[static_cast<size_t>(o1) * N + n0 + g + 8] = static_cast<T>(d[3]);
    }
"""
_WRITE_MAPPED = _WRITE_PLAIN  # each value where columns.py's layout puts it
for _row in ("o0", "o1"):
    for _column in ("n0 + g", "n0 + g + 8"):
        _WRITE_MAPPED = _WRITE_MAPPED.replace(f"out[static_cast<size_t>({_row}) * N + {_column}]",
                                              f"out[{segment_index(_row, _column)}]")
# Gate and up rounded to T as the plain outputs are, then joined in float32 and rounded once
# (GLU_HEADER, rows_matvec's GLU forms' too).
_WRITE_GLU = """
    if (n0 + g < N) {
        if (o0 >= 0) out[static_cast<size_t>(o0) * N + n0 + g] = static_cast<T>(
            STRATA_GLU(static_cast<float>(static_cast<T>(d[0])), static_cast<float>(static_cast<T>(d[2]))));
        if (o1 >= 0) out[static_cast<size_t>(o1) * N + n0 + g] = static_cast<T>(
            STRATA_GLU(static_cast<float>(static_cast<T>(d[1])), static_cast<float>(static_cast<T>(d[3]))));
    }
"""
GLU_HEADER = "#define STRATA_GLU(G, U) ((G) / (1.0f + expf(-(G))) * (U))\n"


def _affine(up: bool = False, gather: bool = False) -> tuple[str, str, str]:
    """Pointers and the A loads of affine weights: plain, or at expert e (gather); A row g + 8 from
    the up's arrays (`up`, GLU forms) or from the same matrix."""
    at = lambda per: f" + static_cast<size_t>(e) * N * {per}" if gather else ""  # noqa: E731
    lines = ["    const int KW = K / (32 / BITS), KG = K / GS;",
             "    const bool wvec = strata_aligned16(w, static_cast<size_t>(KW) * 4)"
             + (" && strata_aligned16(w_up, static_cast<size_t>(KW) * 4);" if up else ";")]
    for name, src in (("a", ""), ("b", "_up" if up else "")):
        row = "na" if name == "a" else "nb"
        lines.append(f"    const unsigned* w_{name} = w{src}{at('KW')} + static_cast<size_t>({row}) * KW;")
        lines.append(f"    const auto s_{name} = scales{src}{at('KG')} + static_cast<size_t>({row}) * KG;")
        lines.append(f"    const auto b_{name} = biases{src}{at('KG')} + static_cast<size_t>({row}) * KG;")
    load = ("            ca[st].load(w_a, s_a, b_a, at, wvec);\n"
            "            cb[st].load(w_b, s_b, b_b, at, wvec);")
    return "\n".join(lines) + "\n", "strata_affine_chunk<BITS, GS, TS>", load


def _body(prelude: str, columns: str, pointers: tuple[str, str, str], write: str) -> str:
    setup, chunk, load = pointers
    return prelude + columns + setup + _LOOP.replace("CHUNK", chunk).replace("LOAD_A", load) + write


_DENSE_POINTERS = ("""    const bool wvec = strata_aligned16(w, static_cast<size_t>(K) * 2);
    const T* w_a = w + static_cast<size_t>(na) * K;
    const T* w_b = w + static_cast<size_t>(nb) * K;
""", "strata_dense_chunk<T>", "            ca[st].load(w_a, at, wvec);\n            cb[st].load(w_b, at, wvec);")
_MXFP4_POINTERS = ("""    const int KW = K / 8, KC32 = K / 32;
    const bool wvec = strata_aligned16(w, static_cast<size_t>(KW) * 4);
    const unsigned* w_a = w + static_cast<size_t>(e) * N * KW + static_cast<size_t>(na) * KW;
    const unsigned* w_b = w + static_cast<size_t>(e) * N * KW + static_cast<size_t>(nb) * KW;
    const unsigned char* s_a = scales + static_cast<size_t>(e) * N * KC32 + static_cast<size_t>(na) * KC32;
    const unsigned char* s_b = scales + static_cast<size_t>(e) * N * KC32 + static_cast<size_t>(nb) * KC32;
""", "strata_mxfp4_chunk", "            ca[st].load(w_a, s_a, at, wvec);\n            cb[st].load(w_b, s_b, at, wvec);")

DENSE = _body(_PLAIN, _COLUMNS_PLAIN, _DENSE_POINTERS, _WRITE_PLAIN)
QUANTIZED = _body(_PLAIN, _COLUMNS_PLAIN, _affine(), _WRITE_PLAIN)
QUANTIZED_GLU = _body(_PLAIN, _COLUMNS_GLU, _affine(up=True), _WRITE_GLU)
DENSE_MAPPED = _body(_PLAIN, _COLUMNS_MAPPED, _DENSE_POINTERS, _WRITE_MAPPED)
QUANTIZED_MAPPED = _body(_PLAIN, _COLUMNS_MAPPED, _affine(), _WRITE_MAPPED)
GATHER_QUANTIZED = _body(_GATHER, _COLUMNS_PLAIN, _affine(gather=True), _WRITE_PLAIN)
GATHER_QUANTIZED_GLU = _body(_GATHER, _COLUMNS_GLU, _affine(up=True, gather=True), _WRITE_GLU)
GATHER_MXFP4 = _body(_GATHER, _COLUMNS_PLAIN, _MXFP4_POINTERS, _WRITE_PLAIN)


def header(helpers: str = CUDA_HELPERS) -> str:
    """What precedes every body: the MMA and conversion (`helpers`: PTX here, software in the
    emulator), the chunk loaders, the GLU join."""
    return helpers + COMMON + GLU_HEADER


def _kernel(name: str, inputs: list[str], body: str):
    return gpu_kernel(name, inputs, ["out"], body, header())


def _grid(N: int, cols: int, picks: int = 1, picks_x: bool = False, *, kind: str = "plain") -> tuple[tuple, tuple]:
    warps, split, _ = LOOPS[kind]
    if split not in (1, warps):
        raise ValueError(f"rows_mma's split is 1 or its warps ({warps}), got {split}")
    blocks = -(-N // (cols * (warps // split)))  # warps / split tiles a block
    threads = warps * 32
    grid = (picks * threads, blocks, 1) if picks_x else (blocks * threads, picks, 1)
    return grid, (threads, 1, 1)


def _loop_template(kind: str = "plain") -> list[tuple[str, int]]:
    """The K loop's template values (read at each call, so a study can set them: scripts.lab.mma_loop.py)."""
    warps, split, unroll = LOOPS[kind]
    return [("WARPS", warps), ("SPLIT", split), ("UNROLL", unroll)]


def rows(x: mx.array) -> tuple[int, int]:
    """(R, K) of x (..., K): its rows over every leading axis. The kernels (here and in
    rows_matvec) read their inputs row-contiguous (MLX copies one that is not), so leading axes need
    no reshape: on the H200 each reshape is one more node for the evaluator (docs/benchmarks.md,
    "Ops per decode step")."""
    K = x.shape[-1]
    return x.size // K, K


def forms_on() -> frozenset[str]:
    """The forms STRATA_TENSOR_CORES leaves on: DEFAULT_FORMS (unset or empty), every one of FORMS
    (1), none (0), or those a comma list names (`dense,affine`: a comparison of one form against
    the FMA kernels; a process keeps its choice, so a row's bits never depend on the window)."""
    value = os.environ.get(ENV, "")
    if value not in _forms:
        text = value.strip()
        named = {n.strip() for n in text.split(",")} - {""}
        names = set(DEFAULT_FORMS) if not text else set(FORMS) if text == "1" else set() if text == "0" else named
        if names - set(FORMS):
            raise ValueError(f"{ENV} is 0, 1 or a comma list of {', '.join(FORMS)}; got {value!r}")
        _forms[value] = frozenset(names)
    return _forms[value]


_forms: dict[str, frozenset[str]] = {}


def supports(x: mx.array, K: int, *, group_size: int | None = None, bits: int | None = None,
             form: str | None = None) -> bool:
    """Whether these kernels take x (bfloat16 rows) into weights of width K (a multiple of 32;
    affine: 4 or 8 bits, groups of 32, 64 or 128) on this device: CUDA, the probe passed, not
    turned off (STRATA_TENSOR_CORES=0, or a list without `form`)."""
    if x.dtype != mx.bfloat16 or K % 32 or probe.backend() != backends.CUDA:
        return False
    on = forms_on()
    if not on or (form is not None and form not in on):
        return False
    if bits is not None and not (bits in (4, 8) and group_size in (32, 64, 128) and K % group_size == 0):
        return False
    return usable()


def rows_matvec(x: mx.array, w: mx.array) -> mx.array:
    """x (..., K) bfloat16 @ w (N, K)ᵀ bfloat16 -> (..., N), at most 8 rows."""
    R, K = rows(x)
    _check_rows(R)
    N = w.shape[0]
    grid, block = _grid(N, PLAIN_COLS)
    (out,) = _kernel("strata_mma_matvec_v2", ["dims", "x", "w"], DENSE)(
        inputs=[dims(R, K, N), x, w], template=[("T", x.dtype), *_loop_template()], grid=grid, threadgroup=block,
        output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype])
    return out


def rows_qmatvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                 bits: int) -> mx.array:
    """x (..., K) bfloat16 @ dequantized w (N, K·bits/32 packed)ᵀ -> (..., N), at most 8 rows."""
    R, K = rows(x)
    _check_rows(R)
    N = w.shape[0]
    grid, block = _grid(N, PLAIN_COLS)
    (out,) = _kernel("strata_mma_qmatvec_v2", ["dims", "x", "w", "scales", "biases"], QUANTIZED)(
        inputs=[dims(R, K, N), x, w, scales, biases],
        template=[("T", x.dtype), ("TS", scales.dtype), ("BITS", bits), ("GS", group_size), *_loop_template()],
        grid=grid, threadgroup=block, output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype])
    return out


def rows_glu_qmatvec(x: mx.array, gate: tuple[mx.array, mx.array, mx.array], up: tuple[mx.array, mx.array, mx.array],
                     *, group_size: int, bits: int) -> mx.array:
    """silu(x @ gateᵀ) · (x @ upᵀ) of one affine pair (rows_matvec.rows_glu_qmatvec), at most 8 rows."""
    R, K = rows(x)
    _check_rows(R)
    N = gate[0].shape[0]
    grid, block = _grid(N, GLU_COLS)
    (out,) = _kernel("strata_mma_glu_qmatvec_v1", ["dims", "x", "w", "scales", "biases", "w_up", "scales_up",
                                                   "biases_up"], QUANTIZED_GLU)(
        inputs=[dims(R, K, N), x, *gate, *up],
        template=[("T", x.dtype), ("TS", gate[1].dtype), ("BITS", bits), ("GS", group_size), *_loop_template()],
        grid=grid, threadgroup=block, output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype])
    return out


def rows_matvec_mapped(x: mx.array, w: mx.array, layout: ColumnLayout) -> mx.array:
    """rows_matvec's columns `layout` names, laid out as it says: the flat (R·N,) output (its
    `parts` cut it), at most 8 rows, w (N, K) bfloat16."""
    R, K = rows(x)
    _check_rows(R)
    grid, block = _grid(layout.N, PLAIN_COLS)
    (out,) = _kernel("strata_mma_matvec_mapped_v1", ["dims", "x", "w", "col_map"], DENSE_MAPPED)(
        inputs=[dims(R, K, layout.N), x, w, layout.data], template=[("T", x.dtype), *_loop_template()], grid=grid,
        threadgroup=block, output_shapes=[(R * layout.N,)], output_dtypes=[x.dtype])
    return out


def rows_qmatvec_mapped(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, layout: ColumnLayout, *,
                        group_size: int, bits: int) -> mx.array:
    """`rows_matvec_mapped` of affine weights (each column's scales and biases its weight row's)."""
    R, K = rows(x)
    _check_rows(R)
    grid, block = _grid(layout.N, PLAIN_COLS)
    (out,) = _kernel("strata_mma_qmatvec_mapped_v1", ["dims", "x", "w", "scales", "biases", "col_map"],
                     QUANTIZED_MAPPED)(
        inputs=[dims(R, K, layout.N), x, w, scales, biases, layout.data],
        template=[("T", x.dtype), ("TS", scales.dtype), ("BITS", bits), ("GS", group_size), *_loop_template()],
        grid=grid, threadgroup=block, output_shapes=[(R * layout.N,)], output_dtypes=[x.dtype])
    return out


def _picks(x: mx.array, experts: mx.array, what: str) -> tuple[int, int, int]:
    R, K = rows(x)
    M = experts.size
    if M > MAX_PICKS or M % R:
        raise ValueError(f"{what} takes at most {MAX_PICKS} picks, a multiple of its {R} rows; got {M}")
    return M, K, M // R


def _gather_shape(x: mx.array, per: int, N: int) -> tuple[int, ...]:
    return (*x.shape[:-1], N) if per == 1 else (*x.shape[:-1], per, N)


def rows_gather_qmatvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, experts: mx.array, *,
                        group_size: int, bits: int, share: int | None = None) -> mx.array:
    """rows_matvec.rows_gather_qmatvec's routed experts (picks sharing rows too) on tensor cores:
    `share` picks of one expert at most in a block (1 to 8; default 1)."""
    M, K, per = _picks(x, experts, "rows_gather_qmatvec")
    N = w.shape[1]
    grid, block = _grid(N, PLAIN_COLS, M, kind="routed")
    (out,) = _kernel("strata_mma_gather_qmatvec_v2", ["dims", "x", "w", "scales", "biases", "idx"], GATHER_QUANTIZED)(
        inputs=[dims(M, K, N, per), x, w, scales, biases, experts],
        template=[("T", x.dtype), ("TS", scales.dtype), ("TI", experts.dtype), ("BITS", bits), ("GS", group_size),
                  *_loop_template("routed"), ("SHARE", share or 1), ("PICKS_X", False)],
        grid=grid, threadgroup=block, output_shapes=[_gather_shape(x, per, N)], output_dtypes=[x.dtype])
    return out


def rows_gather_glu_qmatvec(x: mx.array, gate: tuple[mx.array, mx.array, mx.array],
                            up: tuple[mx.array, mx.array, mx.array], experts: mx.array, *, group_size: int, bits: int,
                            share: int | None = None) -> mx.array:
    """silu(gate) · up of routed experts (rows_matvec.rows_gather_glu_qmatvec) on tensor cores."""
    M, K, per = _picks(x, experts, "rows_gather_glu_qmatvec")
    N = gate[0].shape[1]
    grid, block = _grid(N, GLU_COLS, M, kind="routed")
    (out,) = _kernel("strata_mma_gather_glu_qmatvec_v2", ["dims", "x", "w", "scales", "biases", "w_up", "scales_up",
                                                          "biases_up", "idx"], GATHER_QUANTIZED_GLU)(
        inputs=[dims(M, K, N, per), x, *gate, *up, experts],
        template=[("T", x.dtype), ("TS", gate[1].dtype), ("TI", experts.dtype), ("BITS", bits), ("GS", group_size),
                  *_loop_template("routed"), ("SHARE", share or 1), ("PICKS_X", False)],
        grid=grid, threadgroup=block, output_shapes=[_gather_shape(x, per, N)], output_dtypes=[x.dtype])
    return out


def rows_gather_mxfp4matvec(x: mx.array, w: mx.array, scales: mx.array, experts: mx.array, *,
                            share: int | None = None, picks_x: bool = True) -> mx.array:
    """rows_matvec.rows_gather_mxfp4matvec's MXFP4 experts (one row a pick) on tensor cores;
    `picks_x`: the picks on the grid's fast axis (one expert's blocks run side by side)."""
    M, K, _ = _picks(x, experts, "rows_gather_mxfp4matvec")
    if M != rows(x)[0]:
        raise ValueError(f"rows_gather_mxfp4matvec takes one row a pick, got {rows(x)[0]} rows for {M} picks")
    N = w.shape[1]
    grid, block = _grid(N, PLAIN_COLS, M, picks_x, kind="routed")
    (out,) = _kernel("strata_mma_gather_mxfp4matvec_v2", ["dims", "x", "w", "scales", "idx"], GATHER_MXFP4)(
        inputs=[dims(M, K, N, 1), x, w, scales, experts],
        template=[("T", x.dtype), ("TI", experts.dtype), *_loop_template("routed"), ("SHARE", share or 1),
                  ("PICKS_X", picks_x)],
        grid=grid, threadgroup=block, output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype])
    return out


def _check_rows(R: int) -> None:
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"the tensor-core kernels take 1..{MAX_ROWS} rows, got {R}")


# -- the probe ---------------------------------------------------------------------------------

_probe = Probe("row-invariant tensor-core matrix kernels", "decode windows take the FMA kernels")


def usable(dtype=mx.bfloat16) -> bool:
    """True on CUDA, at bfloat16, once every form matched its reference and was row-invariant on
    the probe (once per process, or kept from an earlier one); False at any other dtype."""
    return (dtype is None or dtype == mx.bfloat16) and _probe.usable(_check, mx.bfloat16)


def status() -> dict:
    return _probe.status()


TOLERANCE = 3e-2  # bfloat16 outputs against a float32 reference of the same bf16 weights


def _near(got: mx.array, expected: mx.array) -> bool:
    return mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), rtol=TOLERANCE, atol=TOLERANCE).item()


def _dense(w, scales=None, biases=None, *, group_size=64, bits=4, mode="affine") -> mx.array:
    """A form's weights as the kernels see them: dequantized, rounded to bfloat16, in float32."""
    if scales is None:
        return w.astype(mx.float32)
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode,
                         dtype=mx.bfloat16).astype(mx.float32)


def reference(x: mx.array, dense: mx.array, experts: mx.array | None = None) -> mx.array:
    """x's rows (or picks: row m // (picks / rows) with expert experts[m]) times `dense` (N, K)
    or (E, N, K), float32, rounded to x's dtype."""
    xf = x.astype(mx.float32).reshape(-1, x.shape[-1])
    if experts is None:
        return (xf @ dense.T).astype(x.dtype)
    per = experts.size // xf.shape[0]
    rows = mx.repeat(xf, per, axis=0) if per > 1 else xf
    return (dense[experts] @ rows[:, :, None])[..., 0].astype(x.dtype)


def reference_glu(gate: mx.array, up: mx.array) -> mx.array:
    """What the GLU forms (here and in rows_matvec) compute from their two products (each as its
    plain kernel rounds it): silu(gate) · up in float32, rounded once to their dtype."""
    g = gate.astype(mx.float32)
    return (g * mx.sigmoid(g) * up.astype(mx.float32)).astype(gate.dtype)


def probe_cases() -> list[tuple[str, object, object, mx.array, mx.array | None]]:
    """(what, kernel(x, experts), reference(x, experts), x, experts): every form at K = 544 (a
    partial last step) and N = 200 (a column tail), routed picks with one expert picked past a
    block's rows."""
    K, N, dtype = 544, 200, mx.bfloat16
    key = mx.random.key(21)
    x = mx.random.normal((MAX_ROWS, K), key=key).astype(dtype)
    w = (mx.random.normal((N, K), key=mx.random.key(22)) * K**-0.5).astype(dtype)
    qw = mx.quantize(w, 32, 4)
    experts = mx.array([3, 1, 3, 0, 3, 5, 1, 3, 3, 3, 3, 3], dtype=mx.uint32)
    picks = mx.random.normal((experts.size, K), key=mx.random.key(23)).astype(dtype)
    we = [(mx.random.normal((6, N, K), key=mx.random.key(s)) * K**-0.5).astype(dtype) for s in (24, 25)]
    gate, up = mx.quantize(we[0], 32, 4), mx.quantize(we[1], 32, 4)
    fp4 = mx.quantize(we[0], 32, 4, mode="mxfp4")
    dense_gate, dense_up = _dense(*gate, group_size=32), _dense(*up, group_size=32)
    qw_up = mx.quantize(we[1][0], 32, 4)
    layout = probe_layout(N)
    return [
        ("dense", lambda a, _: rows_matvec(a, w), lambda a, _: reference(a, _dense(w)), x, None),
        ("affine", lambda a, _: rows_qmatvec(a, *qw, group_size=32, bits=4),
         lambda a, _: reference(a, _dense(*qw, group_size=32)), x, None),
        ("routed affine", lambda a, e: rows_gather_qmatvec(a, *gate, e, group_size=32, bits=4, share=MAX_ROWS),
         lambda a, e: reference(a, dense_gate, e), picks, experts),
        ("routed GLU", lambda a, e: rows_gather_glu_qmatvec(a, gate, up, e, group_size=32, bits=4, share=MAX_ROWS),
         lambda a, e: reference_glu(reference(a, dense_gate, e), reference(a, dense_up, e)), picks, experts),
        ("routed MXFP4", lambda a, e: rows_gather_mxfp4matvec(a, *fp4, e, share=MAX_ROWS),
         lambda a, e: reference(a, _dense(*fp4, None, group_size=32, mode="mxfp4"), e), picks, experts),
        ("plain GLU", lambda a, _: rows_glu_qmatvec(a, qw, qw_up, group_size=32, bits=4),
         lambda a, _: reference_glu(reference(a, _dense(*qw, group_size=32)),
                                    reference(a, _dense(*qw_up, group_size=32))), x, None),
        ("mapped dense", lambda a, _: _joined(rows_matvec_mapped(a, w, layout), a, layout),
         lambda a, _: mx.take(reference(a, _dense(w)), layout.columns, axis=-1), x, None),
        ("mapped affine", lambda a, _: _joined(rows_qmatvec_mapped(a, *qw, layout, group_size=32, bits=4), a, layout),
         lambda a, _: mx.take(reference(a, _dense(*qw, group_size=32)), layout.columns, axis=-1), x, None),
    ]


def _joined(out: mx.array, x: mx.array, layout: ColumnLayout) -> mx.array:
    return joined(layout.parts(out, x.shape[:-1]))


def check_mapped_columns() -> str | None:
    """None when the column-mapped forms' segments, side by side, are the plain forms' columns
    gathered by the map bit for bit (a window of 8 rows and one of 3), else what failed."""
    K, N, dtype = 576, 200, mx.bfloat16  # K: 4.5 steps, groups of 64
    x = mx.random.normal((MAX_ROWS, K), key=mx.random.key(29)).astype(dtype)
    w = (mx.random.normal((N, K), key=mx.random.key(30)) * K**-0.5).astype(dtype)
    qw = mx.quantize(w, 64, 4)
    layout = probe_layout(N)
    for what, mapped, plain in (
            ("mapped dense", lambda a: rows_matvec_mapped(a, w, layout), lambda a: rows_matvec(a, w)),
            ("mapped affine", lambda a: rows_qmatvec_mapped(a, *qw, layout, group_size=64, bits=4),
             lambda a: rows_qmatvec(a, *qw, group_size=64, bits=4))):
        for a in (x, x[:3]):
            if not mx.array_equal(_joined(mapped(a), a, layout), mx.take(plain(a), layout.columns, axis=-1)).item():
                return f"{what}: its columns differ from the plain form's gathered columns"
    return None


def check_case(kernel, ref, x: mx.array, experts: mx.array | None) -> str | None:
    """None when the call's rows (picks) equal their one-row calls bit for bit, the 2- and
    3-row calls their rows, and the reference within TOLERANCE, else what failed."""
    count = x.shape[0]
    one = (lambda i: kernel(x[i : i + 1], None)) if experts is None else \
        (lambda i: kernel(x[i : i + 1], experts[i : i + 1]))
    together = kernel(x, experts)
    alone = mx.concatenate([one(i) for i in range(count)])
    fewer = [kernel(x[:T], None if experts is None else experts[:T]) for T in (2, 3)]
    expected = ref(x, experts)
    mx.eval(together, alone, fewer, expected)
    if not all(mx.array_equal(y, alone[: y.shape[0]]).item() for y in [together, *fewer]):
        return "rows differ with the row count"
    if not _near(together, expected):
        return "kernel and reference disagree"
    return None


def check_shared_rows() -> str | None:
    """None when routed picks that share rows (3 picks a row: a window's top-k) give the bits of
    their rows copied, for the affine and GLU forms, else what failed."""
    K, N, dtype = 576, 72, mx.bfloat16  # K: 4.5 steps, groups of 64
    experts = mx.array([3, 1, 0, 3, 5, 1, 2, 3, 4], dtype=mx.uint32)
    x = mx.random.normal((3, K), key=mx.random.key(26)).astype(dtype)
    gate, up = (mx.quantize((mx.random.normal((6, N, K), key=mx.random.key(s)) * K**-0.5).astype(dtype), 64, 4)
                for s in (27, 28))
    for what, kernel in (("routed affine", lambda a: rows_gather_qmatvec(a, *gate, experts, group_size=64, bits=4)),
                         ("routed GLU", lambda a: rows_gather_glu_qmatvec(a, gate, up, experts, group_size=64, bits=4))):
        shared, copied = kernel(x), kernel(mx.repeat(x, 3, axis=0))
        if shared.shape != (3, 3, N) or not mx.array_equal(shared.reshape(copied.shape), copied).item():
            return f"{what}: picks sharing rows differ from copied rows"
    return None


def _check(dtypes=(mx.bfloat16,)) -> str | None:
    if any(d != mx.bfloat16 for d in dtypes):
        return "bfloat16 only"
    for what, kernel, ref, x, experts in probe_cases():
        error = check_case(kernel, ref, x, experts)
        if error:
            return f"{what}: {error}"
    return check_shared_rows() or check_mapped_columns()
