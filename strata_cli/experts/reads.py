"""ReadQueue: the reader threads of an expert cache, with demand reads ahead of read-ahead.

A demand read (an expert a block needs now) stalls the compute; a read-ahead is a guess. With a
plain thread pool every read goes to the disk as it comes, so a demand read queues behind the
guesses issued before it. Here read-aheads wait in strata's own queue and go to the disk only
while no demand read is queued or running and fewer than `readahead_depth` read-aheads are at
the disk: a demand read waits at most for the read-aheads already started. A read-ahead still
queued can be cancelled (its block routed without it) or promoted to a demand read (its block
needs it now).

With `readahead_depth` None the queue is a plain FIFO over every thread: each read starts as soon
as a thread is free, in the order it was submitted, as `ThreadPoolExecutor` does.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable


class ReadQueue:
    """Runs reads on `threads` reader threads; demand reads before read-aheads.

    Args:
        threads: reader threads (at least 1).
        readahead_depth: most read-aheads at the disk at once, and none while a demand read is
            queued or running; None (default): no lanes, every read in submission order.
        name: the threads' name prefix.
    """

    def __init__(self, threads: int, *, readahead_depth: int | None = None, name: str = "strata-reads"):
        if threads < 1:
            raise ValueError(f"reader threads must be at least 1, got {threads}")
        if readahead_depth is not None and readahead_depth < 1:
            raise ValueError(f"read-ahead depth must be at least 1, got {readahead_depth}")
        self.readahead_depth = readahead_depth
        self._cond = threading.Condition()
        self._demand: deque[tuple[Future, Callable]] = deque()
        self._ahead: deque[tuple[Future, Callable]] = deque()
        self._demand_running = 0
        self._ahead_running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{n}", daemon=True) for n in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def has_lanes(self) -> bool:
        return self.readahead_depth is not None

    def submit(self, read: Callable, *, demand: bool = True) -> Future:
        """Queue `read()` (a demand read, or a read-ahead with `demand=False`); its future."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the expert reader is closed")
            lane = self._demand if demand or not self.has_lanes else self._ahead
            lane.append((future, read))
            self._cond.notify()
        return future

    def promote(self, future: Future) -> bool:
        """Move a queued read-ahead to the end of the demand lane; False if it is not queued
        (started, done, or never a read-ahead)."""
        with self._cond:
            for n, (queued, read) in enumerate(self._ahead):
                if queued is future:
                    del self._ahead[n]
                    self._demand.append((queued, read))
                    self._cond.notify()
                    return True
        return False

    def _next(self) -> tuple[Future, Callable, bool] | None:
        """The next read to start (under the lock), waiting for one; None once closed."""
        while True:
            if self._demand:
                self._demand_running += 1
                return (*self._demand.popleft(), True)
            depth = self.readahead_depth
            if self._ahead and not self._demand_running and (depth is None or self._ahead_running < depth):
                self._ahead_running += 1
                return (*self._ahead.popleft(), False)
            if self._closed:
                return None
            self._cond.wait()

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            future, read, is_demand = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(read())
                except BaseException as e:  # the future carries it to whoever waits
                    future.set_exception(e)
            with self._cond:
                if is_demand:
                    self._demand_running -= 1
                else:
                    self._ahead_running -= 1
                self._cond.notify_all()

    def shutdown(self, *, wait: bool = True) -> None:
        """Cancel every queued read, let the running ones finish, stop the threads."""
        with self._cond:
            self._closed = True
            for lane in (self._demand, self._ahead):
                for future, _ in lane:
                    future.cancel()
                lane.clear()
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
