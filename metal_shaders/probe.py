"""What every kernel module of metal_shaders shares: compiled kernels kept by name, shapes
passed as data, and the start-up probe.

A kernel runs only after it matched its reference on the running device once; any failure
(an NVRTC compile error, a launch error, a mismatch) is logged once and turns the kernel off for
the process, so callers fall back to the reference path.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx

log = logging.getLogger("strata.kernels")

_dims_cache: dict[tuple[int, ...], mx.array] = {}
_kernels: dict[str, object] = {}


def cuda_kernel(name: str, inputs: list[str], outputs: list[str], source: str, header: str, *,
                ensure_row_contiguous: bool = True):
    """`mx.fast.cuda_kernel` made once per name for the process. `ensure_row_contiguous=False`
    passes views as they are (a body that reads `<input>_strides`), so no copy precedes the call."""
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                             source=source, header=header,
                                             ensure_row_contiguous=ensure_row_contiguous)
    return _kernels[name]


def dims(*values: int) -> mx.array:
    """Shapes as an int32 array: one compile serves every shape, so a new one never waits for NVRTC."""
    if values not in _dims_cache:
        _dims_cache[values] = mx.array(values, dtype=mx.int32)
    return _dims_cache[values]


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


class Probe:
    """The once-per-process verdict on a family of kernels."""

    def __init__(self, what: str, fallback: str):
        self.what, self.fallback = what, fallback
        self.is_usable: bool | None = None
        self.error: str | None = None

    def usable(self, check: Callable[[], str | None]) -> bool:
        """Run `check` (None when the kernels pass, else what failed) the first time, on CUDA only."""
        if self.is_usable is not None:
            return self.is_usable
        if not on_cuda():
            self.is_usable = False
            return False
        try:
            self.error = check()
        except Exception as e:  # NVRTC compile errors and launch failures come as several types
            self.error = f"{type(e).__name__}: {e}"
        self.is_usable = self.error is None
        if not self.is_usable:
            log.warning("%s disabled (%s); %s", self.what, self.error, self.fallback)
        return self.is_usable

    def status(self) -> dict:
        """`probed` False: nothing has asked yet (no forward pass), so `usable` says nothing."""
        return {"usable": bool(self.is_usable), "probed": self.is_usable is not None, "error": self.error}
