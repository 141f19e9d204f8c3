"""GPU memory of one process and its descendants while it runs, sampled from `nvidia-smi`.

What the kernel workers of a fresh machine hold beside the parent (strata_cli/kernel_warm.py
counts each at an estimate: its pieces' weights and 1 GiB) is the figure this is for. The
watcher polls `nvidia-smi --query-compute-apps` on a thread and keeps each process's peak; a
machine without `nvidia-smi` gives None, so the CPU runs of a benchmark record nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def sample() -> dict[int, int] | None:
    """MiB of GPU memory by process id now; None where nvidia-smi is missing or fails."""
    if shutil.which(QUERY[0]) is None:
        return None
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    usage = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            usage[int(pid)] = int(mib)
    return usage


def parent_of(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The parent process id of `pid` (Linux's /proc), None once it has exited."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ")"


def descends_from(pid: int, root: int, proc: Path = Path("/proc")) -> bool:
    while pid and pid != root:
        pid = parent_of(pid, proc)
        if pid is None:
            return False
    return pid == root


class Watch:
    """Peaks of GPU memory of `root` and its descendants, sampled every `interval_s` until stop().
    Descent is checked when a process is first seen, so a worker counts even once it has exited."""

    def __init__(self, root: int, interval_s: float = 0.5, proc: Path = Path("/proc")):
        self.root, self.interval_s, self.proc = root, interval_s, proc
        self.peaks: dict[int, int] = {}
        self.peak_total = 0
        self.available = True
        self._ours: dict[int, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            usage = sample()
            if usage is None:
                self.available = False
                return
            self.take(usage)
            if self._stop.wait(self.interval_s):
                return

    def take(self, usage: dict[int, int]) -> None:
        total = 0
        for pid, mib in usage.items():
            if pid not in self._ours:
                self._ours[pid] = descends_from(pid, self.root, self.proc)
            if self._ours[pid]:
                self.peaks[pid] = max(self.peaks.get(pid, 0), mib)
                total += mib
        self.peak_total = max(self.peak_total, total)

    def stop(self) -> dict | None:
        """The figures: the root's peak, each descendant's peak (largest first) and the peak of their
        sum, in MiB; None where no sample could be taken."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        if not self.available:
            return None
        others = sorted((mib for pid, mib in self.peaks.items() if pid != self.root), reverse=True)
        return {"parent_peak_mib": self.peaks.get(self.root, 0), "worker_peaks_mib": others,
                "worker_peak_mib": others[0] if others else 0, "total_peak_mib": self.peak_total}
