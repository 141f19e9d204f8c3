"""A softmax router's decode-window glue in one kernel: `router_window`.

Legend: R rows (<= 8 in a decode window), E experts, k experts a row.

In MLX ops a MoE layer routes a window with four launches (AsType, Softmax, ArgPartition,
GatherAxis; on the H200 ~6-10 µs each, and the step is launch-bound); this is one call that
takes the router's logits (..., E) and returns the picks (..., k) uint32, in descending
probability with ties to the lower expert, and their softmax probabilities (..., k) float32,
not renormalised.

Row-invariant by construction: a block serves one row, and its arithmetic is a function of that
row's logits and E alone, never of R. Thread i of THREADS holds experts i, i + THREADS, ...; the
row's max is taken over those in order, then a xor butterfly in each warp, then the warps in
order 0..WARPS-1 (a max is exact in any order); the sum of expf(x - max) runs in the same order;
every probability is expf(x - max) / sum. Each of the k picks is a block argmax over the experts
not yet picked (the key compared is the probability, a NaN ranking below every number), ties to
the lower index, and the thread that holds the winner writes it. A row with a NaN or an infinite
logit has NaN probabilities, so it picks experts 0..k-1 with NaN weights: always k distinct
experts in range, never an out-of-bounds gather.

One body for CUDA and Metal (backends.py); `reference_router_window` (pure MLX) is what the tests
and the probe hold the kernel to; callers run MLX's ops wherever `usable()` is False (the CPU).
"""

from __future__ import annotations

import mlx.core as mx

from .backends import block_reduce
from .probe import Probe, cases_at, dims, gpu_kernel

WARPS = 4
THREADS = WARPS * 32
MAX_EXPERTS = 1024  # a thread keeps its E / THREADS (<= 8) probabilities in registers
MAX_PICKS = 16

# One block per row, THREADS threads. The logits are row-major rows of W values, the router's
# E first: a stacked router's output (layers.StackedRows) is passed whole, its other linears'
# columns after the router's, so the body needs no strides (and strata's CUDA build keeps its
# cubin across processes, precompiled.py) and no copy of a column slice. dims: R, E, k, W.
# NEG_BIG (not -inf) starts the max: a row with any finite logit reaches its true max.
SOURCE = """
    constexpr float NEG_BIG = -3.402823466e38f;
    const int E = dims[1], K = dims[2], W = dims[3];
    const int r = block_x, lane = thread_x & 31, warp = thread_x >> 5;
    STRATA_SHARED float part_s[WARPS];
    STRATA_SHARED float key_s[2][WARPS];
    STRATA_SHARED float index_s[2][WARPS];
    const auto row = logits + r * W;  // auto: keeps Metal's address space
    float p[PER];
    float m = NEG_BIG;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int e = thread_x + j * THREADS;
        p[j] = e < E ? static_cast<float>(row[e]) : NEG_BIG;
        m = fmaxf(m, p[j]);
    }
""" + block_reduce("m", "M", op="max") + """    strata_sync();  // part_s takes the sums next
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (thread_x + j * THREADS < E) {
            p[j] = expf(p[j] - M);
            s += p[j];
        }
    }
""" + block_reduce("s", "total") + """    unsigned int taken = 0;  // bit j: expert thread_x + j * THREADS picked (or past E)
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (thread_x + j * THREADS < E) p[j] = p[j] / total;
        else taken |= 1u << j;
    }
    for (int i = 0; i < K; ++i) {
        // (key, index): probability, NaN as -1; -2 for a thread with nothing left
        float best = -2.0f, best_e = 16777216.0f;
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            const float key = p[j] == p[j] ? p[j] : -1.0f;
            if (!((taken >> j) & 1u) && key > best) {
                best = key;
                best_e = static_cast<float>(thread_x + j * THREADS);
            }
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float other = strata_xor(best, off), other_e = strata_xor(best_e, off);
            if (other > best || (other == best && other_e < best_e)) {
                best = other;
                best_e = other_e;
            }
        }
        if (lane == 0) {
            key_s[i & 1][warp] = best;
            index_s[i & 1][warp] = best_e;
        }
        strata_sync();  // one barrier a pick: pick i + 2 writes these slots after pick i + 1's barrier
        best = key_s[i & 1][0];
        best_e = index_s[i & 1][0];
        #pragma unroll
        for (int w = 1; w < WARPS; ++w) {
            const float other = key_s[i & 1][w], other_e = index_s[i & 1][w];
            if (other > best || (other == best && other_e < best_e)) {
                best = other;
                best_e = other_e;
            }
        }
        const int winner = static_cast<int>(best_e);
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (thread_x + j * THREADS == winner) {
                inds[r * K + i] = static_cast<unsigned int>(winner);
                weights[r * K + i] = p[j];
                taken |= 1u << j;
            }
        }
    }
"""
HEADER = f"#define WARPS {WARPS}\n#define THREADS {THREADS}\n"


def supports(num_experts: int, top_k: int) -> bool:
    """Router shapes the kernel takes: up to 1024 experts (Qwen3-Next's 512 among them) and 16 picks."""
    return 0 < top_k <= min(num_experts, MAX_PICKS) and num_experts <= MAX_EXPERTS


def takes(logits: mx.array, top_k: int, experts: int | None = None) -> bool:
    """Whether the kernel takes these logits' shape: rank 2 or 3, a supported (E, k), the
    router's `experts` columns (all when None) within each row."""
    E = logits.shape[-1] if experts is None else experts
    return logits.ndim in (2, 3) and E <= logits.shape[-1] and supports(E, top_k)


def per_thread(num_experts: int) -> int:
    """The experts each thread holds (PER, compiled in: one compile per model's E)."""
    return -(-num_experts // THREADS)


def launch(rows: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a block per row."""
    return {"grid": (rows * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def router_window(logits: mx.array, top_k: int, *, experts: int | None = None) -> tuple[mx.array, mx.array]:
    """The router's softmax top-k of every row of `logits`, on a GPU, one call.

    Args:
        logits: (N, W) or (B, T, W), float32 or bfloat16, row-major (a view is copied first):
            the router's logits are each row's first `experts` columns, all W when None (a
            stacked router's output is passed whole).
        top_k: k, the experts a row picks.

    Returns:
        inds (..., k) uint32, in descending probability (ties to the lower expert), and weights
        (..., k) float32: their softmax probabilities, not renormalised.
    """
    W = logits.shape[-1]
    E = W if experts is None else experts
    R = logits.size // W
    kernel = gpu_kernel("strata_router_window_v2", ["dims", "logits"], ["inds", "weights"], SOURCE, HEADER)
    # The dtype is a template value too (MLX caches a compile by name and template alone).
    template = [("T_IN", logits.dtype), ("PER", per_thread(E))]
    lead = logits.shape[:-1]
    inds, weights = kernel(inputs=[dims(R, E, top_k, W), logits], template=template,
                           output_shapes=[(*lead, top_k)] * 2, output_dtypes=[mx.uint32, mx.float32], **launch(R))
    return inds, weights


def reference_router_window(logits: mx.array, top_k: int, *, experts: int | None = None) -> tuple[mx.array, mx.array]:
    """What `router_window` computes, in plain MLX: the float32 softmax as the kernel spells it,
    exp(x - max) / sum (MLX's softmax op takes a fast exp on GPUs), then k times the largest
    probability not yet picked (a NaN below every number; of equals, the lowest index: the
    minimum of the tied indices, exact on every backend)."""
    x = logits[..., : logits.shape[-1] if experts is None else experts].astype(mx.float32)
    numerators = mx.exp(x - x.max(axis=-1, keepdims=True))
    probs = numerators / numerators.sum(axis=-1, keepdims=True)
    E = probs.shape[-1]
    keys = mx.where(mx.isnan(probs), -1.0, probs)
    experts = mx.arange(E, dtype=mx.uint32)
    picks = []
    for _ in range(top_k):
        best = keys.max(axis=-1, keepdims=True)
        pick = mx.where(keys == best, experts, E).min(axis=-1, keepdims=True)
        picks.append(pick)
        keys = mx.where(experts == pick, -2.0, keys)
    inds = mx.concatenate(picks, axis=-1)
    return inds, mx.take_along_axis(probs, inds, axis=-1)


_probe = Probe("router window kernel", "MoE layers route with MLX's softmax and argpartition")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the logits' dtype (probe.Probe.takes)."""
    return _probe.takes(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


def probe_logits(E: int, *, rows: int = 8, dtype=mx.float32, seed: int = 0) -> mx.array:
    """Random router logits (rows, E) in `dtype`, rows 1 and 2 with exact ties (row 1: its
    first half repeated; row 2: every logit equal)."""
    logits = mx.random.normal((max(rows, 3), E), key=mx.random.key(seed)) * 2
    half = logits[1, : E // 2]
    tied = mx.concatenate([half, half, logits[1, 2 * (E // 2) :]])
    logits = mx.concatenate([logits[:1], tied[None], mx.zeros((1, E)), logits[3:]])
    return logits[:rows].astype(dtype)


PROBE_CASES = ((512, mx.float32, 10), (48, mx.bfloat16, 2), (512, mx.bfloat16, 10), (48, mx.float32, 2))


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for 8 and 3 rows (and the
    rows of a 3-D stacked output, W = E + 1, and a view of its router columns), each row equals its 1-row call
    bit for bit; the picks equal the reference's, the weights within 1e-5 of the row's largest
    (sums in another order, the device's exp: kernel_emulate.py holds the body to 1e-6)."""
    for E, dtype, k in (cases if dtypes is None else cases_at(cases, dtypes)):
        logits = probe_logits(E, dtype=dtype)
        alone = [router_window(logits[t : t + 1], k) for t in range(8)]
        together = router_window(logits, k)
        three = router_window(logits[5:], k)
        wide = mx.concatenate([logits, logits[:, :1]], axis=-1)[None]  # (1, 8, E + 1): a stacked output
        viewed = router_window(wide, k, experts=E)
        sliced = router_window(wide[..., :E], k)  # a strided view, copied first
        expected = reference_router_window(logits, k)
        mx.eval(alone, together, three, viewed, sliced, expected)
        alone = [mx.concatenate(parts) for parts in zip(*alone)]
        for got, one, part, view, cut in zip(together, alone, three, viewed, sliced):
            if not (mx.array_equal(got, one).item() and mx.array_equal(part, one[5:]).item()
                    and mx.array_equal(view[0], one).item() and mx.array_equal(cut[0], one).item()):
                return f"router_window rows differ with the row count (E={E}, {dtype})"
        if not mx.array_equal(together[0], expected[0]).item():
            return f"router_window picks differ from the reference (E={E}, {dtype})"
        scale = mx.abs(expected[1]).max(axis=-1, keepdims=True)
        if not (mx.abs(together[1] - expected[1]) <= 1e-5 * scale).all().item():
            return f"router_window weights differ from the reference (E={E}, {dtype})"
    return None
