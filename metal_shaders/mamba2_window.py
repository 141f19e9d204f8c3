"""The Mamba-2 decode window in two kernels: `mamba2_prepare` (causal conv with bias, silu, the
x / B / C split, dt's softplus and limits, the log decay dt·A) and `mamba2_scan` (the SSD
recurrence over the window's rows).

Legend: B batch, T rows (<= 8 in a decode window), H heads, P head dim, G groups (group g serves
heads g·H/G .. (g+1)·H/G - 1), N state size, C = H·P + 2·G·N conv channels, K the conv kernel.

Between its projections a Mamba-2 layer's decode window is ~20 small MLX ops of preparation and
~5 per row of scan, each ~10 µs of dispatch on a GPU; these two calls replace them. Both are
row-invariant: a row's arithmetic is a function of that row's inputs (and the state the rows
before it left) and the shapes, never of T, so a T-row call gives the bits of T chained 1-row
calls (what lossless speculation needs): `mamba2_scan` sums over N sequentially in one thread,
`mamba2_prepare` sums the conv over its K taps in order, one thread per value.

One body per kernel for CUDA and Metal (backends.py); `reference_*` (pure MLX) is what the CPU
runs (model/mamba2.py's decode path) and what the tests hold the kernels to; `usable()` probes
the kernels once on the running device.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .gdn_window import reference_causal_conv
from .probe import PROBE_DTYPES, Probe, constant, dims, gpu_kernel

MAX_STATE = 256  # mamba2_scan keeps a state row of N floats in registers
THREADS = 128

# One thread per (batch b, head h, head channel p): it holds row p of the head's state S (N
# floats) and runs every row in order: S = S·exp(g) + (dt·x) ⊗ B, y = S·C (fused multiply-adds
# over n = 0..N-1). dims: B, T, H, G, P.
SCAN = """
    const int B = dims[0], T = dims[1], H = dims[2], G = dims[3], P = dims[4];
    const int gid = block_x * block_dim + thread_x;
    if (gid >= B * H * P) return;
    const int p = gid % P, h = (gid / P) % H, b = gid / (P * H);
    const int grp = h / (H / G);
    float s[NS];
    const size_t s0 = (static_cast<size_t>(b * H + h) * P + p) * NS;
    #pragma unroll
    for (int n = 0; n < NS; ++n) s[n] = S[s0 + n];
    for (int t = 0; t < T; ++t) {
        const size_t bth = static_cast<size_t>(b * T + t) * H + h;
        const size_t bc0 = (static_cast<size_t>(b * T + t) * G + grp) * NS;
        const float decay = expf(g[bth]);
        const float xdt = x[bth * P + p] * dt[bth];
        float out = 0.0f;
        #pragma unroll
        for (int n = 0; n < NS; ++n) {
            s[n] = fmaf(xdt, Bm[bc0 + n], s[n] * decay);
            out = fmaf(s[n], Cm[bc0 + n], out);
        }
        y[bth * P + p] = out;
    }
    #pragma unroll
    for (int n = 0; n < NS; ++n) S_out[s0 + n] = s[n];
"""

# One thread per (b, t, conv channel c) and per (b, t, head h). A channel: conv over its K window
# rows (float32 fused multiply-adds, j = 0..K-1) plus the bias, silu, written to x, B or C. A
# head: dt = clip(softplus(dt + dt_bias), lo, hi) (softplus as MLX's logaddexp(u, 0)) and
# g = dt·(-exp(A_log)). The conv reads the committed history (B, K-1, C) and the window's raw
# rows (B, T, C) where they are, and the call writes them joined (window_out, (B, K-1+T, C)): the
# thread of row t and channel c copies raw row t's channel c, and at t = 0 the history's.
# dims: B, T, H, P, G, N, K; limits (lo, hi). K is compiled in too (KS: a thread holds its taps).
PREPARE = """
    const int B = dims[0], T = dims[1], H = dims[2], P = dims[3], G = dims[4], N = dims[5];
    const int HP = H * P, C = HP + 2 * G * N, HIST = KS - 1, W = HIST + T;
    const int gid = block_x * block_dim + thread_x;
    if (gid >= B * T * (C + H)) return;
    const int per_row = C + H;
    const int r = gid % per_row;
    const size_t bt = static_cast<size_t>(gid / per_row);
    const int t = static_cast<int>(bt % T), b = static_cast<int>(bt / T);
    // every load before the first store (the outputs may alias the inputs as far as the compiler
    // knows: a load after a store is its own trip to memory); tap j of row t reads joined row t + j
    if (r < C) {
        T0 xin[KS];
        float wk[KS];
        #pragma unroll
        for (int j = 0; j < KS; ++j) {
            const int row = t + j;
            xin[j] = row < HIST ? history[(static_cast<size_t>(b) * HIST + row) * C + r]
                                : raw[(static_cast<size_t>(b) * T + row - HIST) * C + r];
            wk[j] = static_cast<float>(conv_weight[static_cast<size_t>(r) * KS + j]);
        }
        const float bias = static_cast<float>(conv_bias[r]);
        float acc = 0.0f;
        #pragma unroll
        for (int j = 0; j < KS; ++j) acc = fmaf(static_cast<float>(xin[j]), wk[j], acc);
        window_out[(static_cast<size_t>(b) * W + HIST + t) * C + r] = xin[KS - 1];  // raw row t
        if (t == 0)
            #pragma unroll
            for (int row = 0; row < HIST; ++row) window_out[(static_cast<size_t>(b) * W + row) * C + r] = xin[row];
        acc = acc + bias;
        acc = acc / (1.0f + expf(-acc));
        if (r < HP) x_out[bt * HP + r] = acc;
        else if (r < HP + G * N) B_out[bt * G * N + (r - HP)] = acc;
        else C_out[bt * G * N + (r - HP - G * N)] = acc;
        return;
    }
    const int h = r - C;
    const float d_in = static_cast<float>(dt_in[bt * H + h]), d_bias = static_cast<float>(dt_bias[h]);
    const float a_log = static_cast<float>(A_log[h]);
    const float lo = limits[0], hi = limits[1];
    const float u = d_in + d_bias;
    float step = fmaxf(u, 0.0f) + log1pf(expf(-fabsf(u)));
    step = step < lo ? lo : step;
    step = step > hi ? hi : step;
    dt_out[bt * H + h] = step;
    g_out[bt * H + h] = step * -expf(a_log);
"""


def supports(state_size: int) -> bool:
    """State sizes the scan takes: 1..MAX_STATE (a state row lives in registers)."""
    return 0 < state_size <= MAX_STATE


def scan_launch(B: int, H: int, P: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block of one `mamba2_scan` call."""
    blocks = -(-(B * H * P) // THREADS)
    return {"grid": (blocks * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def prepare_launch(B: int, T: int, C: int, H: int) -> dict:
    """Grid and block of one `mamba2_prepare` call: a thread per (b, t, channel or head)."""
    blocks = -(-(B * T * (C + H)) // THREADS)
    return {"grid": (blocks * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def mamba2_scan(x, Bm, Cm, dt, g, S) -> tuple[mx.array, mx.array]:
    """The SSD recurrence over T rows on a GPU (without the D skip); all float32.

    Args:
        x: (B, T, H, P). Bm, Cm: (B, T, G, N). dt, g: (B, T, H): step and log decay (dt·A).
        S: (B, H, P, N), the state before the first row.

    Returns:
        y (B, T, H, P) and the state after the last row.
    """
    B, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    kernel = gpu_kernel("strata_mamba2_scan", ["dims", "x", "Bm", "Cm", "dt", "g", "S"], ["y", "S_out"], SCAN)
    # The dtypes are template values too (MLX caches a compile by name and template alone).
    template = [("NS", N), *((f"T{i}", a.dtype) for i, a in enumerate((x, Bm, Cm, dt, g, S)))]
    y, S_out = kernel(inputs=[dims(B, T, H, G, P), x, Bm, Cm, dt, g, S], template=template,
                      output_shapes=[(B, T, H, P), (B, H, P, N)], output_dtypes=[mx.float32] * 2,
                      **scan_launch(B, H, P))
    return y, S_out


PREPARE_INPUTS = ["dims", "history", "raw", "conv_weight", "conv_bias", "dt_in", "dt_bias", "A_log", "limits"]
PREPARE_OUTPUTS = ["x_out", "B_out", "C_out", "dt_out", "g_out", "window_out"]


def mamba2_prepare(history, raw, conv_weight, conv_bias, dt, dt_bias, A_log, *, num_heads: int, head_dim: int,
                   n_groups: int, state_size: int, dt_limits: tuple[float, float]):
    """Causal conv + bias + silu + split, and dt's softplus, limits and log decay of a window's
    rows, on a GPU, in float32.

    Args:
        history: (B, K-1, C) the committed raw conv inputs; raw: (B, T, C) the window's (model dtype).
        conv_weight: (C, K). conv_bias: (C,) or None. dt: (B, T, H) raw. dt_bias, A_log: (H,).
        dt_limits: (min, max) of dt after the softplus.

    Returns:
        x (B, T, H, P); Bm, Cm (B, T, G, N); dt, g (B, T, H), all float32; and the window
        (B, K-1+T, C): history and raw joined, in raw's dtype (what a concatenate gives).
    """
    B, T, C = raw.shape
    K = conv_weight.shape[1]
    H = dt.shape[2]
    P, G, N = head_dim, n_groups, state_size
    if history.shape != (B, K - 1, C) or history.dtype != raw.dtype:
        raise ValueError(f"mamba2_prepare: history {history.shape} {history.dtype} does not go with raw {raw.shape} "
                         f"{raw.dtype} and a {K}-tap conv")
    if conv_bias is None:
        conv_bias = _zero_bias(C)  # + 0 changes no value
    limits = constant(*dt_limits)
    kernel = gpu_kernel("strata_mamba2_prepare_v3", PREPARE_INPUTS, PREPARE_OUTPUTS, PREPARE)
    # Every input dtype is a template value: MLX names (and caches) a compile by these alone.
    template = [(f"T{i}", a.dtype) for i, a in enumerate((raw, conv_weight, conv_bias, dt, dt_bias, A_log))]
    template += [("KS", K)]
    outputs = kernel(inputs=[dims(B, T, H, P, G, N, K), history, raw, conv_weight, conv_bias, dt, dt_bias, A_log,
                             limits],
                     template=template, output_dtypes=[mx.float32] * 5 + [raw.dtype],
                     output_shapes=[(B, T, H, P), (B, T, G, N), (B, T, G, N), (B, T, H), (B, T, H), (B, K - 1 + T, C)],
                     **prepare_launch(B, T, C, H))
    return tuple(outputs)


@lru_cache(maxsize=None)
def _zero_bias(channels: int) -> mx.array:
    """The conv's bias where the model has none, made once per width (a decode step makes no new
    array for it)."""
    return mx.zeros((channels,), dtype=mx.float32)


def reference_prepare(window, conv_weight, conv_bias, dt, dt_bias, A_log, *, num_heads: int, head_dim: int,
                      n_groups: int, state_size: int, dt_limits: tuple[float, float]):
    """What `mamba2_prepare` computes, in plain MLX: the layer's own path off the kernels
    (model/mamba2.py, prompt chunks and the CPU). The conv, its bias and silu run in the model
    dtype (the kernel keeps float32 throughout: in bfloat16 the two differ by their rounding)."""
    B, _, C = window.shape
    T, H = dt.shape[1], dt.shape[2]
    P, G, N = head_dim, n_groups, state_size
    conv = reference_causal_conv(window, conv_weight)
    mixed = nn.silu(conv if conv_bias is None else conv + conv_bias)
    x, b, c = mx.split(mixed, [H * P, H * P + G * N], axis=-1)
    step = mx.clip(nn.softplus(dt.astype(mx.float32) + dt_bias.astype(mx.float32)), *dt_limits)
    A = -mx.exp(A_log.astype(mx.float32))
    return (x.reshape(B, T, H, P).astype(mx.float32), b.reshape(B, T, G, N).astype(mx.float32),
            c.reshape(B, T, G, N).astype(mx.float32), step, step * A)


def per_head(a: mx.array, heads: int) -> mx.array:
    """(B, T, G, N) -> (B, T, H, N): group g serves heads g·H/G .. (g+1)·H/G - 1."""
    return a if a.shape[2] == heads else mx.repeat(a, heads // a.shape[2], axis=2)


def reference_scan(x, Bm, Cm, dt, g, S) -> tuple[mx.array, mx.array]:
    """What `mamba2_scan` computes, one row at a time in plain MLX (float32): per row
    S = S·exp(g) + (dt·x) ⊗ B; y = S·C. Every op is elementwise or a sum over N of one row, so a
    row computes the same whatever the window's size, and folding kept rows repeats exactly these
    operations (which is why a fold reproduces serial decoding)."""
    H = x.shape[2]
    Bh, Ch = per_head(Bm, H), per_head(Cm, H)
    decay = mx.exp(g)  # (B, T, H)
    xdt = x * dt[..., None]  # (B, T, H, P)
    outputs = []
    for t in range(x.shape[1]):
        S = S * decay[:, t, :, None, None] + xdt[:, t, :, :, None] * Bh[:, t, :, None, :]
        outputs.append((S * Ch[:, t, :, None, :]).sum(axis=-1))  # (B, H, P)
    return mx.stack(outputs, axis=1), S


_probe = Probe("Mamba-2 window kernels", "Mamba-2 decode windows run as MLX ops")


def usable(dtype=None) -> bool:
    """True on a GPU (CUDA, Metal) once both kernels matched the reference and were row-invariant
    on a probe at `dtype` (None: float32 and bfloat16; once per process, or kept: probe.Probe);
    False elsewhere or after any failure (logged once)."""
    return _probe.usable(check, dtype)


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_inputs(B: int, T: int, H: int, P: int, G: int, N: int, *, K: int = 4, dtype=mx.float32, seed: int = 0):
    """Random prepare inputs (window, conv weight, conv bias, dt, dt_bias, A_log) for T rows:
    A = -exp(A_log) in about [-0.37, -0.02], dt after the softplus mostly 0.1-3."""
    C = H * P + 2 * G * N
    keys = mx.random.split(mx.random.key(seed), 6)
    return (mx.random.normal((B, K - 1 + T, C), key=keys[0]).astype(dtype),
            (mx.random.normal((C, K), key=keys[1]) * 0.5).astype(dtype),
            (mx.random.normal((C,), key=keys[2]) * 0.1).astype(dtype),
            mx.random.normal((B, T, H), key=keys[3]).astype(dtype),
            mx.random.uniform(-4, -1, (H,), key=keys[4]), mx.random.uniform(-1, 2, (H,), key=keys[5]))


def check(dtypes=PROBE_DTYPES) -> str | None:
    """None when the kernels pass on this device, else what failed."""
    B, T, H, P, G, N, K = 1, 8, 4, 32, 2, 64, 4
    shapes = {"num_heads": H, "head_dim": P, "n_groups": G, "state_size": N, "dt_limits": (0.001, float("inf"))}
    for dtype in dtypes:
        window, weight, bias, dt, dt_bias, A_log = probe_inputs(B, T, H, P, G, N, K=K, dtype=dtype, seed=21)
        *together, joined = mamba2_prepare(window[:, : K - 1], window[:, K - 1 :], weight, bias, dt, dt_bias, A_log,
                                           **shapes)
        alone = [mamba2_prepare(window[:, t : t + K - 1], window[:, t + K - 1 : t + K], weight, bias, dt[:, t : t + 1],
                                dt_bias, A_log, **shapes)[:5] for t in range(T)]
        alone = [mx.concatenate(parts, axis=1) for parts in zip(*alone)]
        # The kernel reads the inputs' values and computes in float32: so is the reference here
        # (in the model dtype its conv would round to it, 3e-2 off in bfloat16).
        as_float32 = [a.astype(mx.float32) for a in (window, weight, bias, dt, dt_bias, A_log)]
        expected = reference_prepare(*as_float32, **shapes)
        mx.eval(together, joined, alone, expected)
        if not all(mx.array_equal(x, y).item() for x, y in zip(together, alone)):
            return f"mamba2_prepare rows differ with the row count ({dtype})"
        if not all(mx.allclose(x, y, rtol=1e-5, atol=1e-5).item() for x, y in zip(together, expected)):
            return f"mamba2_prepare and reference disagree ({dtype})"
        if not (joined.dtype == window.dtype and mx.array_equal(joined, window).item()):
            return f"mamba2_prepare's joined window is not its history and rows ({dtype})"
    x, Bm, Cm, dt, g = together
    S = mx.random.normal((B, H, P, N), key=mx.random.key(22)) * 0.1
    y, S_final = mamba2_scan(x, Bm, Cm, dt, g, S)
    ys, S_chain = [], S
    for t in range(T):
        y_t, S_chain = mamba2_scan(*(a[:, t : t + 1] for a in (x, Bm, Cm, dt, g)), S_chain)
        ys.append(y_t)
    y_ref, S_ref = reference_scan(x, Bm, Cm, dt, g, S)
    mx.eval(y, S_final, ys, S_chain, y_ref, S_ref)
    if not (mx.array_equal(y, mx.concatenate(ys, axis=1)).item() and mx.array_equal(S_final, S_chain).item()):
        return "mamba2_scan rows differ with the row count"
    if not (mx.allclose(y, y_ref, rtol=1e-4, atol=1e-5).item()
            and mx.allclose(S_final, S_ref, rtol=1e-4, atol=1e-5).item()):
        return "mamba2_scan and reference disagree"
    return None
