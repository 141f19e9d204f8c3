"""A GPU window's layers handed to the device as they are built.

A decode window is built on the host, layer by layer, then evaluated. Built whole, its graph
keeps the device idle while the host builds it (0.9-1.0 ms of a 3-5 ms window on the H200's
80B-A3B shape, docs/benchmarks.md), and then keeps the host idle while the device runs. Inside
`LayerDispatch.window()` the layer loops hand the device the window in `pieces` runs of layers,
each as soon as it is built (`mx.async_eval`), so the device runs one while the host builds the
next (the last piece goes with the window's own evaluation). The window's arrays and arithmetic
are the same; only when each part is evaluated changes.

Only windows whose result the decode loop waits for take it (`WindowEngine.run`): serial steps
already overlap one step's building with the step before (`WindowEngine.launch`), and the CPU's
host path evaluates as it builds. It is off unless STRATA_LAYER_DISPATCH=N asks for N pieces: on
an H100 (MLX 0.32.4 CUDA, `python -m scripts.lab.layer_dispatch`, tree bd55861) a T = 1 window
took 3.00 ms whole, 3.33 in 4 pieces and 3.53 in 8, T = 8 3.26 / 3.47 / 3.51: the hand-overs
cost more than the overlap saves there (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

ENV = "STRATA_LAYER_DISPATCH"


def _pieces_from_env() -> int:
    value = os.environ.get(ENV, "").strip()
    return int(value) if value.isdigit() else 0


class LayerDispatch:
    """`pieces`: runs of layers a window is handed over in (0, 1: whole); `window()`: where
    windows are (this thread); `mode`: "auto" (GPU backends), "always" (the CPU too: the tests
    check the results are the same), "never"."""

    pieces = _pieces_from_env()
    mode = "auto"
    _inside = threading.local()

    @classmethod
    @contextmanager
    def window(cls) -> Iterator[None]:
        """Layer loops run inside hand their layers over as built (on a GPU)."""
        before = getattr(cls._inside, "on", False)
        cls._inside.on = True
        try:
            yield
        finally:
            cls._inside.on = before

    @classmethod
    def after(cls, h: mx.array, done: int, total: int) -> None:
        """`done` of a loop's `total` layers are built, `h` their output: hand them to the device
        at the end of each piece but the last (the window's own evaluation takes that one)."""
        pieces = cls.pieces
        if pieces < 2 or done >= total or not getattr(cls._inside, "on", False) or cls.mode == "never":
            return
        every = -(-total // pieces)  # layers a piece, rounded up
        if done % every == 0 and (cls.mode == "always" or mx.default_device() == mx.gpu):
            mx.async_eval(h)
