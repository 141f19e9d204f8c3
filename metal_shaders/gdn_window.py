"""The GDN decode window in two kernels: `gdn_prepare` (causal conv, silu, l2norm, gating) and
`gdn_scan` (the gated delta rule over the window's rows).

Legend: B batch, T rows (<= 8 in a decode window), Hk/Hv key/value heads (Hv a multiple of Hk;
value head h reads key head h // (Hv/Hk)), Dk/Dv head dims, C = 2·Hk·Dk + Hv·Dv conv channels,
K the conv kernel.

On the H200 a GDN layer's decode window is ~37 tiny MLX ops between its projections, each ~10 µs;
these two calls replace them. Both are row-invariant: a row's arithmetic is a function of that
row's inputs and the shapes, never of T, so a T-row call gives the bits of T chained 1-row calls
(what lossless speculation needs) — every sum runs in one fixed order: `gdn_scan` sums over Dk
in SCAN_SPLIT parts, each in order, joined by a xor butterfly; `gdn_prepare` sums a head's
squares lane-sequentially and then over a fixed xor butterfly of warp shuffles.

One body per kernel for CUDA and Metal (backends.py); `reference_*` (pure MLX) is what the CPU
runs and what the tests hold the kernels to; `usable()` probes the kernels once on the running
device.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .probe import PROBE_DTYPES, Probe, dims, gpu_kernel

L2_EPS = 1e-6  # the reference's l2norm epsilon, added to sum(x^2)
MAX_HEAD_DIM = 256  # gdn_scan keeps Dk / SCAN_SPLIT floats of a state column in registers
THREADS = 128

# SCAN_SPLIT threads per (batch b, value head h, state column j): thread `part` holds rows
# part·DK/SCAN_SPLIT ... of column j of S in registers (a whole column of 128 spilled at 255
# registers, and 32 blocks left most SMs idle) and runs every row in order, with fused
# multiply-adds over its rows in order; each row's two sums over Dk (S^T k and S^T q) add the
# parts' partial sums by the xor butterfly over the SCAN_SPLIT lanes (offsets 1, 2: every lane
# ends with the same bits, a + b being b + a). The order is a function of Dk alone.
# dims: B, T, Hk, Hv, Dv.
SCAN_SPLIT = 4
SCAN = """
    constexpr int PART_ROWS = DK / SCAN_SPLIT;
    const int B = dims[0], T = dims[1], Hk = dims[2], Hv = dims[3], Dv = dims[4];
    const int gid = block_x * block_dim + thread_x;
    const int part = gid % SCAN_SPLIT, column = gid / SCAN_SPLIT;
    if (column >= B * Hv * Dv) return;  // whole warps only: B·Hv·Dv·SCAN_SPLIT is a multiple of 32
    const int j = column % Dv, h = (column / Dv) % Hv, b = column / (Dv * Hv);
    const int kh = h / (Hv / Hk), i0 = part * PART_ROWS;
    float s[PART_ROWS];
    const size_t s0 = static_cast<size_t>(b * Hv + h) * DK * Dv + j;
    #pragma unroll
    for (int i = 0; i < PART_ROWS; ++i) s[i] = S[s0 + static_cast<size_t>(i0 + i) * Dv];
    for (int t = 0; t < T; ++t) {
        const size_t bth = static_cast<size_t>(b * T + t) * Hv + h;
        const size_t qk0 = (static_cast<size_t>(b * T + t) * Hk + kh) * DK + i0;
        const float decay = expf(g[bth]);
        float memory = 0.0f;
        #pragma unroll
        for (int i = 0; i < PART_ROWS; ++i) {
            s[i] *= decay;
            memory = fmaf(s[i], k[qk0 + i], memory);
        }
        #pragma unroll
        for (int off = 1; off < SCAN_SPLIT; off <<= 1) memory += strata_xor(memory, off);
        const float delta = (v[bth * Dv + j] - memory) * beta[bth];
        float out = 0.0f;
        #pragma unroll
        for (int i = 0; i < PART_ROWS; ++i) {
            s[i] = fmaf(k[qk0 + i], delta, s[i]);
            out = fmaf(s[i], q[qk0 + i], out);
        }
        #pragma unroll
        for (int off = 1; off < SCAN_SPLIT; off <<= 1) out += strata_xor(out, off);
        if (part == 0) y[bth * Dv + j] = out;
    }
    #pragma unroll
    for (int i = 0; i < PART_ROWS; ++i) S_out[s0 + static_cast<size_t>(i0 + i) * Dv] = s[i];
""".replace("SCAN_SPLIT", str(SCAN_SPLIT))

# One warp per (b, t, segment); segments: Hk query heads, Hk key heads, Hv value heads. Lane l
# takes channels l, l+32, ... of its head: conv over the K window rows (float32 fused
# multiply-adds, j = 0..K-1), silu; a query/key head is l2-normalised (squares summed in the
# lane's channel order, then the xor butterfly: every lane ends with the same bits), the query
# also times Dk^-0.5. A value head's lane 0 writes that head's g and beta. The conv reads the
# committed history (B, K-1, C) and the window's raw inputs (B, T, C) where they are, and the call
# writes them joined (window_out, (B, K-1+T, C): the conv state's next history is a slice of it):
# the lane of row t and channel c copies raw row t's channel c, and at t = 0 the history's.
# dims: B, T, Hk, Hv, Dk, Dv, K; K is compiled in too (KS: a lane holds its taps, loaded ahead).
PREPARE = """
    const int B = dims[0], T = dims[1], Hk = dims[2], Hv = dims[3], Dk = dims[4], Dv = dims[5];
    const int C = 2 * Hk * Dk + Hv * Dv, H = KS - 1, W = H + T;
    const int lane = thread_x & 31;
    const int warp = (block_x * block_dim + thread_x) >> 5;
    const int segments = 2 * Hk + Hv;
    if (warp >= B * T * segments) return;
    const int seg = warp % segments, t = (warp / segments) % T, b = warp / (segments * T);
    const bool is_value = seg >= 2 * Hk;
    const int D = is_value ? Dv : Dk;
    const int c0 = is_value ? 2 * Hk * Dk + (seg - 2 * Hk) * Dv : seg * Dk;
    const size_t bt = static_cast<size_t>(b) * T + t;
    const int h = seg - 2 * Hk;
    // every load before the first store: the outputs may alias the inputs as far as the compiler
    // knows, so each load after a store would be its own trip to memory. Tap j of row t reads
    // joined row t + j: the history's rows first, then the window's raw rows.
    TX xin[PER][KS];
    float wk[PER][KS];
    #pragma unroll
    for (int m = 0; m < PER; ++m) {
        const int c = c0 + lane + 32 * m;
        if (lane + 32 * m < D) {
            #pragma unroll
            for (int j = 0; j < KS; ++j) {
                const int r = t + j;
                xin[m][j] = r < H ? history[(static_cast<size_t>(b) * H + r) * C + c]
                                  : raw[(static_cast<size_t>(b) * T + r - H) * C + c];
                wk[m][j] = static_cast<float>(conv_weight[static_cast<size_t>(c) * KS + j]);
            }
        }
    }
    float a_in = 0.0f, bias = 0.0f, a_log = 0.0f, b_gate = 0.0f;
    if (is_value && lane == 0) {
        a_in = static_cast<float>(a[bt * Hv + h]);
        bias = static_cast<float>(dt_bias[h]);
        a_log = static_cast<float>(A_log[h]);
        b_gate = static_cast<float>(b_in[bt * Hv + h]);
    }
    float x[PER];
    float squares = 0.0f;
    #pragma unroll
    for (int m = 0; m < PER; ++m) {
        const int c = c0 + lane + 32 * m;
        float acc = 0.0f;
        if (lane + 32 * m < D) {
            #pragma unroll
            for (int j = 0; j < KS; ++j) acc = fmaf(static_cast<float>(xin[m][j]), wk[m][j], acc);
            acc = acc / (1.0f + expf(-acc));
            window_out[(static_cast<size_t>(b) * W + H + t) * C + c] = xin[m][KS - 1];  // raw row t
            if (t == 0)
                #pragma unroll
                for (int r = 0; r < H; ++r) window_out[(static_cast<size_t>(b) * W + r) * C + c] = xin[m][r];
        }
        x[m] = acc;
        squares = fmaf(acc, acc, squares);
    }
    if (is_value) {
        #pragma unroll
        for (int m = 0; m < PER; ++m)
            if (lane + 32 * m < D) v_out[(bt * Hv + h) * Dv + lane + 32 * m] = x[m];
        if (lane == 0) {
            // softplus as MLX's logaddexp(x, 0); sigmoid as MLX's (exp of -|x| only)
            const float u = a_in + bias;
            const float softplus = fmaxf(u, 0.0f) + log1pf(expf(-fabsf(u)));
            g_out[bt * Hv + h] = -expf(a_log) * softplus;
            const float sig = 1.0f / (1.0f + expf(-fabsf(b_gate)));
            beta_out[bt * Hv + h] = b_gate < 0.0f ? 1.0f - sig : sig;
        }
        return;
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) squares += strata_xor(squares, off);
    const bool is_query = seg < Hk;
    const float inv = rsqrtf(squares + L2_EPS_F) * (is_query ? 1.0f / sqrtf(static_cast<float>(Dk)) : 1.0f);
    auto out = is_query ? q_out : k_out;
    const int kh = is_query ? seg : seg - Hk;
    #pragma unroll
    for (int m = 0; m < PER; ++m)
        if (lane + 32 * m < D) out[(bt * Hk + kh) * Dk + lane + 32 * m] = x[m] * inv;
"""
HEADER = f"#define L2_EPS_F {L2_EPS!r}f\n"

def supports(head_k_dim: int, head_v_dim: int) -> bool:
    """Head dims the kernels take: multiples of 32, at most 256."""
    return all(d % 32 == 0 and 0 < d <= MAX_HEAD_DIM for d in (head_k_dim, head_v_dim))


def scan_launch(B: int, Hv: int, Dv: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block of one `gdn_scan` call:
    SCAN_SPLIT threads a state column."""
    blocks = -(-(B * Hv * Dv * SCAN_SPLIT) // THREADS)
    return {"grid": (blocks * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def prepare_launch(B: int, T: int, Hk: int, Hv: int) -> dict:
    """Grid and block of one `gdn_prepare` call: a warp per (b, t, head segment)."""
    warps = B * T * (2 * Hk + Hv)
    blocks = -(-warps // (THREADS // 32))
    return {"grid": (blocks * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def gdn_scan(q, k, v, g, beta, S) -> tuple[mx.array, mx.array]:
    """The gated delta rule over T rows on a GPU; all float32.

    Args:
        q, k: (B, T, Hk, Dk), l2-normalised (q also scaled by Dk^-0.5).
        v: (B, T, Hv, Dv).
        g, beta: (B, T, Hv): log decay and write strength.
        S: (B, Hv, Dk, Dv), the state before the first row.

    Returns:
        y (B, T, Hv, Dv) and the state after the last row.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    kernel = gpu_kernel("strata_gdn_scan_v3", ["dims", "q", "k", "v", "g", "beta", "S"], ["y", "S_out"], SCAN,
                         HEADER)
    config = scan_launch(B, Hv, Dv)
    # The dtypes are template values too (MLX caches a compile by name and template alone).
    template = [("DK", Dk), *((f"T{i}", a.dtype) for i, a in enumerate((q, k, v, g, beta, S)))]
    y, S_out = kernel(inputs=[dims(B, T, Hk, Hv, Dv), q, k, v, g, beta, S], template=template,
                      output_shapes=[(B, T, Hv, Dv), (B, Hv, Dk, Dv)], output_dtypes=[mx.float32] * 2, **config)
    return y, S_out


PREPARE_INPUTS = ["dims", "history", "raw", "conv_weight", "a", "b_in", "A_log", "dt_bias"]
PREPARE_OUTPUTS = ["q_out", "k_out", "v_out", "g_out", "beta_out", "window_out"]


def gdn_prepare(history, raw, conv_weight, a, b, A_log, dt_bias, *, num_k_heads: int, head_k_dim: int):
    """Causal conv + silu + l2norm + scale + gating of a window's rows, on a GPU, in float32.

    Args:
        history: (B, K-1, C) the committed raw conv inputs; raw: (B, T, C) the window's (model dtype).
        conv_weight: (C, K). a, b: (B, T, Hv). A_log, dt_bias: (Hv,).

    Returns:
        q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv), all float32; and the window
        (B, K-1+T, C): history and raw joined, in raw's dtype (what a concatenate gives).
    """
    B, T, C = raw.shape
    K = conv_weight.shape[1]
    Hv = a.shape[2]
    Hk, Dk = num_k_heads, head_k_dim
    Dv = (C - 2 * Hk * Dk) // Hv
    if history.shape != (B, K - 1, C) or history.dtype != raw.dtype:
        raise ValueError(f"gdn_prepare: history {history.shape} {history.dtype} does not go with raw {raw.shape} "
                         f"{raw.dtype} and a {K}-tap conv")
    kernel = gpu_kernel("strata_gdn_prepare_v4", PREPARE_INPUTS, PREPARE_OUTPUTS, PREPARE, HEADER)
    # Every input dtype is a template value: MLX names (and caches) a compile by these alone.
    template = [("TX", raw.dtype), ("TW", conv_weight.dtype), ("TA", a.dtype), ("TB", b.dtype),
                ("TL", A_log.dtype), ("TD", dt_bias.dtype), ("PER", max(Dk, Dv) // 32), ("KS", K)]
    outputs = kernel(inputs=[dims(B, T, Hk, Hv, Dk, Dv, K), history, raw, conv_weight, a, b, A_log, dt_bias],
                     template=template, output_dtypes=[mx.float32] * 5 + [raw.dtype],
                     output_shapes=[(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv),
                                    (B, K - 1 + T, C)],
                     **prepare_launch(B, T, Hk, Hv))
    return tuple(outputs)


def reference_l2_normalize(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    return x32 * mx.rsqrt((x32 * x32).sum(axis=-1, keepdims=True) + L2_EPS)


def reference_causal_conv(window: mx.array, weight: mx.array) -> mx.array:
    """Depthwise causal conv: (B, K-1+T, C) history-prefixed inputs, weight (C, K) -> (B, T, C).
    Elementwise, so exact for any T."""
    K = weight.shape[1]
    T = window.shape[1] - (K - 1)
    out = window[:, 0:T] * weight[:, 0]
    for j in range(1, K):
        out = out + window[:, j : j + T] * weight[:, j]
    return out


def reference_prepare(window, conv_weight, a, b, A_log, dt_bias, *, num_k_heads: int, head_k_dim: int):
    """What `gdn_prepare` computes, in plain MLX: the CPU's path (model/gdn.py), so these are the
    ops serial decoding runs. The conv and silu run in the model dtype (the kernel keeps
    float32 throughout: in bfloat16 the two differ by the conv's rounding)."""
    B, _, C = window.shape
    T, Hv = a.shape[1], a.shape[2]
    Hk, Dk = num_k_heads, head_k_dim
    mixed = nn.silu(reference_causal_conv(window, conv_weight))
    q, k, v = mx.split(mixed, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q = reference_l2_normalize(q.reshape(B, T, Hk, Dk)) * Dk**-0.5
    k = reference_l2_normalize(k.reshape(B, T, Hk, Dk))
    v = v.reshape(B, T, Hv, -1).astype(mx.float32)
    beta = mx.sigmoid(b.astype(mx.float32))
    g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias.astype(mx.float32))
    return q, k, v, g, beta


def reference_scan(q, k, v, g, beta, S) -> tuple[mx.array, mx.array]:
    """What `gdn_scan` computes, one row at a time in plain MLX (float32).

    Per row: S = S·exp(g); S += k ⊗ (v - Sᵀk)·β; y = Sᵀq. Folding kept rows repeats exactly these
    operations, which is why a fold reproduces serial decoding.
    """
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    decay = mx.exp(g)
    outputs = []
    for t in range(q.shape[1]):
        k_t = k[:, t, :, :, None]  # (B, Hv, Dk, 1)
        S = S * decay[:, t, :, None, None]
        memory = (S * k_t).sum(axis=-2)  # (B, Hv, Dv)
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        S = S + k_t * delta[:, :, None, :]
        outputs.append((S * q[:, t, :, :, None]).sum(axis=-2))
    return mx.stack(outputs, axis=1), S


_probe = Probe("GDN window kernels", "GDN decode windows run as MLX ops")


def usable(dtype=None) -> bool:
    """True on a GPU (CUDA, Metal) once both kernels matched the reference and were row-invariant
    on a probe at `dtype` (None: float32 and bfloat16; once per process, or kept: probe.Probe);
    False elsewhere or after any failure (logged once)."""
    return _probe.usable(check, dtype)


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def check(dtypes=PROBE_DTYPES) -> str | None:
    """None when the kernels pass on this device, else what failed."""
    B, T, Hk, Hv, Dk, Dv, K = 1, 8, 2, 4, 64, 64, 4
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(21), 6)
    for dtype in dtypes:
        window = mx.random.normal((B, K - 1 + T, C), key=keys[0]).astype(dtype)
        weight = (mx.random.normal((C, K), key=keys[1]) * 0.5).astype(dtype)
        a, b = (mx.random.normal((B, T, Hv), key=key).astype(dtype) for key in keys[2:4])
        A_log, dt_bias = mx.random.uniform(-1, 1, (Hv,), key=keys[4]), mx.random.uniform(0, 1, (Hv,), key=keys[5])
        heads = {"num_k_heads": Hk, "head_k_dim": Dk}
        *together, joined = gdn_prepare(window[:, : K - 1], window[:, K - 1 :], weight, a, b, A_log, dt_bias, **heads)
        alone = [gdn_prepare(window[:, t : t + K - 1], window[:, t + K - 1 : t + K], weight, a[:, t : t + 1],
                             b[:, t : t + 1], A_log, dt_bias, **heads)[:5] for t in range(T)]
        alone = [mx.concatenate(parts, axis=1) for parts in zip(*alone)]
        expected = reference_prepare(window, weight, a, b, A_log, dt_bias, **heads)
        mx.eval(together, joined, alone, expected)
        if not all(mx.array_equal(x, y).item() for x, y in zip(together, alone)):
            return f"gdn_prepare rows differ with the row count ({dtype})"
        tol = 1e-5 if dtype == mx.float32 else 2e-2  # the reference's conv rounds to bfloat16
        if not all(mx.allclose(x, y, rtol=tol, atol=tol).item() for x, y in zip(together, expected)):
            return f"gdn_prepare and reference disagree ({dtype})"
        if not (joined.dtype == window.dtype and mx.array_equal(joined, window).item()):
            return f"gdn_prepare's joined window is not its history and rows ({dtype})"
    q, k, v, g, beta = together
    S = mx.random.normal((B, Hv, Dk, Dv), key=keys[0]) * 0.1
    y, S_final = gdn_scan(q, k, v, g, beta, S)
    ys, S_chain = [], S
    for t in range(T):
        y_t, S_chain = gdn_scan(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                beta[:, t : t + 1], S_chain)
        ys.append(y_t)
    y_ref, S_ref = reference_scan(q, k, v, g, beta, S)
    mx.eval(y, S_final, ys, S_chain, y_ref, S_ref)
    if not (mx.array_equal(y, mx.concatenate(ys, axis=1)).item() and mx.array_equal(S_final, S_chain).item()):
        return "gdn_scan rows differ with the row count"
    if not (mx.allclose(y, y_ref, rtol=1e-4, atol=1e-5).item() and mx.allclose(S_final, S_ref, rtol=1e-4, atol=1e-5).item()):
        return "gdn_scan and reference disagree"
    return None
