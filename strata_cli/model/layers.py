"""Small building blocks shared by the architectures, and the row-invariance rule of windows."""

from __future__ import annotations

import os
from functools import lru_cache, partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from metal_shaders import add_norm, embed_rows, gated_norm
from metal_shaders import rows_matvec as kernels

from . import host_blas

WINDOW_ROWS = 8  # a decode window: the root and at most 7 drafts
PREFILL_MIN_ROWS = 16  # matmuls over at least this many rows take the prompt path


# Elementwise glue, each compiled into one kernel: on a GPU every MLX op is a launch (~10 us on
# the H200) and small-batch decoding is launch-bound. Elementwise, so a row's arithmetic never
# depends on how many rows share the call (row invariance holds); shapeless, so prompt chunks
# of any length reuse one compilation.
@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.sigmoid(gate)


@partial(mx.compile, shapeless=True)
def rounded_f32(x: mx.array, like: mx.array) -> mx.array:
    """x rounded to like's dtype, then in float32 (two casts, one kernel)."""
    return x.astype(like.dtype).astype(mx.float32)


@partial(mx.compile, shapeless=True)
def silu_gate_f32(normed: mx.array, weight: mx.array, gate: mx.array) -> mx.array:
    """(weight · normed) · silu(gate), normed first rounded to gate's dtype, the product in
    float32, back in gate's dtype."""
    normed = normed.astype(gate.dtype)
    return ((weight * normed).astype(mx.float32) * nn.silu(gate.astype(mx.float32))).astype(gate.dtype)


class CpuShortCalls:
    """Whether calls of fewer than PREFILL_MIN_ROWS rows (decode windows, serial steps, short
    prompt chunks) take their CPU forms on the CPU backend: numpy's linears (`host_window`) and
    the traced rms_norm, rope and GDN steps. "auto" (the default) or "never": the MLX forms, as
    a GPU backend runs them (scripts/bench/step_ops.py counts GPU-shaped steps on the CPU)."""

    mode = "auto"

    @classmethod
    def applies(cls, rows: int) -> bool:
        return cls.mode == "auto" and 0 < rows < PREFILL_MIN_ROWS and mx.default_device() == mx.cpu


@lru_cache
def cpu_rms_norm(eps: float, weighted: bool) -> Callable:
    """`mx.fast.rms_norm`'s sums for the CPU backend, compiled: there MLX runs the fast op as
    its ~11-op decomposition, here the elementwise part after the sum is one kernel."""
    def norm(x: mx.array, *weight: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        out = (x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)
        return out * weight[0] if weighted else out
    return mx.compile(norm, shapeless=True)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMS normalisation over the last axis (times `weight` where given): `cpu_rms_norm` for the
    CPU's short calls (fewer than PREFILL_MIN_ROWS rows on axis 1 of a (B, T, ...) input, or on
    axis 0 of an (N, H) one), MLX's fast op elsewhere (on the CPU its decomposition runs 3x
    faster than the compiled form over a 512-row prompt chunk). The two give the same bits on
    the CPU; a window's rows and serial steps take the same one either way."""
    rows = x.shape[1] if x.ndim >= 3 else x.shape[0] if x.ndim == 2 else 1
    if not CpuShortCalls.applies(rows):
        return mx.fast.rms_norm(x, weight, eps)
    return cpu_rms_norm(eps, weight is not None)(x, *(() if weight is None else (weight,)))


class RowSplit:
    """Whether a small window's matmuls and attention run one row at a time.

    Lossless speculation needs every row of a window to compute exactly what it computes alone
    (docs/design.md, "Row invariance"). MLX's CUDA matmul, quantized matmul and attention kernels
    round a row differently depending on how many rows share the call (`scripts/bench/row_probe.py`,
    docs/benchmarks.md); its CPU kernels do not. So on a GPU backend a window of 2..WINDOW_ROWS
    rows runs those calls row by row, each then the very call serial decoding makes. Larger
    calls (prompt chunks, shared by serial and speculative decoding) run whole.

    `mode`: "auto" (split on GPU backends, the default), "always" (the CPU tests exercise the
    split path), "never".
    """

    mode = "auto"

    @classmethod
    def applies(cls, rows: int) -> bool:
        if not 1 < rows <= WINDOW_ROWS or cls.mode == "never":
            return False
        return cls.mode == "always" or mx.default_device() != mx.cpu

    @classmethod
    def kernel_may_take(cls, rows: int) -> bool:
        """Whether a window of `rows` rows (serial 1-row steps included, so they share the
        kernel's arithmetic) may go to a row-invariant kernel; "never" keeps every window on MLX
        ops. The kernel's own probe (`usable()`) and shape support decide the rest."""
        return 0 < rows <= WINDOW_ROWS and cls.mode != "never"


def by_row(fn: Callable[[mx.array], mx.array], x: mx.array, axis: int = -2) -> mx.array:
    """`fn(x)`, or, where `RowSplit` applies, `fn` of each row along `axis`, concatenated."""
    T = x.shape[axis]
    if not RowSplit.applies(T):
        return fn(x)
    index = [slice(None)] * x.ndim
    rows = []
    for i in range(T):
        index[axis] = slice(i, i + 1)
        rows.append(fn(x[tuple(index)]))
    return mx.concatenate(rows, axis=axis)


def kernel_rows(x: mx.array) -> int:
    """Rows of `x` (all leading axes) when the row-invariant CUDA kernel takes them, else 0."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return rows if RowSplit.kernel_may_take(rows) and kernels.kernels_usable(x.dtype) else 0


def is_cpu_prompt(x: mx.array) -> bool:
    """Whether `x` (rows on its leading axes) is a prompt-sized matmul input on the CPU backend."""
    return x.size >= PREFILL_MIN_ROWS * x.shape[-1] and mx.default_device() == mx.cpu


@lru_cache(maxsize=1)
def prompt_streams() -> tuple[mx.Stream, ...]:
    """MLX CPU streams (a thread each) that a CPU prompt chunk spreads its matmuls over: the
    Linux wheels' BLAS runs on one core per call, so two streams on two cores run a chunk's
    matmuls in about half the time (1.83x on a 512 x 256 x 1,024 matmul), each row's sums
    unchanged. One stream (no split) on a one-core machine."""
    return tuple(mx.new_stream(mx.cpu) for _ in range(min(2, os.cpu_count() or 1)))


def over_streams(fn: Callable[..., mx.array], *arrays: mx.array) -> mx.array:
    """`fn(*arrays)`, with the arrays' rows (axis 0) split into equal parts, one per
    `prompt_streams()` stream, and the parts' results concatenated. `fn` must treat rows
    independently."""
    streams = prompt_streams()
    n = arrays[0].shape[0]
    if len(streams) < 2 or n < 2:
        return fn(*arrays)
    bounds = [n * i // len(streams) for i in range(len(streams) + 1)]
    parts = []
    for stream, lo, hi in zip(streams, bounds, bounds[1:]):
        with mx.stream(stream):
            parts.append(fn(*(a[lo:hi] for a in arrays)))
    return mx.concatenate(parts)


def host_window(x: mx.array) -> bool:
    """Whether `x` holds fewer rows than a prompt-sized call (decode windows, and prompt chunks
    too short for the prompt path, so that those still equal serial steps bit for bit) whose
    float32 linears run as numpy matrix-vector products (`host_blas.rows_linears`): on the CPU
    backend, where MLX's BLAS is the slow reference one (docs/benchmarks.md, "CPU decode
    windows through numpy")."""
    return host_rows(x.size // x.shape[-1] if x.ndim else 0, x.dtype)


def host_rows(rows: int, dtype: mx.Dtype) -> bool:
    """`host_window` for a call of `rows` rows in `dtype`."""
    return CpuShortCalls.applies(rows) and host_blas.HostBlas.windows and host_blas.HostBlas.takes_dtype(dtype)


def host_weight(module: nn.Module) -> np.ndarray:
    """`module.weight` as a numpy view, cached on the module (`host_blas.HostView`)."""
    view = module.__dict__.get("_host_view")
    if view is None:
        view = module.__dict__["_host_view"] = host_blas.HostView()
    return view.of(module.weight)


def project(x: mx.array, *linears: nn.Module) -> tuple[mx.array, ...]:
    """Each of `linears` applied to `x`: on the host path (`host_window`) with one read of x for
    them all, each product computed exactly as the linear alone computes it."""
    if host_window(x) and all(type(linear) is RowLinear and linear.weight.dtype == mx.float32
                              for linear in linears):
        return tuple(host_blas.rows_linears(x, [(host_weight(linear), linear.get("bias")) for linear in linears]))
    return tuple(linear(x) for linear in linears)


class Transposed:
    """A weight with its last two axes swapped, contiguous, made once per weight array.

    MLX's CPU matmul (a reference BLAS in the Linux wheels) runs 2-3x slower with a transposed
    right operand, and gives the same sums either way (docs/benchmarks.md, "CPU prefill
    pieces"). The copy is remade only when the module's weight array is replaced (loading,
    `set_dtype`), and costs one more copy of each weight that prompt-sized CPU matmuls use.
    A plain object, not an array, so `nn.Module` never takes it for a parameter.
    """

    __slots__ = ("source", "value")

    def __init__(self):
        self.source = self.value = None

    def of(self, weight: mx.array) -> mx.array:
        if self.source is not weight:
            self.source, self.value = weight, mx.contiguous(weight.swapaxes(-1, -2))
        return self.value


def transposed(module: nn.Module, name: str) -> mx.array:
    """`module[name]` with its last two axes swapped, contiguous, cached on the module."""
    cache = module.__dict__.setdefault("_transposed", {})
    return cache.setdefault(name, Transposed()).of(module[name])


class ColumnMap:
    """Which of a linear's output columns a caller reads, in its order, split at `bounds` into
    the arrays it reads (`RowLinear.mapped`): `layout` for the column-mapped kernel (each part
    written contiguous), and for MLX's gather a contiguous (1, T, n) index per window size
    T <= WINDOW_ROWS, made once, so that `take_along_axis` needs no broadcast op; an identity map
    (every column in place: parts only) gathers nothing. A plain object, kept by its maker (never
    a module's parameter)."""

    __slots__ = ("flat", "layout", "by_rows", "identity")

    def __init__(self, columns: mx.array, bounds=()):
        self.flat = columns.reshape(-1).astype(mx.uint32)
        self.layout = kernels.ColumnLayout(self.flat, bounds)
        n = self.flat.size
        self.by_rows = tuple(mx.contiguous(mx.broadcast_to(self.flat, (1, T, n))) for T in range(1, WINDOW_ROWS + 1))
        mx.eval(self.flat, self.by_rows)
        self.identity = mx.array_equal(self.flat, mx.arange(n, dtype=mx.uint32)).item()

    def take(self, y: mx.array) -> list[mx.array]:
        """y[..., flat] split at the bounds: one gather (a (1, T) window's index made already;
        others broadcast; none where the map is the identity over all of y), then views."""
        if self.identity and y.shape[-1] == self.flat.size:
            return mx.split(y, list(self.layout.bounds), axis=-1) if self.layout.bounds else [y]
        lead = y.shape[:-1]
        if len(lead) == 2 and lead[0] == 1 and 1 <= lead[1] <= WINDOW_ROWS:
            index = self.by_rows[lead[1] - 1]
        else:
            index = mx.broadcast_to(self.flat, (*lead, self.flat.size))
        taken = mx.take_along_axis(y, index, axis=-1)
        return mx.split(taken, list(self.layout.bounds), axis=-1) if self.layout.bounds else [taken]


class RowLinear(nn.Linear):
    """`nn.Linear` whose window rows keep their serial arithmetic: the row-invariant kernel
    (metal_shaders/rows_matvec.py) where it runs, else `by_row`. Quantizes to `RowQuantizedLinear`.

    Prompt-sized float32 calls on the CPU go to numpy's BLAS (`host_blas`), else multiply by a
    cached contiguous Wᵀ (`transposed`).
    """

    def __call__(self, x: mx.array) -> mx.array:
        K = x.shape[-1]
        if host_window(x) and self.weight.dtype == mx.float32:
            return host_blas.rows_linears(x, [(host_weight(self), self.get("bias"))])[0]
        if self.takes_kernel(x):
            y = kernels.rows_matvec(x, self.weight)
            return y + self.bias if "bias" in self else y
        if is_cpu_prompt(x):
            if host_blas.HostBlas.takes(x, self.weight):
                return host_blas.linear(x, self.weight, self.get("bias"))
            weight = transposed(self, "weight")
            y = over_streams(lambda rows: rows @ weight, x.reshape(-1, K)).reshape(*x.shape[:-1], -1)
            return y + self["bias"] if "bias" in self else y
        return by_row(super().__call__, x)

    def takes_kernel(self, x: mx.array) -> bool:
        """Whether the row-invariant kernel takes this call (a window's rows, a shape it takes)."""
        return bool(kernel_rows(x)) and kernels.supports(x.shape[-1])

    def mapped(self, x: mx.array, columns: ColumnMap) -> list[mx.array]:
        """self(x)'s columns `columns.flat`, in that order, split at its bounds: on a GPU window
        (where `self(x)` takes the kernel and the column-mapped forms passed their probe) in one
        launch that reads each column's weight row in place and writes each part contiguous, the
        same bits as the plain kernel's columns; elsewhere `self(x)`, one gather and views
        (`ColumnMap.take`)."""
        if self.takes_mapped(x):
            return kernels.rows_matvec_mapped(x, self.weight, columns.layout)
        return columns.take(self(x))

    def takes_mapped(self, x: mx.array) -> bool:
        """Whether `mapped` runs the column-mapped kernel on x (else it gathers self(x)'s columns)."""
        return "bias" not in self and self.takes_kernel(x) and kernels.mapped_usable(x.dtype)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     quantize_input: bool = False) -> "RowQuantizedLinear":
        if quantize_input:
            raise ValueError("quantized activations are not supported")
        return RowQuantizedLinear.from_linear(self, group_size, bits, mode)


def is_affine_embedding(embed: nn.Module) -> bool:
    """Whether `embed` is MLX's own quantized embedding in affine form (scales and biases), the
    form strata's kernels read (a subclass may compute something else)."""
    return (type(embed) is nn.QuantizedEmbedding and getattr(embed, "mode", "affine") == "affine"
            and embed.get("biases") is not None)


def lookup_embedding(embed: nn.Module, tokens: mx.array) -> mx.array:
    """`embed(tokens)`: on a GPU, for an affine quantized embedding of a width and group size
    metal_shaders/embed_rows.py takes whose probe passed at its dtype, in that one kernel (MLX's
    lookup is three Gathers, a dequantize and squeezes; the kernel gives the same bits); else
    `embed(tokens)`. Rows never depend on each other, so prompt chunks take it too."""
    if (is_affine_embedding(embed) and embed_rows.supports(embed.group_size, embed.bits)
            and mx.issubdtype(tokens.dtype, mx.integer) and embed_rows.usable(embed.scales.dtype)):
        return embed_rows.embed_rows(tokens, embed.weight, embed.scales, embed.biases, group_size=embed.group_size,
                                     bits=embed.bits)
    return embed(tokens)


def tied_logits(embed: nn.Module, h: mx.array) -> mx.array:
    """Logits through a tied embedding (`embed.as_linear`) with a window's rows kept serial, as
    `RowLinear` keeps an untied head's: the row-invariant kernel where it takes the embedding's
    form (one launch for a window's rows, where `by_row` makes a matmul, a slice and a
    concatenation per row), else `by_row`."""
    K = h.shape[-1]
    if kernel_rows(h):
        if type(embed) is nn.Embedding and kernels.supports(K):
            return kernels.rows_matvec(h, embed.weight)
        if is_affine_embedding(embed) and kernels.supports(K, group_size=embed.group_size, bits=embed.bits):
            return kernels.rows_qmatvec(h, embed.weight, embed.scales, embed.biases, group_size=embed.group_size,
                                        bits=embed.bits)
    return by_row(embed.as_linear, h)


class RowQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose window rows keep their serial arithmetic (see `RowLinear`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if self.takes_kernel(x):
            y = kernels.rows_qmatvec(x, self.weight, self.scales, self.biases, group_size=self.group_size,
                                     bits=self.bits)
            return y + self.bias if "bias" in self else y
        return by_row(super().__call__, x)

    def takes_kernel(self, x: mx.array) -> bool:
        """Whether the row-invariant kernel takes this call: a window's rows, affine weights of a
        group size and width it takes."""
        return (bool(kernel_rows(x)) and self.mode == "affine" and self.get("biases") is not None
                and kernels.supports(x.shape[-1], group_size=self.group_size, bits=self.bits))

    def mapped(self, x: mx.array, columns: ColumnMap) -> list[mx.array]:
        """`RowLinear.mapped` for affine-quantized weights (each column's scales and biases read
        from its weight row's)."""
        if self.takes_mapped(x):
            return kernels.rows_qmatvec_mapped(x, self.weight, self.scales, self.biases, columns.layout,
                                               group_size=self.group_size, bits=self.bits)
        return columns.take(self(x))

    takes_mapped = RowLinear.takes_mapped


def _row_form(linear: nn.Module) -> tuple | None:
    """What linears must share for their rows to stack into one exact linear: class, affine
    quantization (group size, bits), the arrays held (a bias too) with their dtypes, and the
    input width; None for one that cannot stack (another class, another quantization mode)."""
    if type(linear) is RowQuantizedLinear:
        if linear.mode != "affine" or linear.get("biases") is None:
            return None
        quant = (linear.group_size, linear.bits)
    elif type(linear) is RowLinear:
        quant = ()
    else:
        return None
    arrays = tuple(sorted((name, value.dtype) for name, value in linear.items()))
    return type(linear), quant, arrays, linear.weight.shape[1:]


def _linears(owner: nn.Module, paths: tuple[str, ...]) -> list[nn.Module | None]:
    """The modules at dotted `paths` under `owner` now (None where one is gone)."""
    found = []
    for path in paths:
        module = owner
        for name in path.split("."):
            module = module.get(name) if isinstance(module, nn.Module) else None
        found.append(module)
    return found


def _sources(linears: list[nn.Module | None]) -> tuple:
    """The linears and every array they hold, the objects themselves (held, so an id is never reused)."""
    return tuple(x for linear in linears for x in (linear, *(linear.values() if linear is not None else ())))


class StackedRows:
    """Linears that read the same input, run as one linear of their stacked rows, the output
    split back: one kernel launch instead of one per linear (a decode step is bound by launches,
    not bytes). Exact: every array of a linear (weight, an affine quantization's scales and
    biases, a bias) is per output row, so stacking rows changes no row's values, and each output
    is still one dot product of its row with the input (plus its own bias).

    Built in memory at load (`stack_rows`), never in the file format: the stacked arrays are
    made once, and the linears' own arrays then become row views of them (no second copy;
    `strata convert` and the state dict still see the linears' own tensors). Never built or
    rebuilt inside a forward pass, which may be an `mx.compile` trace (a trace may not evaluate,
    and would leave traced arrays as weights): once any of the linears or their arrays is
    replaced (`set_dtype`, quantizing, loading again) `stacked` drops the stack and callers run
    the linears apart until `stack_rows` stacks them again. A plain object, kept in a module's
    `__dict__`, so it is no parameter.
    """

    __slots__ = ("paths", "fused", "bounds", "sources")

    def __init__(self, owner: nn.Module, paths: tuple[str, ...]):
        """Stack the linears at `paths` under `owner` (of one `_row_form`) and make their arrays views."""
        linears = _linears(owner, paths)
        first = linears[0]
        fused = type(first).__new__(type(first))
        nn.Module.__init__(fused)
        if type(first) is RowQuantizedLinear:
            fused.group_size, fused.bits, fused.mode = first.group_size, first.bits, first.mode
        for name in first:
            fused[name] = mx.concatenate([linear[name] for linear in linears])
        mx.eval(fused.parameters())
        edges = [int(e) for e in np.cumsum([0] + [linear.weight.shape[0] for linear in linears])]
        for linear, lo, hi in zip(linears, edges, edges[1:]):
            for name in first:
                linear[name] = fused[name][lo:hi]
        mx.eval([linear.parameters() for linear in linears])
        self.paths, self.fused, self.bounds, self.sources = paths, fused, edges[1:-1], _sources(linears)

    def current(self, owner: nn.Module) -> bool:
        """Whether `owner` still holds the linears and arrays this stack was built from."""
        now = _sources(_linears(owner, self.paths))
        return len(now) == len(self.sources) and all(a is b for a, b in zip(now, self.sources))

    def __call__(self, x: mx.array) -> tuple[mx.array, ...]:
        return self.outputs(x)[1]

    def outputs(self, x: mx.array) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The stacked output (..., the linears' widths summed), and it split back: for a kernel
        that reads one linear's columns from the stacked rows (no copy of a strided view)."""
        out = self.fused(x)
        return out, tuple(mx.split(out, self.bounds, axis=-1))


def stack(owner: nn.Module, name: str, *paths: str) -> None:
    """Stack the linears at dotted `paths` under `owner` (`StackedRows`) and keep the stack on
    `owner` as `name`, where their forms match; else none is kept and they run apart."""
    owner.__dict__.pop(name, None)
    forms = {_row_form(linear) for linear in _linears(owner, paths)}
    if len(forms) == 1 and None not in forms:
        owner.__dict__[name] = StackedRows(owner, paths)


def stacked(owner: nn.Module, name: str) -> StackedRows | None:
    """The stack `stack` kept on `owner` as `name`, where it is built and still current; a stale
    one is dropped (its arrays freed), never rebuilt here."""
    rows = owner.__dict__.get(name)
    if rows is not None and not rows.current(owner):
        del owner.__dict__[name]
        rows = None
    return rows


def stack_rows(model: nn.Module) -> nn.Module:
    """Every module's `stack_linears()` (where it has one), once its weights are loaded."""
    for _, module in model.named_modules():
        if hasattr(module, "stack_linears"):
            module.stack_linears()
    return model


class RMSNorm(nn.Module):
    """RMSNorm with a plain multiplicative weight (zero-centred checkpoints add 1 at load)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        """h = x + y and self(h): a pre-norm layer's residual add and this norm after it. A window
        on a GPU (serial 1-row steps too, so they share its arithmetic) runs both in one kernel
        (metal_shaders/add_norm.py) where the operands are a shape and dtype it takes and its
        probe passed; elsewhere (the CPU, prompt chunks, a subclass) MLX's two ops."""
        rows = x.size // x.shape[-1] if x.ndim else 0
        if (type(self) is RMSNorm and RowSplit.kernel_may_take(rows) and add_norm.takes(x, y, self.weight)
                and add_norm.usable(x.dtype)):
            return add_norm.add_norm(x, y, self.weight, self.eps)
        h = x + y
        return h, self(h)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate), computed in float32 as the reference does, x rounded
    to gate's (the model's) dtype first: the casts share kernels with their neighbours. A window
    on a GPU (serial 1-row steps too, so they share its arithmetic) runs it in one kernel
    (metal_shaders/gated_norm.py) where the operands are shapes and dtypes it takes and its probe
    passed; elsewhere (the CPU, prompt chunks, a subclass) MLX's ops."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        if self.takes_kernel(x, gate, self.weight):
            return gated_norm.gated_norm(x, gate, self.weight, self.eps, groups=x.shape[-2], group_size=x.shape[-1])
        return silu_gate_f32(rms_norm(rounded_f32(x, gate), None, self.eps), self.weight, gate)

    def over_heads(self, x: mx.array, gate: mx.array, weight: mx.array) -> mx.array:
        """`self(x, gate)` flattened over heads: x (..., heads, dims), gate (..., heads·dims) as its
        projection gives it, `weight` this norm's weight tiled over the heads -> (..., heads·dims).
        The same values, one reshape fewer (the gate is never reshaped to heads)."""
        if self.takes_kernel(x, gate, weight):
            return gated_norm.gated_norm(x, gate, weight, self.eps, groups=x.shape[-2], group_size=x.shape[-1])
        normed = rms_norm(rounded_f32(x, gate), None, self.eps)
        return silu_gate_f32(normed.reshape(gate.shape), weight, gate)

    def takes_kernel(self, x: mx.array, gate: mx.array, weight: mx.array) -> bool:
        """Whether the gated-norm kernel runs this call: x (B, T, heads, dims) float32, B·T <= 8
        rows, gate (B, T, heads·dims) or x's shape and the weight (dims,) or tiled, in gate's dtype."""
        if type(self) is not GatedRMSNorm or x.ndim != 4:
            return False
        B, T, heads, dims = x.shape
        gate_ok = gate.shape == x.shape or gate.shape == (B, T, heads * dims)
        return (gate_ok and RowSplit.kernel_may_take(B * T)
                and gated_norm.takes(x, gate, weight, groups=heads, group_size=dims) and gated_norm.usable(gate.dtype))


def gate_up_kernel(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """swiglu(gate(x), up(x)) in one launch of the row-invariant GLU kernel
    (metal_shaders/rows_matvec.py) where it takes a window's rows (serial 1-row steps too, so
    they share its arithmetic): two bias-free linears of one form (`RowLinear`s of one dtype, or
    `RowQuantizedLinear`s of one affine quantization) and a dtype whose GLU probe passed. None
    elsewhere (the CPU, prompt chunks): the caller runs the linears and `swiglu`."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    form = _row_form(gate)
    if (not RowSplit.kernel_may_take(rows) or form is None or form != _row_form(up) or "bias" in gate
            or gate.weight.shape != up.weight.shape):
        return None
    if type(gate) is RowQuantizedLinear:
        if not (kernels.supports(x.shape[-1], group_size=gate.group_size, bits=gate.bits)
                and kernels.glu_usable(x.dtype)):
            return None
        return kernels.rows_glu_qmatvec(x, (gate.weight, gate.scales, gate.biases), (up.weight, up.scales, up.biases),
                                        group_size=gate.group_size, bits=gate.bits)
    if not (kernels.supports(x.shape[-1]) and kernels.glu_usable(x.dtype)):
        return None
    return kernels.rows_glu_matvec(x, gate.weight, up.weight)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = RowLinear(dims, hidden_dims, bias=False)
        self.up_proj = RowLinear(dims, hidden_dims, bias=False)
        self.down_proj = RowLinear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activated(x))

    def activated(self, x: mx.array, gate_up: StackedRows | None = None) -> mx.array:
        """silu(gate(x)) * up(x): the GLU kernel's one launch where it takes x (`gate_up_kernel`),
        else the two linears (as one `gate_up` stack where the caller has it) and `swiglu`."""
        h = gate_up_kernel(x, self.gate_proj, self.up_proj)
        if h is not None:
            return h
        return swiglu(*(gate_up(x) if gate_up is not None else project(x, self.gate_proj, self.up_proj)))


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm and logits (tied or `lm_head`).

    Each architecture subclasses it with its own layers and `sanitize`. Per-layer state comes
    from the caller (the window engine); `state_kinds` says what each layer needs, attention
    KV by default.
    """

    def __init__(self, config, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = layers
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = RowLinear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        return [("kv", {}) for _ in self.layers]

    def state_span(self, start: int, stop: int) -> slice:
        """Which of `state_kinds` belong to layers start..stop-1 (every layer has one here)."""
        return slice(start, stop)

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens (B, T) -> the first layer's input (B, T, D): on the host path rows taken in
        numpy (the same values), so the first layer reads them without waiting on MLX's stream;
        elsewhere `lookup_embedding` (on a GPU a quantized table's rows in one kernel)."""
        embed = self.model.embed_tokens
        if type(embed) is nn.Embedding and embed.weight.dtype == mx.float32 and host_rows(tokens.size, mx.float32):
            return mx.array(host_weight(embed)[np.asarray(tokens)])
        return lookup_embedding(embed, tokens)

    def run_layers(self, h: mx.array, states: list, start: int = 0, stop: int | None = None) -> mx.array:
        """Layers start..stop-1 over h, with their states (`states[state_span(start, stop)]`)."""
        for layer, state in zip(self.layers[start:stop], states):
            h = layer(h, state)
        return h

    def logits_linear(self) -> nn.Module:
        """The module whose weight makes the logits: the tied embedding or `lm_head`."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def host_logits(self, rows: int) -> bool:
        """Whether `head` computes the logits of `rows` float32 rows in numpy, so that they are
        ready without MLX's stream (`WindowEngine` then takes the greedy token there too): a
        float32 RMSNorm and a float32 tied embedding or bias-free `RowLinear` on the host path."""
        norm, linear = self.model.norm, self.logits_linear()
        form = nn.Embedding if self.config.tie_word_embeddings else RowLinear
        return (host_rows(rows, mx.float32) and type(norm) is RMSNorm and norm.weight.dtype == mx.float32
                and type(linear) is form and "bias" not in linear and linear.weight.dtype == mx.float32)

    def head(self, h: mx.array, *, last_only: bool = False) -> mx.array:
        """The last layer's output (B, T, D) -> logits (B, T, V), or (B, 1, V) for the last row only."""
        if h.dtype == mx.float32 and self.host_logits(h.shape[0] if last_only else h.size // h.shape[-1]):
            rows = np.asarray(h)[:, -1:] if last_only else np.asarray(h)
            norm = self.model.norm
            logits = host_blas.logits(rows.reshape(-1, rows.shape[-1]), host_weight(norm), norm.eps,
                                      host_weight(self.logits_linear()))
            return mx.array(logits.reshape(*rows.shape[:-1], -1))
        if last_only:
            h = h[:, -1:]
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            return tied_logits(self.model.embed_tokens, h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last row only."""
        return self.head(self.run_layers(self.embed(tokens), states), last_only=last_only)


# A DeepSeek-style MTP layer (DeepSeek-V3, GLM-4.x MoE): besides its decoder layer, the tensors
# that join its input to the model's last hidden state, and two that repeat the model's own
# embedding and head, which some checkpoints carry and others leave out.
MTP_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_head_shapes(hidden_size: int, vocab_size: int, optional: tuple[str, ...] = MTP_OPTIONAL) -> dict[str, tuple[int, ...]]:
    """An MTP layer's own tensors and shapes (not its decoder layer's): `eh_proj` (H, 2H), `enorm`,
    `hnorm`, `shared_head.norm`, and the `optional` names of MTP_OPTIONAL (each (V, H))."""
    H, V = hidden_size, vocab_size
    shapes = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,)}
    shapes.update(dict.fromkeys(optional, (V, H)))
    return shapes


class KeptAside(nn.Module):
    """Checkpoint tensors loaded and kept aside, unused by the forward pass (a checkpoint's
    multi-token-prediction layers: a later drafter reads them), never dropped, written back by
    `strata convert`.

    Plain arrays, not layers: no quantization, streaming or expert cache ever takes them for the
    model's own (a sparse block here would be one more MoE layer to stream).

    Args:
        shapes: dotted parameter name -> shape (zeros until the checkpoint's tensors load).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        for key, value in tree_unflatten([(k, mx.zeros(s)) for k, s in shapes.items()]).items():
            self[key] = value
