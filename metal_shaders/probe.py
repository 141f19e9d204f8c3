"""What every kernel module of metal_shaders shares: kernels made for the running GPU backend
and kept by name, shapes passed as data, and the start-up probe.

A kernel runs only after it matched its reference on the running device once; any failure
(an NVRTC compile error, a launch error, a mismatch) is logged once and turns the kernel off for
the process, so callers fall back to the reference path.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx

from . import backends

log = logging.getLogger("strata.kernels")

_dims_cache: dict[tuple[int, ...], mx.array] = {}
_kernels: dict[tuple[str, str], object] = {}


def gpu_kernel(name: str, inputs: list[str], outputs: list[str], body: str, header: str = "", *,
               ensure_row_contiguous: bool = True):
    """The kernel `body` (after `header`) for the running backend, behind that backend's prelude
    (backends.py): `mx.fast.cuda_kernel` or `mx.fast.metal_kernel`, made once per name for the
    process. `ensure_row_contiguous=False` passes views as they are (a body that reads
    `<input>_strides`), so no copy precedes the call."""
    which = backend() or backends.CUDA  # off a GPU only tests' stand-ins are ever called
    if (name, which) not in _kernels:
        make = mx.fast.metal_kernel if which == backends.METAL else mx.fast.cuda_kernel
        _kernels[name, which] = make(name=name, input_names=inputs, output_names=outputs,
                                     source=backends.source(which, body), header=backends.header(which, header),
                                     ensure_row_contiguous=ensure_row_contiguous)
    return _kernels[name, which]


def dims(*values: int) -> mx.array:
    """Shapes as an int32 array: one compile serves every shape, so a new one never waits for NVRTC."""
    if values not in _dims_cache:
        _dims_cache[values] = mx.array(values, dtype=mx.int32)
    return _dims_cache[values]


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
    """The once-per-process verdict on a family of kernels."""

    def __init__(self, what: str, fallback: str):
        self.what, self.fallback = what, fallback
        self.is_usable: bool | None = None
        self.error: str | None = None

    def usable(self, check: Callable[[], str | None]) -> bool:
        """Run `check` (None when the kernels pass, else what failed) the first time, on a GPU
        backend only (CUDA or Metal)."""
        if self.is_usable is not None:
            return self.is_usable
        if backend() is None:
            self.is_usable = False
            return False
        try:
            self.error = check()
        except Exception as e:  # compile errors (NVRTC, Metal) and launch failures come as several types
            self.error = f"{type(e).__name__}: {e}"
        self.is_usable = self.error is None
        if not self.is_usable:
            log.warning("%s disabled (%s); %s", self.what, self.error, self.fallback)
        return self.is_usable

    def status(self) -> dict:
        """`probed` False: nothing has asked yet (no forward pass), so `usable` says nothing."""
        return {"usable": bool(self.is_usable), "probed": self.is_usable is not None, "error": self.error}
