"""serve-stdio's I/O edges: request lines from stdin, frames to the real stdout, signals.

- `LineReader` reads stdin's file descriptor on a thread, so the main thread can wait for a line
  and still notice a signal. A line longer than the limit is skipped without being held in
  memory and reported as an `OversizeLine`.
- `ReadAhead` numbers the reader's lines and lets the server look at those behind the request in
  flight (a cancel line) while still handing every line out in its turn.
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
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

READ_SIZE = 1 << 16
QUEUE_LINES = 8  # lines read ahead of the request in flight
AHEAD_LINES = 256  # lines `ReadAhead` may hold besides the reader's queue, looking for cancel lines
AHEAD_BYTES = 16 << 20  # ... and bytes (one longer line may pass it)
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


class ReadAhead:
    """A `LineReader`'s items, numbered from 1 in order, with a look at those not handed out yet.

    `get` hands out the next item in its turn; `look_ahead` takes what the reader holds now
    (without waiting, while fewer than `max_lines` items and `max_bytes` bytes are held) and
    returns those new items, which `get` still hands out later. The server looks ahead while a
    request decodes, so it sees a cancel line that arrived behind it.

    Args:
        reader: the line reader (anything with `get(timeout)`).
        max_lines: most items held ahead (default `AHEAD_LINES`).
        max_bytes: most bytes held ahead, past which nothing more is taken (default `AHEAD_BYTES`).
    """

    def __init__(self, reader: LineReader, *, max_lines: int = AHEAD_LINES, max_bytes: int = AHEAD_BYTES):
        self.reader = reader
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._held: deque = deque()
        self._held_bytes = 0
        self._count = 0
        self._is_ended = False

    def get(self, timeout: float):
        """`(number, item)` for the next item (as `LineReader.get` gives them), or `NOTHING`."""
        if self._held:
            number, item = self._held.popleft()
            self._held_bytes -= _num_bytes(item)
            return number, item
        item = self.reader.get(timeout)
        return NOTHING if item is NOTHING else self._numbered(item)

    def look_ahead(self) -> list[tuple[int, object]]:
        """The `(number, item)`s that came in since the last look, taken without waiting."""
        new = []
        while not self._is_ended and len(self._held) < self.max_lines and self._held_bytes < self.max_bytes:
            item = self.reader.get(0)
            if item is NOTHING:
                break
            entry = self._numbered(item)
            self._held.append(entry)
            self._held_bytes += _num_bytes(item)
            new.append(entry)
        return new

    def _numbered(self, item) -> tuple[int, object]:
        self._count += 1
        self._is_ended = item is EOF
        return self._count, item


def _num_bytes(item) -> int:
    return len(item) if isinstance(item, bytes) else 0


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
