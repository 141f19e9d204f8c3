"""Staging: where expert records land from the disk, already inside MLX arrays.

A read goes straight into a slot of a staging chunk (one MLX uint8 array of page-aligned slots of
one stride, written by the reader threads through its NumPy view), and an install copies the
record's tensors from device views of that slot into the slot banks. No per-tensor host copy,
no per-record allocation.

On CUDA an array MLX hands to the host lives in managed memory, whose pages migrate to whichever
side touched them last: the GPU's copy faults a record over, and the next host write faults it
back. That migration was the H200's 1.2 ms install of a 1.77 MB record
(`scripts/lab/install_bench.py`). A chunk is advised to stay in host memory and be mapped for
the GPU (`cuda_driver.host_mapped`), so the host writes locally and the GPU reads over the bus:
0.57 ms a record there, and less when the disk writes the slot itself.

Reuse rule: MLX does not know the host writes into a chunk, so a slot is taken again only once
every install that read it has run. An install gives back the banks it wrote
(`release(slot, readers)`); taking that slot again evaluates their current arrays first, which is free when the layer's compute
has already run them (the usual case, slots are reused oldest first) and a sync otherwise.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import mlx.core as mx
import numpy as np

SLOTS_PER_CHUNK = 16
PAGE = 4096  # O_DIRECT's alignment (the layout's records are multiples of it)


class Slot:
    """One staging slot: `view` for the reader (a writable memoryview of `stride` bytes),
    `flat` for the device (the same bytes as an MLX uint8 array), and `tensors`, the device views
    of a record's tensors in it by layout (experts/cache.py makes them once: the reader rewrites
    the bytes under them)."""

    __slots__ = ("index", "view", "flat", "tensors")

    def __init__(self, index: int, view: memoryview, flat: mx.array):
        self.index, self.view, self.flat = index, view, flat
        self.tensors: dict[int, dict[str, mx.array]] = {}


class StagingArea:
    """Staging slots of one stride, grown a chunk at a time as reads in flight need them."""

    def __init__(self, stride: int, *, advise: Callable[[int, int], bool] | None = None):
        self.stride = stride
        self._advise = advise
        self.advised = 0  # chunks the GPU reads in place (CUDA advice taken)
        self._slots: list[Slot] = []
        self._free: deque[int] = deque()
        self._readers: dict[int, Callable[[], list[mx.array]]] = {}
        self._lock = threading.Lock()

    def take(self) -> Slot:
        """A free slot, the oldest released first (main thread: it may evaluate MLX arrays)."""
        with self._lock:
            if not self._free:
                self._grow()
            index = self._free.popleft()
            readers = self._readers.pop(index, None)
        if readers is not None:
            mx.eval(readers())  # the installs that read this slot must run before it is overwritten
        return self._slots[index]

    def release(self, slot: Slot, readers: Callable[[], list[mx.array]] | None = None) -> None:
        """Give `slot` back; `readers` returns the arrays whose evaluation runs every install
        that read it (None: nothing read it)."""
        with self._lock:
            if readers is not None:
                self._readers[slot.index] = readers
            self._free.append(slot.index)

    @property
    def size(self) -> int:
        return len(self._slots)

    def _grow(self) -> None:
        chunk = mx.zeros((SLOTS_PER_CHUNK * self.stride + PAGE,), dtype=mx.uint8)
        mx.eval(chunk)
        host = np.array(chunk, copy=False)  # on CUDA this moves the chunk to managed memory
        address = host.__array_interface__["data"][0]
        skip = -address % PAGE  # O_DIRECT wants page-aligned buffers
        if self._advise is not None:
            self.advised += self._advise(address + skip, SLOTS_PER_CHUNK * self.stride)
        data = memoryview(host)
        for j in range(SLOTS_PER_CHUNK):
            start = skip + j * self.stride
            self._free.append(len(self._slots))
            self._slots.append(Slot(len(self._slots), data[start : start + self.stride],
                                    chunk[start : start + self.stride]))
