"""Host values a window's kernels read, and GPU results the host reads, through MLX's pool:
`device_ints`, `step_dims`, `host_pieces`, `host_lists`, and the two kernels (`join`, `split`)
that make each crossing one launch.

On CUDA, MLX keeps an array of up to 8 bytes in a pool it maps for the GPU, and anything larger
made by the host in managed pages that small arrays share and that migrate to whichever side
touched them last. A kernel reading such a page after the host wrote any array on it waits for a
page fault: under ncu on an H100 (tree a2b63c9) a T = 8 window's embedding took 142 µs against 5
at T = 1. A pooled array is never faulted. So a window's token ids are made as 8-byte pooled
pieces joined on the GPU into device memory (`device_ints`), and what the host reads back (the
greedy tokens, a sampler's draws) is copied into pooled pieces first (`host_pieces`): a device
buffer the host read moves to managed memory, and once freed MLX hands it to a later op's
output of its size, which then waits for the fault (ncu on the H100 at 1c3c6e6: the next T = 8
window's ids, 80-95 µs against 3.6). On the H100 at ba1cd33 the pool took the T = 1 window from
2.62-2.66 to 2.44-2.49 ms and T = 8 from 3.49-3.57 to 3.35-3.42.

MLX's ops make a crossing one launch a piece (`concatenate` copies each input, a slice's `* 1` is
a binary op): a T = 8 window paid 4 launches to join its ids and 4 to split its tokens, and the
attention layers' per-step sizes 5 at every T, ~3.5 µs each on the H100 (ncu at 97e7ee1). `join`
and `split` do each in one: a thread per value copies its 4 bytes, nothing computed, so nothing
can round. They run once their probe read back what it wrote (every value's bits, negative ints,
-0.0, infinities, NaN); until then, and off CUDA, MLX's ops do the same copies.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .probe import MAX_UPLOAD_INTS, POOL_INTS, Probe, gpu_kernel, uploads

_step_dims: dict[str, tuple] = {}  # per kind: the last step's values and their array
SPLIT_DTYPES = (mx.int32, mx.uint32, mx.float32)  # 4-byte values: POOL_INTS of them fill a pooled buffer


def piece_cases(pieces: int, statement: str) -> str:
    """A switch over which piece value i falls in (POOL_INTS = 2 values a piece), `statement` for
    piece j (its `{j}`) at place i & 1."""
    assert POOL_INTS == 2, "the bodies place value i at i >> 1, i & 1"
    cases = "\n".join(f"        case {j}: {statement.format(j=j)} break;" for j in range(pieces))
    return f"    switch (i >> 1) {{\n{cases}\n    }}\n"


# A thread per value, one block of exactly as many threads as values (`launch`): no count is
# compiled in, so a piece count is one compile (the name's), whichever the last piece's length.
def join_source(pieces: int) -> str:
    """The body of `join` for `pieces` inputs p0.. (each POOL_INTS values, the last one or more)."""
    return "    const int i = block_x * block_dim + thread_x;\n" + piece_cases(pieces, "out[i] = p{j}[i & 1];")


def split_source(pieces: int) -> str:
    """The body of `split` for `pieces` outputs o0.. (each POOL_INTS values, the last one or more)."""
    return ("    const int i = block_x * block_dim + thread_x;\n    const auto v = values[i];\n"
            + piece_cases(pieces, "o{j}[i & 1] = v;"))


def piece_shapes(n: int) -> list[tuple[int]]:
    """The shapes of n values' pooled pieces: POOL_INTS values each, the last maybe fewer."""
    return [(min(POOL_INTS, n - i),) for i in range(0, n, POOL_INTS)]


def int_pieces(values: list[int], *, row: bool = False) -> list[mx.array]:
    """int32 arrays of POOL_INTS values each (the last maybe fewer), (k,) or with `row` (1, k):
    8 bytes at most, so MLX makes each in its pool."""
    return [mx.array([values[i:i + POOL_INTS]] if row else values[i:i + POOL_INTS], dtype=mx.int32)
            for i in range(0, len(values), POOL_INTS)]


def read_pieces(pieces: list[mx.array]) -> list:
    """The values of evaluated pieces, in order, as one list."""
    return [v for p in pieces for v in p.tolist()]


def launch(n: int) -> dict:
    """A thread per value, one block of n threads (n <= MAX_UPLOAD_INTS): the bodies never check
    a bound."""
    return {"grid": (n, 1, 1), "threadgroup": (n, 1, 1)}


def join(pieces: list[mx.array]) -> mx.array:
    """The int32 pieces (each (POOL_INTS,) or (1, POOL_INTS), the last maybe shorter) as one array
    along their last axis, in device memory, in one launch."""
    k = len(pieces)
    n = sum(p.shape[-1] for p in pieces)
    kernel = gpu_kernel(f"strata_pool_join_{k}_v1", [f"p{j}" for j in range(k)], ["out"], join_source(k))
    (out,) = kernel(inputs=pieces, output_shapes=[(*pieces[0].shape[:-1], n)], output_dtypes=[mx.int32], **launch(n))
    return out


def split(values: mx.array) -> list[mx.array]:
    """A 1-d array of 4-byte values as pieces of POOL_INTS values (the last maybe shorter), each
    8 bytes at most and so in MLX's pool, in one launch."""
    n = values.shape[0]
    shapes = piece_shapes(n)
    k = len(shapes)
    kernel = gpu_kernel(f"strata_pool_split_{k}_v1", ["values"], [f"o{j}" for j in range(k)], split_source(k))
    return kernel(inputs=[values], output_shapes=shapes, output_dtypes=[values.dtype] * k, **launch(n))


_probe = Probe("pool copies", "a window's ids and tokens cross in MLX's copies, a launch a piece")


def usable(dtype=None) -> bool:
    """Whether `join` and `split` may run (a GPU, once their probe passed). One verdict for every
    dtype: copies of 4-byte values (`dtype`, a model's, is the selftest's question and changes nothing)."""
    return _probe.usable(check, mx.int32)


def status() -> dict:
    """Whether the kernels are in use, and why not (for selftest and benchmarks)."""
    return _probe.status()


PROBE_COUNTS = (3, 4, 7, 8, MAX_UPLOAD_INTS)  # values: 2 to 8 pieces, the last full or not
PROBE_INTS = (-(2**31), 2**31 - 1, -1, 0, 151_935, 7, 1 << 20, -12345, 3, 99, 100_000, 2, 5, 6, 65_536, 1)
PROBE_FLOATS = (0.25, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.0e38, 1.0, 0.0, 2.5, -1e-30,
                0.125, 7.0, 1e30, -2.0, 0.5)


def check(dtypes=None) -> str | None:
    """None when the kernels pass on this device, else what failed: `join` of the probe's ints in
    pieces gives them in order, at (n,) and (1, n); `split` of ints, unsigned ints and floats gives
    pieces of at most 8 bytes whose bits are the values' in order. (`dtypes` is the probe's
    argument: the copies are checked at every dtype they take.)"""
    for n in PROBE_COUNTS:
        values = list(PROBE_INTS[:n])
        for row in (False, True):
            if join(int_pieces(values, row=row)).tolist() != ([values] if row else values):
                return f"join of {n} ints{' as a row' if row else ''} gave other values"
        for dtype in SPLIT_DTYPES:
            source = PROBE_FLOATS if dtype == mx.float32 else PROBE_INTS
            array = mx.array(np.array(source[:n], np.float32 if dtype == mx.float32 else np.int64)
                             .astype(np.dtype(str(dtype).split(".")[-1])))  # int32, uint32: the int64's low bits
            parts = split(array)
            mx.eval(array, *parts)
            if any(p.nbytes > 8 or p.dtype != dtype for p in parts):
                return f"split of {n} values of {dtype} gave pieces over 8 bytes or of another dtype"
            if not mx.array_equal(mx.concatenate(parts).view(mx.uint32), array.view(mx.uint32)).item():
                return f"split of {n} values of {dtype} gave other bits"
    return None


def device_ints(values, *, row: bool = False) -> mx.array:
    """`values` as an int32 array, (n,) or with `row` (1, n), that a CUDA kernel reads without a
    page fault: made from 8-byte pieces in MLX's mapped pool and joined on the GPU into device
    memory. Elsewhere (or for more than MAX_UPLOAD_INTS values) `mx.array`: no op more."""
    values = list(values)
    if len(values) <= POOL_INTS or len(values) > MAX_UPLOAD_INTS or not uploads():
        return mx.array([values] if row else values, dtype=mx.int32)
    pieces = int_pieces(values, row=row)
    return join(pieces) if usable() else mx.concatenate(pieces, axis=-1)


def step_dims(*values: int, kind: str = "sizes") -> mx.array:
    """`probe.dims` for values that change at every step (an attention kernel's cache length or
    ring position, a window's rotary offset), kept per `kind` only until another step's (a
    window's attention layers share them; `dims` would keep every cache length's for the life of
    the process). With uploads on, in device memory (padded past the pool as `dims` pads): every
    thread of a launch may read them (ncu on the H100 at 4c4c4d5: the T = 8 attention prep, whose
    threads read the offset from the pool, 18-22 us against 7-8 where the pool's page sat well)."""
    last = _step_dims.get(kind)
    if last is None or last[0] != values:
        padded = values + (0,) * max(0, POOL_INTS + 1 - len(values)) if uploads() else values
        _step_dims[kind] = (values, device_ints(padded))
    return _step_dims[kind][1]


def host_pieces(values: mx.array) -> list[mx.array]:
    """A GPU op's 1-d output of 4-byte values that the host will read (a window's greedy tokens,
    a sampler's draws), as copies of at most POOL_INTS values, each in MLX's pool (`split`, or a
    slice's copy a piece). Elsewhere, or for at most POOL_INTS values: `[values]`."""
    n = values.shape[0]
    if n <= POOL_INTS or not uploads():
        return [values]
    if n <= MAX_UPLOAD_INTS and values.dtype in SPLIT_DTYPES and usable():
        return split(values)
    return [values[i:i + POOL_INTS] * 1 for i in range(0, n, POOL_INTS)]  # * 1: a copy; a view shares the buffer


def host_lists(*arrays: mx.array) -> list[list]:
    """Each 1-d array (a GPU op's output the host reads) as a list, through `host_pieces`, all
    evaluated in one eval."""
    pieces = [host_pieces(a) for a in arrays]
    mx.eval(*[p for ps in pieces for p in ps])
    return [read_pieces(ps) for ps in pieces]
