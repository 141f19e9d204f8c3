"""A simulated slow disk for benchmarks: each expert record read costs a fixed time on one queue.

The demo model's experts are 98 KB and come from the page cache in tens of microseconds, so on it
reads are nearly free and anything that saves reads (prefetch, cache-aware routing) has little to
save. A real streamed MoE reads much larger records from a real disk: Qwen3-Next-80B-A3B's 4-bit
experts are 1.77 MB, and the H200 machine's disk reads them at 1.11 GB/s (random, 8 threads;
docs/benchmarks.md, "Expert streaming"), about 1.6 ms per record.

`SimulatedDisk(ms).attach(store)` makes every `store.read` first hold one shared lock for `ms`
milliseconds, sleeping (so the GIL is free and compute overlaps it, as with a real disk), then do
the real read. One lock for all reader threads models a bandwidth-bound device: reads queue, their
throughput is 1/ms records per second however many threads ask. Benchmarks only: nothing in the
CLI can turn it on.
"""

from __future__ import annotations

import threading
import time

from strata_cli.experts.store import ExpertStore

H200_80B_RECORD_MS = 1.6  # 1.77 MB record / 1.11 GB/s random read (docs/benchmarks.md)


class SimulatedDisk:
    """Adds `ms` milliseconds per record read, queued on one device shared by every attached store.

    Args:
        ms: the simulated time one record read holds the device (0: real reads only).
    """

    def __init__(self, ms: float):
        if not ms >= 0:
            raise ValueError(f"simulated read time must be >= 0 ms, got {ms}")
        self.seconds = ms / 1000
        self.reads = 0
        self._device = threading.Lock()

    def attach(self, store: ExpertStore) -> None:
        """Route `store`'s reads through this device (a no-op at 0 ms)."""
        if not self.seconds:
            return
        read = store.read

        def slow_read(path, expert, buf):
            with self._device:
                time.sleep(self.seconds)
                self.reads += 1
            return read(path, expert, buf)

        store.read = slow_read
