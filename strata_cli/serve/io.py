"""serve-stdio's I/O edges: request lines from stdin, frames to the real stdout, signals.

- `LineReader` reads stdin's file descriptor on a thread, so the main thread can wait for a line
  and still notice a signal. A line longer than the limit is skipped without being held in
  memory and reported as an `OversizeLine`.
- `protocol_stdout` hands out the real stdout for frames and points fd 1 and `sys.stdout` at
  stderr meanwhile, so a stray print (from strata or any library, C code included) can never
  corrupt the protocol.
- `SignalFlag` turns the first SIGINT/SIGTERM into a flag the server polls; a second one kills
  the process at once (the default action).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

READ_SIZE = 1 << 16
QUEUE_LINES = 8  # lines read ahead of the request in flight
EOF = object()  # `LineReader.get`: stdin is exhausted
NOTHING = object()  # `LineReader.get`: no line arrived in time


@dataclass(frozen=True)
class OversizeLine:
    """A line longer than the limit, skipped unread."""

    num_bytes: int


class LineReader:
    """Splits a file descriptor into lines on a daemon thread.

    Args:
        fd: the file descriptor to read (0 for stdin). Raw reads: no Python buffer lock is held
            while blocked, so exiting with the thread still blocked is safe.
        max_line_bytes: longest line kept; longer ones become `OversizeLine`.
    """

    def __init__(self, fd: int, max_line_bytes: int):
        self.fd = fd
        self.max_line_bytes = max_line_bytes
        self._lines: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self._thread = threading.Thread(target=self._run, name="strata-stdin", daemon=True)

    def start(self) -> "LineReader":
        self._thread.start()
        return self

    def get(self, timeout: float):
        """The next line (bytes, without its newline), an `OversizeLine`, `EOF`, or `NOTHING` when
        nothing arrived within `timeout` seconds."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return NOTHING

    def _run(self) -> None:
        buf = bytearray()
        skipped = -1  # bytes of the oversize line being skipped, or -1 when not skipping
        while True:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except OSError:
                chunk = b""
            if not chunk:
                if skipped >= 0:
                    self._lines.put(OversizeLine(skipped))
                elif buf:
                    self._lines.put(bytes(buf))
                self._lines.put(EOF)
                return
            start = 0
            while start <= len(chunk):
                newline = chunk.find(b"\n", start)
                piece = chunk[start:] if newline < 0 else chunk[start:newline]
                if skipped >= 0:
                    skipped += len(piece)
                else:
                    buf += piece
                    if len(buf) > self.max_line_bytes:
                        skipped = len(buf)
                        buf = bytearray()
                if newline < 0:
                    break
                if skipped >= 0:
                    self._lines.put(OversizeLine(skipped))
                    skipped = -1
                else:
                    self._lines.put(bytes(buf))
                    buf = bytearray()
                start = newline + 1


@contextmanager
def protocol_stdout() -> Iterator[BinaryIO]:
    """The real stdout as a binary stream; fd 1 and `sys.stdout` go to stderr until exit."""
    sys.stdout.flush()
    saved = os.dup(1)
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    previous, sys.stdout = sys.stdout, sys.stderr
    try:
        yield frames
    finally:
        sys.stdout = previous
        try:
            frames.close()
        except OSError:  # the reader is gone; nothing left to flush to
            pass
        os.dup2(saved, 1)
        os.close(saved)


class SignalFlag:
    """Records the first SIGINT or SIGTERM; the default action comes back for the next one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> "SignalFlag":
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def is_set(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
