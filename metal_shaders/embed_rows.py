"""A quantized embedding's lookup in one kernel: `embed_rows`.

Legend: N tokens (a decode window's <= 8; any count works), V the vocabulary, D the embedding
width, W = D·BITS/32 packed words a row, G = D/GS groups a row, T the scales' (the model's) dtype.

`nn.QuantizedEmbedding` looks tokens up in MLX ops: three Gathers (the packed rows, their scales,
their biases), a dequantize and the squeezes around them, 7 launches a decode window on the H200
(~16 µs each, and the step is launch-bound: docs/benchmarks.md). This is one call that takes the
tokens (any shape, any integer dtype), the packed weight (V, W) uint32 and the scales and biases
(V, G) in T, and returns tokens.shape + (D,) in T.

Its arithmetic is MLX's affine dequantize, value for value. The thread of (token n, word j)
reads t = tokens[n] and, for 0 <= t < V, the word q = w[t, j], which packs VALS = 32 / BITS codes,
low bits first: code i is d = (q >> (BITS·i)) & (2^BITS - 1), of group g = j·VALS / GS, and

    out[n, j·VALS + i] = scale · T(d) + bias,   scale = scales[t, g], bias = biases[t, g],

written in T as MLX's own kernels write it (CUDA: mlx/backend/cuda/quantized/affine_quantize.cu,
`affine_dequantize`, its 2-, 4- and 8-bit branch; Metal: kernels/quantized.h). T(d) is exact
(d < 256); the product and the sum round as the device's compiler rounds them in MLX's kernel
(two roundings in T, or one fused multiply-add: the same expression gives the same choice). The
probe holds the output to `reference_embed_rows` (what `nn.QuantizedEmbedding.__call__`
computes) bit for bit with `mx.array_equal`: a device that rounds otherwise fails it, and callers
keep MLX's ops (lossless either way). On the CPU MLX's dequantize is a multiply, then an add.

Token ids out of range (t < 0 or t >= V) give rows of zeros. MLX's gather checks nothing: it
counts a negative id from the table's end and reads past it for one >= V; the kernel's bad id is
a deterministic zero row instead (the probe checks that, and the reference is not asked there).

Row-invariant by construction: a thread's values are a function of its token's row alone, never
of N or of the other tokens; serial steps and windows take the same kernel, and the probe still
checks each row of an N-row call against its 1-row call.

One body for CUDA and Metal (backends.py), reading no shapes or strides (sizes come in `dims`),
so strata's CUDA build keeps its cubin across processes (precompiled.py); callers run MLX's ops
wherever `usable()` is False (the CPU, a failed probe).
"""

from __future__ import annotations

import mlx.core as mx

from .probe import Probe, cases_at, dims, gpu_kernel

BITS = (2, 4, 8)  # MLX's one-word branch: codes never straddle a byte
GROUP_SIZES = (32, 64, 128)  # the group sizes strata quantizes with (strata_cli/model/quant.py)
THREADS = 128  # words a block

# A thread per packed word of the output, over a 1-D grid of N·W words (rows may share a block:
# a thread's place in it changes nothing it computes). dims: N, W, G, V. T: the scales' dtype,
# BITS and GS compiled in; TI (the tokens' dtype) is named only so that MLX, which keys a compile
# by name and template, keeps one per token dtype. A token id is read as an unsigned 64-bit
# value, so a negative one is as far out of range as a large one.
SOURCE = """
    constexpr int VALS = 32 / BITS;
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    const int W = dims[1];
    const size_t k = static_cast<size_t>(block_x) * block_dim + thread_x;
    if (k >= static_cast<size_t>(dims[0]) * W) return;
    const size_t n = k / W;
    const int j = static_cast<int>(k - n * W);
    const size_t t = static_cast<size_t>(tokens[n]);
    auto o = out + k * VALS;
    if (t >= static_cast<size_t>(dims[3])) {
        #pragma unroll
        for (int i = 0; i < VALS; ++i) o[i] = static_cast<T>(0.0f);
        return;
    }
    const unsigned int q = w[t * W + j];
    const size_t g = t * dims[2] + (j * VALS) / GS;
    const T scale = scales[g];
    const T bias = biases[g];
    #pragma unroll
    for (int i = 0; i < VALS; ++i) {
        const unsigned char d = static_cast<unsigned char>((q >> (BITS * i)) & MASK);
        o[i] = scale * static_cast<T>(d) + bias;
    }
"""
INPUTS = ["dims", "tokens", "w", "scales", "biases"]
NAME = "strata_embed_rows_v1"


def supports(group_size: int, bits: int) -> bool:
    """Whether the kernel takes this affine quantization: bits 2, 4 or 8, groups of 32, 64 or 128."""
    return bits in BITS and group_size in GROUP_SIZES


def launch(tokens: int, words: int) -> dict:
    """Grid (in threads, as MLX's custom kernels take it) and block: a thread per packed word."""
    return {"grid": (max(1, -(-tokens * words // THREADS)) * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


def embed_rows(tokens: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
               bits: int) -> mx.array:
    """The rows of `tokens`, dequantized, on a GPU, one call.

    Args:
        tokens: token ids, any shape, any integer dtype.
        w: (V, W) uint32, the packed table (`mx.quantize`'s first output).
        scales, biases: (V, W·32/bits/group_size) in T.
        group_size, bits: the quantization (`supports`).

    Returns:
        tokens.shape + (W·32/bits,) in T; a zero row for an id outside 0..V-1.
    """
    V, W = w.shape
    D = W * 32 // bits
    kernel = gpu_kernel(NAME, INPUTS, ["out"], SOURCE)
    (out,) = kernel(inputs=[dims(tokens.size, W, scales.shape[-1], V), tokens, w, scales, biases],
                    template=[("T", scales.dtype), ("TI", tokens.dtype), ("BITS", bits), ("GS", group_size)],
                    output_shapes=[(*tokens.shape, D)], output_dtypes=[scales.dtype], **launch(tokens.size, W))
    return out


def reference_embed_rows(tokens: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                         bits: int) -> mx.array:
    """What `embed_rows` computes for ids in range, in plain MLX: `nn.QuantizedEmbedding.__call__`'s ops."""
    return mx.dequantize(w[tokens], scales[tokens], biases[tokens], group_size=group_size, bits=bits)


_probe = Probe("embedding kernel", "quantized embeddings run MLX's gathers and dequantize")


def usable(dtype=None) -> bool:
    """Whether the kernel may run at `dtype`, the scales' (the model's) dtype (probe.Probe.usable:
    float16 too, its probe the cases' at float16, since the probe asks for MLX's bits exactly)."""
    return _probe.usable(check, dtype)


def status() -> dict:
    """Whether the kernel is in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


PROBE_VOCAB = 50
PROBE_WIDTH = 384  # 3 groups of 128, 6 of 64, 12 of 32; 24 to 96 words a row (rows share blocks)


def probe_inputs(bits: int, group_size: int, *, vocab: int = PROBE_VOCAB, width: int = PROBE_WIDTH, dtype=mx.float32,
                 seed: int = 0):
    """A table of `vocab` rows of `width` values quantized with `mx.quantize` (w, scales, biases
    in `dtype`; each row's scale drawn from 1e-3 to 1e2, so scales and biases use their dtype's
    range), and 8 token ids: the first, the last, a repeat, the rest spread over the table."""
    kw, ks = mx.random.split(mx.random.key(seed))
    rows = mx.random.normal((vocab, width), key=kw) * mx.power(10.0, mx.random.uniform(-3, 2, (vocab, 1), key=ks))
    w, scales, biases = mx.quantize(rows.astype(dtype), group_size, bits)
    tokens = mx.array([0, vocab - 1, 7, 7, 31 % vocab, 2, vocab // 2, 13 % vocab], dtype=mx.int32)
    return tokens, w, scales, biases


# (bits, group size, dtype): Qwen3-Next-80B's 4-bit embedding (groups of 64) first, then each
# width with each group size, across both dtypes.
PROBE_CASES = ((4, 64, mx.bfloat16), (8, 32, mx.float32), (2, 128, mx.bfloat16), (4, 32, mx.float32),
               (8, 128, mx.bfloat16), (2, 64, mx.float32), (4, 64, mx.float32), (8, 64, mx.bfloat16))
OUT_OF_RANGE = (-1, PROBE_VOCAB, 2**31 - 1, -(2**31))  # ids the probe's table does not hold


def check(cases=PROBE_CASES, dtypes=None) -> str | None:
    """None when the kernel passes on this device, else what failed: for 8 and 3 tokens (and a
    (1, 8) window), each row equals its 1-row call bit for bit, the output equals the reference
    bit for bit, and out-of-range ids give zero rows."""
    for bits, gs, dtype in (cases if dtypes is None else cases_at(cases, dtypes, index=2)):
        tokens, w, scales, biases = probe_inputs(bits, gs, dtype=dtype)
        spec = {"group_size": gs, "bits": bits}
        alone = mx.concatenate([embed_rows(tokens[t : t + 1], w, scales, biases, **spec) for t in range(8)])
        together = embed_rows(tokens, w, scales, biases, **spec)
        three = embed_rows(tokens[5:], w, scales, biases, **spec)
        window = embed_rows(tokens[None], w, scales, biases, **spec)
        bad = embed_rows(mx.array(OUT_OF_RANGE, dtype=mx.int32), w, scales, biases, **spec)
        expected = reference_embed_rows(tokens, w, scales, biases, **spec)
        mx.eval(alone, together, three, window, bad, expected)
        form = f"{bits} bits, groups of {gs}, {dtype}"
        if not (mx.array_equal(together, alone).item() and mx.array_equal(three, alone[5:]).item()
                and mx.array_equal(window[0], alone).item()):
            return f"embed_rows rows differ with the row count ({form})"
        if not mx.array_equal(together, expected).item():
            return f"embed_rows differs from the reference ({form})"
        if not mx.array_equal(bad, mx.zeros(bad.shape, dtype)).item():
            return f"embed_rows reads out-of-range ids ({form})"
    return None
