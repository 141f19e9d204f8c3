"""Small arrays the host makes for every decode window (token ids, a kernel's sizes, masks), made
so that a CUDA GPU reads them without a page fault.

On CUDA, MLX keeps an array made from host values in managed memory: up to 8 bytes in a pool
it maps for the GPU, anything larger in pages that migrate to whichever side touched them last.
The first kernel that reads such an array faults its page over to the GPU, and the host's next
write into the recycled buffer faults it back: on the H200 a window's embedding lookup took
0.03 ms at 1 and 2 tokens (8 bytes of ids) and 0.29-0.34 ms at 4 and 8 (docs/benchmarks.md).
`host_array` maps the pages of each larger array for the GPU once (`cuda_driver.host_mapped`,
the advice MLX gives its own pool), so the GPU reads them over the bus where they are. Off CUDA,
or with STRATA_HOST_ARRAYS=0 (a comparison), it is `mx.array`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import mlx.core as mx

from . import cuda_driver

ENV = "STRATA_HOST_ARRAYS"  # 0: plain mx.array (the pages migrate as MLX leaves them)
POOL_BYTES = 8  # MLX maps arrays this small itself (mlx/backend/cuda/allocator.cpp: small_block_size)
PAGE = 4096
MAX_PAGES = 1 << 16  # pages remembered as mapped; MLX recycles its buffers, so few ever are


class _Pages:
    """The host pages mapped for the GPU so far, and how to map more (decided per device)."""

    def __init__(self):
        self.device: mx.Device | None = None
        self.advise: Callable[[int, int], bool] | None = None
        self.mapped: set[int] = set()
        self.refused = 0  # advice the driver refused (the arrays still work, their pages migrating)

    def wanted(self) -> bool:
        device = mx.default_device()
        if self.device is None or device != self.device:
            wanted = cuda_driver.is_cuda() and os.environ.get(ENV, "1") != "0"
            self.device, self.advise = device, cuda_driver.host_mapped(stay_on_host=False) if wanted else None
        return self.advise is not None

    def map(self, array: mx.array) -> None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(memoryview(array)))  # any dtype, bfloat16 too
        first, end = address - address % PAGE, address + array.nbytes
        pages = range(first, end, PAGE)
        if all(page in self.mapped for page in pages):
            return
        if not self.advise(first, end - first):
            self.refused += 1
            if self.refused >= 8:  # a driver that refuses every time: stop asking
                self.advise = None
            return
        if len(self.mapped) >= MAX_PAGES:
            self.mapped.clear()  # mapping a page again is harmless, and cheap
        self.mapped.update(pages)


_pages = _Pages()


def host_array(values, dtype: mx.Dtype | None = None) -> mx.array:
    """`mx.array(values, dtype)`, on CUDA with its pages mapped for the GPU where MLX does not map
    them itself (more than 8 bytes)."""
    array = mx.array(values) if dtype is None else mx.array(values, dtype=dtype)
    if array.nbytes > POOL_BYTES and _pages.wanted():
        _pages.map(array)
    return array
