"""What every kernel module of metal_shaders shares: kernels made for the running GPU backend
and kept by name, shapes passed as data, and the start-up probe.

A kernel runs only after it matched its reference on the running device at the caller's dtype,
in this process or in an earlier one with the same keys (`verdict_keys`, kept.py); any failure
(an NVRTC compile error, a launch error, a mismatch) is logged once and turns the kernel off for
the process at that dtype, so callers fall back to the reference path. On CUDA a kernel is
strata's own compile (precompiled.py), and a probe that fails on it is run again on MLX's build.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

import mlx.core as mx

from . import backends, kept, precompiled

log = logging.getLogger("strata.kernels")

_dims_cache: dict[tuple[int, ...], mx.array] = {}
_constants: dict[tuple[float, ...], mx.array] = {}
_kernels: dict[tuple[str, str], object] = {}
VERDICTS = "verdicts"
PROBE_DTYPES = (mx.float32, mx.bfloat16)  # a caller that names no dtype gets both


def gpu_kernel(name: str, inputs: list[str], outputs: list[str], body: str, header: str = "", *,
               ensure_row_contiguous: bool = True):
    """The kernel `body` (after `header`) for the running backend, behind that backend's prelude
    (backends.py): `mx.fast.cuda_kernel` or `mx.fast.metal_kernel`, made once per name for the
    process. `ensure_row_contiguous=False` passes views as they are (a body that reads
    `<input>_strides`), so no copy precedes the call."""
    which = backend() or backends.CUDA  # off a GPU only tests' stand-ins are ever called
    if (name, which) not in _kernels:
        make = mx.fast.metal_kernel if which == backends.METAL else mx.fast.cuda_kernel
        spec = dict(name=name, input_names=inputs, output_names=outputs, source=backends.source(which, body),
                    header=backends.header(which, header), ensure_row_contiguous=ensure_row_contiguous)
        kernel = make(**spec)
        if which == backends.CUDA:  # strata's own compile, kept across processes; MLX's where it fails
            kernel = precompiled.PrecompiledKernel(kernel, **spec)
        _kernels[name, which] = kernel
    return _kernels[name, which]


# On CUDA, MLX keeps an array made from host values in managed memory: up to 8 bytes in a pool it
# maps for the GPU, anything larger in pages that small arrays share and that migrate to whichever
# side touched them last (pooled.py says how a window's ids and tokens cross). The inputs every
# launch reads (`dims`, `constant`) are copied to device memory once, padded past the pool's 8
# bytes, since every read of a pooled array crosses the bus. STRATA_HOST_UPLOAD=0 turns both off.
POOL_INTS = 2  # int32s in one of MLX's pooled 8-byte buffers (mlx/backend/cuda/allocator.cpp)
MAX_UPLOAD_INTS = 16  # more (a prompt's ids) are made as one array: the fault is paid once for many rows


def upload_asked() -> bool:
    return os.environ.get("STRATA_HOST_UPLOAD", "1") != "0"


_upload = {"enabled": upload_asked(), "device": None, "on": False}


def uploads() -> bool:
    """Whether host ints go to kernels through MLX's pool (CUDA, unless STRATA_HOST_UPLOAD=0)."""
    device = mx.default_device()
    if _upload["device"] is None or _upload["device"] != device:
        _upload["device"], _upload["on"] = device, _upload["enabled"] and backend() == backends.CUDA
    return _upload["on"]


def _in_device_memory(array: mx.array) -> mx.array:
    """A copy of a host-made array that lives in device memory (a GPU op's output), where no host
    write ever moves its page; the array itself where it cannot be evaluated now (inside a trace)."""
    copy = array + 0
    try:
        mx.eval(copy)
    except (RuntimeError, ValueError):
        return array
    return copy


def _kept(values: tuple, dtype) -> mx.array:
    """A kernel input made once and read by every launch: with uploads on, in device memory and,
    where it would fit MLX's pool (8 bytes: read over the bus at every launch), padded past it with
    zeros the bodies never read (they index the values, never the shape)."""
    if not uploads():
        return mx.array(values, dtype=dtype)
    padded = values + (0,) * max(0, POOL_INTS + 1 - len(values))
    return _in_device_memory(mx.array(padded, dtype=dtype))


def dims(*values: int) -> mx.array:
    """Shapes as an int32 array: one compile serves every shape, so a new one never waits for NVRTC.
    Kept per shape (`_kept`)."""
    if values not in _dims_cache:
        _dims_cache[values] = _kept(values, mx.int32)
    return _dims_cache[values]


def constant(*values: float) -> mx.array:
    """float32s a body reads by index (a norm's epsilon, a softmax scale, dt's limits), kept per
    values (`_kept`)."""
    if values not in _constants:
        _constants[values] = _kept(values, mx.float32)
    return _constants[values]


def backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU of that backend, else None."""
    if mx.default_device() != mx.gpu:
        return None
    for name in backends.BACKENDS:
        module = getattr(mx, name, None)
        if module is not None and module.is_available():
            return name
    return None


class Probe:
    """The verdict on a family of kernels, per dtype: decided once per process, and kept across
    processes (kept.py) by MLX version, GPU, build (strata's precompiled kernels or MLX's),
    the source of every module of metal_shaders (kernel bodies, the probe's shapes and
    tolerances) and dtype. Only a pass is kept: a failure is probed again by the next process."""

    def __init__(self, what: str, fallback: str):
        self.what, self.fallback = what, fallback
        self.verdicts: dict[str, str | None] = {}  # dtype -> None (passed), what failed, or "" (no GPU)
        self.answers: dict = {}  # dtype (or None) -> what `usable` returned once every verdict was in
        self.kept_hits = 0

    @property
    def is_usable(self) -> bool | None:
        """None until asked; else whether every dtype asked so far passed."""
        if not self.verdicts:
            return None
        return all(error is None for error in self.verdicts.values())

    @property
    def error(self) -> str | None:
        return next((error for error in self.verdicts.values() if error), None)

    def usable(self, check: Callable[[tuple], str | None], dtype=None) -> bool:
        """Whether the kernels may run at `dtype` (None: every dtype PROBE_DTYPES names): `check(dtypes)`
        (None when the kernels pass at those dtypes, else what failed) is run the first time a
        dtype is asked, on a GPU backend only (CUDA or Metal), unless a pass is kept."""
        answer = self.answers.get(dtype)  # asked on every projection of every step: a dict lookup
        if answer is not None:
            return answer
        dtypes = PROBE_DTYPES if dtype is None else (dtype,)
        if precompiled.is_dry_run():  # inside another probe's dry run: follow the kernel path, decide nothing
            return True
        for d in dtypes:
            if str(d) not in self.verdicts:
                self.verdicts[str(d)] = self._decide(check, d)
        answer = self.answers[dtype] = all(self.verdicts[str(d)] is None for d in dtypes)
        return answer

    def takes(self, check: Callable[[tuple], str | None], dtype=None) -> bool:
        """`usable` for a kernel of float32 and bfloat16 (PROBE_DTYPES) only: True on a GPU (CUDA,
        Metal) once it matched its reference and was row-invariant on the probe at `dtype` (None:
        both); False elsewhere, at any other dtype (never probed), or after any failure (logged once)."""
        return (dtype is None or dtype in PROBE_DTYPES) and self.usable(check, dtype)

    def _decide(self, check, dtype) -> str | None:
        which = backend()
        if which is None:
            return ""  # off a GPU: not usable, and nothing failed
        keys = verdict_keys(self.what, dtype, which)
        if kept.read(VERDICTS, self.what, keys) is not None:
            self.kept_hits += 1
            return None
        if which == backends.CUDA:  # the probe's kernels compiled at once, on threads
            precompiled.compile_ahead(lambda: check(dtypes=(dtype,)))
        error = _run(check, dtype)
        if error is not None and which == backends.CUDA and precompiled.active():
            precompiled.disable(f"{self.what} failed on them: {error}")  # MLX's build of the same source
            keys = verdict_keys(self.what, dtype, which)
            error = _run(check, dtype)
        if error is None:
            kept.write(VERDICTS, self.what, keys, {"what": self.what})
        else:
            log.warning("%s disabled (%s); %s", self.what, error, self.fallback)
        return error

    def status(self) -> dict:
        """`probed` False: nothing has asked yet (no forward pass), so `usable` says nothing."""
        return {"usable": bool(self.is_usable), "probed": self.is_usable is not None, "error": self.error}


def _run(check, dtype) -> str | None:
    try:
        return check(dtypes=(dtype,))
    except Exception as e:  # compile errors (NVRTC, Metal) and launch failures come as several types
        return f"{type(e).__name__}: {e}"


def cases_at(cases, dtypes, index: int = 1) -> list:
    """The probe cases (tuples with a dtype at `index`) at `dtypes`: those whose dtype is asked,
    else every case at the first asked dtype (a model dtype no case names, float16)."""
    chosen = [case for case in cases if case[index] in dtypes]
    return chosen or [(*case[:index], dtypes[0], *case[index + 1 :]) for case in cases]


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """The hash of every module of metal_shaders: a kernel body, a reference, a probe's shapes or
    tolerances changed anywhere invalidates every kept verdict."""
    return kept.digest({p.name: p.read_text() for p in sorted(Path(__file__).parent.glob("*.py"))})


def verdict_keys(what: str, dtype, which: str) -> dict:
    """Everything a kept verdict holds for: MLX version, device, build, sources, family, dtype."""
    try:
        device = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        device = ""
    build = precompiled.BUILD if which == backends.CUDA and precompiled.active() else "mlx"
    return {"mlx": mx.__version__, "backend": which, "device": device, "build": build, "sources": sources_digest(),
            "family": what, "dtype": str(dtype)}
