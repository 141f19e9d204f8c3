"""Attention of a decode window's rows over the KV cache in one kernel: `attention_window`.

Legend: B batch, T query rows (<= 8 in a decode window), Hq/Hkv query/KV heads (query head h
reads KV head h // (Hq/Hkv)), D head dim, L cells in the cache view (the window's rows are its
last T cells, so row t at absolute position L-T+t sees cells 0..L-T+t).

In MLX ops a window's attention is T `scaled_dot_product_attention` calls plus slices and a
concatenate (on the H200 ~33 ops of ~10 µs at T = 8, per attention layer); this is one call. It is
row-invariant by construction: a block serves one (b, h, t) and its arithmetic is a function of
that row's query, the cells it sees and the compiled shapes alone, never of T — so a T-row call
gives each row the bits of its 1-row call (serial decoding, which goes through the same kernel).
The fixed order, for a row seeing n cells: warp w of WARPS takes the 32-cell chunks w, w+WARPS,
...; lane l scores cell 32c+l with a dot over D in one order (4 interleaved float32 partial sums,
added as (p0+p1)+(p2+p3)); the chunk's max is a xor butterfly (exact); the exponentials are summed
and the values accumulated cell by cell in chunk order, lane l owning D/32 consecutive output
dims; last, the warps' (max, sum, values) are combined in warp order 0..WARPS-1.

One body for CUDA and Metal (backends.py); `reference_attention_window` (pure MLX: serial
decoding's sdpa call, once per row) is what the CPU runs and what the tests hold the kernel to;
`usable()` probes the kernel once on the running device.
"""

from __future__ import annotations

import mlx.core as mx

from .pooled import step_dims
from .probe import Probe, cases_at, constant, gpu_kernel

MAX_HEAD_DIM = 256  # a lane keeps D/32 output dims in registers; the block's partials sit in shared memory
WARPS = 8  # warps per block: they split the cells, so long contexts keep 256 threads busy per row
# (read at each call, and part of the kernels' names: scripts/lab/attention_warps.py times others)

# One block per (b, h, t), WARPS warps. q, keys, values are read through their strides (views of
# the KV buffer are passed without a copy; the head dim must be contiguous, as every view the
# layer makes keeps it). The scores are scaled in float32 (q·scale, rounded once per dim).
# NEG_BIG (not -inf) starts the running max, so exp(m - m_new) is 0, never NaN, on a warp's first
# chunk; a warp that gets no chunk enters the combine with weight exp(NEG_BIG - M) = 0.
# A lane loads 32 of its cell's key values before it multiplies any, and the values of AHEAD cells
# before it adds any in: its loads overlap (one wait on memory per group, not per load; each load
# sits behind its own alignment branch, which the compiler does not move loads across), and every
# sum keeps its order (the bits of one load at a time).
# dims: B, Hq, Hkv, T, L. Output (B, T, Hq, D): the layout o_proj reads.
SOURCE = """
    constexpr int PER = DH / 32;
    constexpr int AHEAD = PER > 4 ? 4 : 8;  // cells whose values a lane loads before it adds any in
    constexpr float NEG_BIG = -3.402823466e38f;
    const int Hq = dims[1], Hkv = dims[2], T = dims[3], L = dims[4];
    const int lane = thread_x & 31, warp = thread_x >> 5;
    const int t = block_x % T, h = (block_x / T) % Hq, b = block_x / (T * Hq);
    const int kh = h / (Hq / Hkv);
    const int n = L - T + t + 1;
    STRATA_SHARED float q_s[DH];
    STRATA_SHARED float p_s[WARPS][32];
    STRATA_SHARED float m_s[WARPS];
    STRATA_SHARED float l_s[WARPS];
    STRATA_SHARED float acc_s[WARPS][DH];
    auto qp = q + b * q_strides[0] + h * q_strides[1] + t * q_strides[2];
    for (int d = thread_x; d < DH; d += WARPS * 32) q_s[d] = static_cast<float>(qp[d]) * scale[0];
    strata_sync();
    auto k0 = keys + b * keys_strides[0] + kh * keys_strides[1];
    auto v0 = values + b * values_strides[0] + kh * values_strides[1];
    float m = NEG_BIG, l = 0.0f, acc[PER];
    #pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = 0.0f;
    for (int j0 = warp * 32; j0 < n; j0 += WARPS * 32) {
        float s = NEG_BIG;
        if (j0 + lane < n) {
            auto kp = k0 + (j0 + lane) * keys_strides[2];
            const bool kvec = strata_aligned16(kp, 0);
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int d0 = 0; d0 < DH; d0 += 32) {
                float kv[4][8];
                #pragma unroll
                for (int u = 0; u < 4; ++u) strata_load<TK, 8>(kp + d0 + 8 * u, kvec, kv[u]);
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    #pragma unroll
                    for (int c = 0; c < 8; ++c) part[c & 3] = fmaf(q_s[d0 + 8 * u + c], kv[u][c], part[c & 3]);
                }
            }
            s = (part[0] + part[1]) + (part[2] + part[3]);
        }
        float chunk_max = s;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) chunk_max = fmaxf(chunk_max, strata_xor(chunk_max, off));
        const float m_new = fmaxf(m, chunk_max);
        const float rescale = expf(m - m_new);
        p_s[warp][lane] = expf(s - m_new);
        strata_sync_warp();
        l *= rescale;
        #pragma unroll
        for (int e = 0; e < PER; ++e) acc[e] *= rescale;
        const int count = n - j0 < 32 ? n - j0 : 32;
        for (int c0 = 0; c0 < count; c0 += AHEAD) {
            float v[AHEAD][PER];
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                if (c0 + u < count) {
                    auto vp = v0 + (j0 + c0 + u) * values_strides[2] + lane * PER;
                    strata_load<TV, PER>(vp, strata_aligned16(vp, 0), v[u]);
                }
            }
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                if (c0 + u < count) {
                    const float p = p_s[warp][c0 + u];
                    l += p;
                    #pragma unroll
                    for (int e = 0; e < PER; ++e) acc[e] = fmaf(p, v[u][e], acc[e]);
                }
            }
        }
        m = m_new;
        strata_sync_warp();
    }
    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
    #pragma unroll
    for (int e = 0; e < PER; ++e) acc_s[warp][lane * PER + e] = acc[e];
    strata_sync();
    float M = m_s[0];
    #pragma unroll
    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, m_s[w]);
    for (int d = thread_x; d < DH; d += WARPS * 32) {
        float total = 0.0f, o = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float c = expf(m_s[w] - M);
            total = fmaf(l_s[w], c, total);
            o = fmaf(acc_s[w][d], c, o);
        }
        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);
    }
"""


def header() -> str:
    """What precedes both bodies: WARPS, as the module holds it now."""
    return f"#define WARPS {WARPS}\n"


# -- long views in splits of SPLIT_CELLS cells ----------------------------------------------------
#
# One block a row walks all of a row's cells, WARPS chunks at a time: at 4,096 cells a warp
# waits on 16 chunks in turn, and MLX's sdpa took half the time at 8 rows on the H100 at
# 1c3c6e6 (0.090 against 0.180 ms; attention_warps). A view longer than SPLIT_CELLS goes through
# two kernels: SPLIT_SOURCE gives block (row, s) the cells s·SPLIT .. (s+1)·SPLIT - 1 of its row,
# walked and combined over warps as SOURCE walks a whole row (warp w the split's chunks w,
# w + WARPS, ...), and writes the unnormalized (values, max, sum); COMBINE_SOURCE joins a row's
# splits in order 0, 1, ... as the warps are joined. A row's arithmetic is a function of its
# own cell count and SPLIT alone; a row of at most SPLIT cells has one split, weighted
# exp(0) = 1 exactly, so its bits are SOURCE's, and which path a call takes (by its view's
# length) never changes a row's bits: serial decoding takes SOURCE for a row that a window
# past SPLIT cells takes in splits. In a window the cells come from DRAM and one block a row
# leaves most SMs idle (16 blocks at T = 1 on the 80B shape), each warp waiting on its chunks in
# turn: on the H100 at 97e7ee1 (ncu_window --context 4096, a window's two attention layers) one
# kernel took 744 / 696 µs at T = 1 / 8, 1,024-cell splits 181 / 373 and their combines 8.
SPLIT_CELLS = 1024  # cells a split, a multiple of 32; 0: one kernel at every length (read at each call)
_SPLIT_EDITS = (
    ("    const int t = block_x % T, h = (block_x / T) % Hq, b = block_x / (T * Hq);\n",
     "    const int S = (L + SPLIT - 1) / SPLIT, s = block_x % S, row_block = block_x / S;\n"
     "    const int t = row_block % T, h = (row_block / T) % Hq, b = row_block / (T * Hq);\n"),
    ("    const int n = L - T + t + 1;\n",
     "    const int n = L - T + t + 1;\n"
     "    if (s * SPLIT >= n) return;  // the row's cells end before this split (the whole block)\n"
     "    const int end = n < (s + 1) * SPLIT ? n : (s + 1) * SPLIT;\n"),
    # a split's chunks lie inside it (SPLIT is whole chunks), so the body's tests against n hold
    ("    for (int j0 = warp * 32; j0 < n; j0 += WARPS * 32) {\n",
     "    for (int j0 = s * SPLIT + warp * 32; j0 < end; j0 += WARPS * 32) {\n"),
    ("        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);\n",
     "        auto part = out + (static_cast<size_t>(row_block) * S + s) * (DH + 2);\n"
     "        part[d] = o;\n"
     "        if (d == 0) {\n"
     "            part[DH] = M;\n"
     "            part[DH + 1] = total;\n"
     "        }\n"),
)


def _edited(source: str, edits) -> str:
    for old, new in edits:
        if source.count(old) != 1:
            raise AssertionError(f"attention_window.SOURCE changed: {old.strip()!r} is no longer there once")
        source = source.replace(old, new)
    return source


SPLIT_SOURCE = _edited(SOURCE, _SPLIT_EDITS)
# A block a row (t fastest, as SOURCE's blocks), its threads over the head dims; parts (rows, S,
# DH + 2) float32 as SPLIT_SOURCE wrote them, of which a row reads its first ceil(n / SPLIT).
COMBINE_SOURCE = """
    const int Hq = dims[1], T = dims[3], L = dims[4];
    const int S = (L + SPLIT - 1) / SPLIT;
    const int t = block_x % T, h = (block_x / T) % Hq, b = block_x / (T * Hq);
    const int n = L - T + t + 1, splits = (n + SPLIT - 1) / SPLIT;
    auto part = parts + static_cast<size_t>(block_x) * S * (DH + 2);
    float M = part[DH];
    for (int s = 1; s < splits; ++s) M = fmaxf(M, part[s * (DH + 2) + DH]);
    for (int d = thread_x; d < DH; d += block_dim) {
        float total = 0.0f, o = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float c = expf(part[s * (DH + 2) + DH] - M);
            total = fmaf(part[s * (DH + 2) + DH + 1], c, total);
            o = fmaf(part[s * (DH + 2) + d], c, o);
        }
        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);
    }
"""


def split_header(cells: int | None = None) -> str:
    """What precedes the split kernels: WARPS as the module holds it now, and SPLIT (`cells`, by
    default SPLIT_CELLS as the module holds it now)."""
    cells = SPLIT_CELLS if cells is None else cells
    if cells <= 0 or cells % 32:
        raise ValueError(f"attention_window.SPLIT_CELLS is a positive multiple of 32, got {cells}")
    return header() + f"#define SPLIT {cells}\n"


def splits(L: int) -> int:
    """The splits a view of L cells takes (1: SOURCE's single kernel)."""
    return 1 if not SPLIT_CELLS or L <= SPLIT_CELLS else -(-L // SPLIT_CELLS)


def supports(head_dim: int) -> bool:
    """Head dims the kernel takes: multiples of 32, at most 256 (the models': 64 and 256)."""
    return head_dim % 32 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def launch(B: int, Hq: int, T: int, S: int = 1) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a block per (b, h, t), and
    per split of it when S > 1."""
    return {"grid": (B * Hq * T * S * WARPS * 32, 1, 1), "threadgroup": (WARPS * 32, 1, 1)}


def combine_launch(B: int, Hq: int, T: int, D: int) -> dict:
    """The combine's grid and block: a block of D threads per (b, h, t)."""
    return {"grid": (B * Hq * T * D, 1, 1), "threadgroup": (D, 1, 1)}


def attention_window(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Attention of T <= 8 query rows over the cache, on a GPU, one call (a view longer than
    SPLIT_CELLS: a call in splits and their combine).

    Args:
        q: (B, Hq, T, D), the rows at the last T cells of the cache view.
        keys, values: (B, Hkv, L, D): every cell up to the window's end (a view is fine).
        scale: the score scale (D^-0.5).

    Returns:
        (B, T, Hq, D) in q's dtype; float32 throughout inside.
    """
    B, Hq, T, _ = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    inputs = [step_dims(B, Hq, Hkv, T, L), constant(scale), q, keys, values]
    return _call(inputs, [], (f"strata_attention_window_v3_w{WARPS}", "strata_attention_split_v1",
                              "strata_attention_combine_v1"), (SOURCE, SPLIT_SOURCE, COMBINE_SOURCE))


def _call(inputs: list, extra: list[str], names: tuple[str, str, str], sources: tuple[str, str, str]) -> mx.array:
    """The single kernel over `inputs` (dims, scale, q, keys, values, then the `extra` ones), or
    past SPLIT_CELLS the split kernel and the combine (dims, the parts, the extra inputs):
    `names` and `sources` of the three, in that order (the split ones' names gain WARPS and SPLIT)."""
    q, keys, values = inputs[2:5]
    B, Hq, T, D = q.shape
    S = splits(keys.shape[2])
    params = ["dims", "scale", "q", "keys", "values", *extra]
    # The dtypes are template values too (MLX caches a compile by name and template alone).
    template = [("DH", D), ("TQ", q.dtype), ("TK", keys.dtype), ("TV", values.dtype)]
    if S == 1:
        kernel = gpu_kernel(names[0], params, ["out"], sources[0], header(), ensure_row_contiguous=False)
        (out,) = kernel(inputs=inputs, template=template, output_shapes=[(B, T, Hq, D)], output_dtypes=[q.dtype],
                        **launch(B, Hq, T))
        return out
    tag = f"w{WARPS}_c{SPLIT_CELLS}"
    kernel = gpu_kernel(f"{names[1]}_{tag}", params, ["out"], sources[1], split_header(), ensure_row_contiguous=False)
    (parts,) = kernel(inputs=inputs, template=template, output_shapes=[(B * Hq * T, S, D + 2)],
                      output_dtypes=[mx.float32], **launch(B, Hq, T, S))
    combine = gpu_kernel(f"{names[2]}_{tag}", ["dims", "parts", *extra], ["out"], sources[2], split_header())
    (out,) = combine(inputs=[inputs[0], parts, *inputs[5:]], template=[("DH", D), ("TQ", q.dtype)],
                     output_shapes=[(B, T, Hq, D)], output_dtypes=[q.dtype], **combine_launch(B, Hq, T, D))
    return out


def reference_attention_window(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """What `attention_window` computes, in plain MLX: each row alone over the cells it sees
    (0..L-T+t), serial decoding's sdpa call. Shapes as `attention_window`'s: (B, T, Hq, D)."""
    T = q.shape[2]
    L = keys.shape[2] - T
    rows = [mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], keys[:, :, : L + t + 1],
                                                 values[:, :, : L + t + 1], scale=scale) for t in range(T)]
    out = rows[0] if T == 1 else mx.concatenate(rows, axis=2)
    return out.transpose(0, 2, 1, 3)


_probe = Probe("attention window kernel", "decode windows attend row by row with MLX's sdpa")


def usable(dtype=None) -> bool:
    """True on a GPU (CUDA, Metal) once the kernel matched the reference and was row-invariant
    on a probe at `dtype` (None: every probe case; once per process, or kept: probe.Probe);
    False elsewhere or after any failure (logged once)."""
    return _probe.usable(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(B: int, Hq: int, Hkv: int, D: int, L: int, *, capacity: int = 0, dtype=mx.float32, seed: int = 0):
    """Random q (B, Hq, 8, D) and keys, values (B, Hkv, L, D); with `capacity` > L the keys and
    values are views of a larger buffer, as the KV cache hands them over."""
    keys_ = mx.random.split(mx.random.key(seed), 3)
    cells = max(capacity, L)
    q = mx.random.normal((B, Hq, 8, D), key=keys_[0]).astype(dtype)
    k = mx.random.normal((B, Hkv, cells, D), key=keys_[1]).astype(dtype)
    v = mx.random.normal((B, Hkv, cells, D), key=keys_[2]).astype(dtype)
    return q, k[:, :, :L], v[:, :, :L]


# (D, dtype, Hq, L); Hkv 2. With SPLIT_CELLS at 1,024, the 1-row calls of rows 0-3 at L = 1,028
# see at most SPLIT_CELLS cells (one kernel) and those of rows 4-7 more (splits), as does the
# 8-row call.
PROBE_CASES = ((64, mx.float32, 4, 300), (256, mx.bfloat16, 16, 1028))


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for T = 8 (and 3), each row
    equals its 1-row call over the cells it sees, bit for bit, and the reference within tolerance."""
    for D, dtype, Hq, L in (cases if dtypes is None else cases_at(cases, dtypes)):
        q, keys, values = probe_inputs(1, Hq, 2, D, L, capacity=L + 256, dtype=dtype)
        scale = D**-0.5
        alone = [attention_window(q[:, :, t : t + 1], keys[:, :, : L - 8 + t + 1], values[:, :, : L - 8 + t + 1],
                                  scale) for t in range(8)]
        together = attention_window(q, keys, values, scale)
        three = attention_window(q[:, :, 5:], keys, values, scale)
        expected = reference_attention_window(q, keys, values, scale)
        mx.eval(alone, together, three, expected)
        alone = mx.concatenate(alone, axis=1)
        if not (mx.array_equal(together, alone).item() and mx.array_equal(three, alone[:, 5:]).item()):
            return f"attention_window rows differ with the row count (D={D}, {dtype})"
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        if not mx.allclose(together.astype(mx.float32), expected.astype(mx.float32), rtol=tol, atol=tol).item():
            return f"attention_window and reference disagree (D={D}, {dtype})"
    return None


# -- the same kernel with attention sinks and a sliding window kept as a ring (GPT-OSS) ----------
#
# Built from SOURCE by a few exact replacements, so the plain kernel above stays byte for byte
# what its probe has passed. dims gains pos0 and W: with W > 0 the cache view is a ring of L
# cells (engine/sliding_state.py) and row t, at position pos = pos0 + t, sees the cells whose
# position is among its last min(W, pos + 1): cell j holds the position pos - ((pos - j) mod L).
# Every row then walks all L cells in the plain kernel's order, the cells it does not see
# scored NEG_BIG and weighted exactly 0, so its arithmetic depends on its position and the ring
# alone (serial decoding makes the same call). With W = 0 row t sees cells 0..L-T+t as above.
# A sink (sinks[h], a raw logit) joins each row's softmax in the warps' combine, and its weight
# is dropped. dims: B, Hq, Hkv, T, L, pos0, W (pos0 only matters modulo L once it is >= L).
_SINK_EDITS = (
    ("const int Hq = dims[1], Hkv = dims[2], T = dims[3], L = dims[4];",
     "const int Hq = dims[1], Hkv = dims[2], T = dims[3], L = dims[4], W = dims[6];"),
    ("    const int n = L - T + t + 1;\n",
     "    const int pos = dims[5] + t;\n"
     "    const bool is_ring = W > 0;\n"
     "    const int n = is_ring ? L : L - T + t + 1;\n"
     "    const int seen = W < pos + 1 ? W : pos + 1;\n"),
    ("        float s = NEG_BIG;\n        if (j0 + lane < n) {\n",
     "        float s = NEG_BIG;\n"
     "        bool valid = j0 + lane < n;\n"
     "        if (valid && is_ring) {\n"
     "            int back = (pos - (j0 + lane)) % L;\n"
     "            valid = (back < 0 ? back + L : back) < seen;\n"
     "        }\n"
     "        if (valid) {\n"),
    ("        p_s[warp][lane] = expf(s - m_new);\n",
     "        p_s[warp][lane] = valid ? expf(s - m_new) : 0.0f;\n"),
    ("    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, m_s[w]);\n",
     "    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, m_s[w]);\n"
     "    const float sink = static_cast<float>(sinks[h]);\n"
     "    M = fmaxf(M, sink);\n"),
    ("        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);\n",
     "        total += expf(sink - M);\n"
     "        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);\n"),
)


def with_sinks(source: str) -> str:
    return _edited(source, _SINK_EDITS)


SINK_SOURCE = with_sinks(SOURCE)
# Long views with sinks, in splits as above: a split's max takes the sink in (so a lone split's
# weights are the single kernel's), its sum leaves the sink's weight out, and the combine adds
# that weight once, last, as SINK_SOURCE adds it after the warps. A ring's rows walk all L cells.
SINK_SPLIT_SOURCE = _edited(SINK_SOURCE, (
    _SPLIT_EDITS[0],
    ("    const int n = is_ring ? L : L - T + t + 1;\n",
     "    const int n = is_ring ? L : L - T + t + 1;\n" + _SPLIT_EDITS[1][1].split("\n", 1)[1]),
    *_SPLIT_EDITS[2:],
    ("        total += expf(sink - M);\n", ""),
))
SINK_COMBINE_SOURCE = _edited(COMBINE_SOURCE, (
    ("    const int n = L - T + t + 1, splits", "    const int n = dims[6] > 0 ? L : L - T + t + 1, splits"),
    ("    for (int d = thread_x; d < DH; d += block_dim) {\n",
     "    const float sink = static_cast<float>(sinks[h]);  // in every split's max already\n"
     "    for (int d = thread_x; d < DH; d += block_dim) {\n"),
    ("        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);\n",
     "        total += expf(sink - M);\n"
     "        out[((static_cast<size_t>(b) * T + t) * Hq + h) * DH + d] = static_cast<TQ>(o / total);\n"),
))
_zero_sinks: dict[tuple[int, mx.Dtype], mx.array] = {}


def ring_position(pos0: int, L: int, window: int) -> int:
    """pos0 as the kernel needs it: exact below L, else L + pos0 mod L (the same cells and the
    same full window), so the shapes-as-data cache stays bounded; 0 without a window (unread)."""
    if not window:
        return 0
    return pos0 if pos0 < L else L + pos0 % L


def sink_attention_window(q: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: mx.array, *,
                          pos0: int = 0, window: int = 0) -> mx.array:
    """`attention_window` with a sink logit per query head, and (window > 0) a ring window.

    Args:
        q: (B, Hq, T, D), rows at positions pos0..pos0+T-1.
        keys, values: (B, Hkv, L, D): the cache cells up to the window's end, or (window > 0)
            the whole ring of L cells (position q in cell q % L).
        scale: the score scale.
        sinks: (Hq,) raw logits.
        pos0: the first row's position (read only with a window).
        window: W, the positions a row sees counting itself; 0 for full attention.

    Returns:
        (B, T, Hq, D) in q's dtype.
    """
    B, Hq, T, _ = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    sizes = step_dims(B, Hq, Hkv, T, L, ring_position(pos0, L, window), window)
    return _call([sizes, constant(scale), q, keys, values, sinks], ["sinks"],
                 (f"strata_attention_window_sinks_v2_w{WARPS}", "strata_attention_split_sinks_v1",
                  "strata_attention_combine_sinks_v1"), (SINK_SOURCE, SINK_SPLIT_SOURCE, SINK_COMBINE_SOURCE))


def ring_mask(pos0: int, T: int, L: int, window: int) -> mx.array:
    """(T, L) bool: the ring cells each row sees (engine/sliding_state.py's rule)."""
    import numpy as np

    p = np.arange(pos0, pos0 + T)[:, None]
    back = (p - np.arange(L)[None, :]) % L
    return mx.array(back < np.minimum(window, p + 1))


def reference_sink_attention_window(q: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: mx.array, *,
                                    mask: mx.array | None = None) -> mx.array:
    """What `sink_attention_window` computes, in plain MLX: each row alone, serial decoding's sdpa
    call with the sinks; `mask` (T, L) the ring cells each row sees (None: row t sees cells
    0..L-T+t). (B, T, Hq, D)."""
    T = q.shape[2]
    rows = []
    for t in range(T):
        if mask is None:
            seen = keys.shape[2] - T + t + 1
            k, v, m = keys[:, :, :seen], values[:, :, :seen], None
        else:
            k, v, m = keys, values, mask[t : t + 1]
        rows.append(mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], k, v, scale=scale, sinks=sinks, mask=m))
    out = rows[0] if T == 1 else mx.concatenate(rows, axis=2)
    return out.transpose(0, 2, 1, 3)


_sink_probe = Probe("attention window kernel with sinks", "GPT-OSS decode windows attend row by row with MLX's sdpa")


def sinks_usable(dtype=None) -> bool:
    """True on a GPU once the sink kernel matched its reference and was row-invariant on a probe
    at `dtype` (full attention and a wrapped ring; once per process, or kept: probe.Probe)."""
    return _sink_probe.usable(check_sinks, dtype)


def sinks_status() -> dict:
    return _sink_probe.status()


# (D, dtype, Hq, L, W); the 1,028-cell case runs both paths and the threshold with splits of
# 1,024 (as PROBE_CASES')
SINK_PROBE_CASES = ((64, mx.float32, 8, 300, 0), (64, mx.bfloat16, 8, 135, 128), (64, mx.float32, 4, 15, 8),
                    (64, mx.bfloat16, 8, 1028, 0))


def check_sinks(cases=SINK_PROBE_CASES, dtypes=None) -> str | None:
    """None when the sink kernel passes here, else what failed: for T = 8 and 3, each row equals
    its 1-row call bit for bit (over the same ring, at every row's position), and the reference
    within tolerance; (D, dtype, Hq, L, W): W > 0 a ring of L cells at a position that wraps it."""
    for D, dtype, Hq, L, W in (cases if dtypes is None else cases_at(cases, dtypes)):
        q, keys, values = probe_inputs(1, Hq, 2, D, L, dtype=dtype)
        sinks = mx.random.normal((Hq,), key=mx.random.key(5)).astype(dtype)
        scale = D**-0.5
        pos0 = 3 * L + 5 if W else L - 8
        if W:
            alone = [sink_attention_window(q[:, :, t : t + 1], keys, values, scale, sinks, pos0=pos0 + t, window=W)
                     for t in range(8)]
            three = sink_attention_window(q[:, :, 5:], keys, values, scale, sinks, pos0=pos0 + 5, window=W)
            mask = ring_mask(pos0, 8, L, W)
        else:
            alone = [sink_attention_window(q[:, :, t : t + 1], keys[:, :, : L - 8 + t + 1],
                                           values[:, :, : L - 8 + t + 1], scale, sinks) for t in range(8)]
            three = sink_attention_window(q[:, :, 5:], keys, values, scale, sinks)
            mask = None
        together = sink_attention_window(q, keys, values, scale, sinks, pos0=pos0, window=W)
        expected = reference_sink_attention_window(q, keys, values, scale, sinks, mask=mask)
        mx.eval(alone, together, three, expected)
        alone = mx.concatenate(alone, axis=1)
        if not (mx.array_equal(together, alone).item() and mx.array_equal(three, alone[:, 5:]).item()):
            return f"sink_attention_window rows differ with the row count (D={D}, {dtype}, W={W})"
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        if not mx.allclose(together.astype(mx.float32), expected.astype(mx.float32), rtol=tol, atol=tol).item():
            return f"sink_attention_window and reference disagree (D={D}, {dtype}, W={W})"
    return None
