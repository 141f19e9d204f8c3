"""What the CLI does at a terminal: consoles that never cut a table on a file or pipe, the prompt
progress bar, the first run's kernel-compile line and bar, and the interrupt latch that lets Ctrl-C or SIGTERM stop after the output is written."""

from __future__ import annotations

import contextlib
import signal
import time

WIDE = 1000  # columns of a console that is a file or pipe: tables there are never cut


def make_console(*, stderr: bool = False):
    """A rich Console on stdout or stderr; on a file or pipe it is wide (nothing truncated) and
    plain (no colour codes)."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=WIDE)


PREFILL_BAR_AFTER_S = 1.0  # prefill expected to take longer than this gets a bar


class PrefillBar:
    """`decode.generate`'s `prefill_progress`: a prompt bar on a terminal's stderr, shown once
    prefill looks set to take over PREFILL_BAR_AFTER_S (judged after each chunk), then removed."""

    def __init__(self, console, clock=time.perf_counter):
        self.console, self.clock = console, clock
        self.start = clock()
        self.bar = self.task = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            elapsed = self.clock() - self.start
            if not self.console.is_terminal or done >= total or elapsed * total / done < PREFILL_BAR_AFTER_S:
                return
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("prompt"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("prompt", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class WarmUpBar:
    """`runtime.open_model`'s `announce` and `warm_progress`: the cold-cache line on stderr, then
    on a terminal a bar of the window shapes being compiled, removed when done."""

    def __init__(self, console):
        self.console = console
        self.bar = self.task = None
        self.announced = False

    def announce(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        self.announced = True

    def __call__(self, done: int, total: int) -> None:
        if not (self.announced and self.console.is_terminal):
            return
        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("compiling window shapes"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.task = self.bar.add_task("shapes", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class Terminated(Exception):
    """SIGTERM stopped the command (run_guarded exits 143, as KeyboardInterrupt exits 130)."""


class InterruptLatch:
    """SIGINT/SIGTERM while a prompt decodes raise `Cancelled` there; between prompts they are
    only latched, and the next prompt raises at its start (so no signal lands where a record
    could be lost)."""

    class Cancelled(Exception):
        pass

    def __init__(self):
        self.signum: int | None = None
        self.armed = False

    def __call__(self, signum, frame):
        self.signum = signum
        if self.armed:
            self.armed = False
            raise InterruptLatch.Cancelled()

    def check(self) -> None:
        """Arm, and raise at once if a signal came while disarmed."""
        self.armed = True
        if self.signum is not None:
            self.armed = False
            raise InterruptLatch.Cancelled()

    def exit_exception(self) -> BaseException:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager


def interrupt_latch():
    """SIGINT and SIGTERM go to an `InterruptLatch` while inside (the previous handlers after)."""
    latch = InterruptLatch()
    try:
        previous = {s: signal.signal(s, latch) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (an embedding caller): leave the signals alone
        yield latch
        return
    try:
        yield latch
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
