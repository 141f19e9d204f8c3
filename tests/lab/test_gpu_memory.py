"""scripts/bench/gpu_memory.py: a process's and its descendants' GPU memory peaks from nvidia-smi,
others' left out, nothing where nvidia-smi is missing."""

import os
import subprocess
import sys
import time

from scripts.bench import gpu_memory


def fake_proc(tmp_path, parents: dict[int, int]):
    """A /proc of `pid: parent` entries, the command names awkward as real ones can be."""
    for pid, parent in parents.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python (3) x) S {parent} 1 1 0\n")
    return tmp_path


def test_peaks_of_a_process_tree_leave_other_processes_out(tmp_path):
    proc = fake_proc(tmp_path, {1: 0, 10: 1, 11: 10, 12: 11, 20: 1})  # 10 the root, 11 and 12 below it
    watch = gpu_memory.Watch(10, proc=proc)
    watch.take({10: 3000, 11: 900, 20: 5000})
    watch.take({10: 3500, 11: 1200, 12: 800, 20: 7000})
    watch.take({10: 3400, 12: 1000})  # 11 exited: its peak stays
    assert watch.stop() == {"parent_peak_mib": 3500, "worker_peaks_mib": [1200, 1000], "worker_peak_mib": 1200,
                            "total_peak_mib": 5500}
    assert gpu_memory.parent_of(12, proc) == 11 and gpu_memory.parent_of(99, proc) is None
    assert not gpu_memory.descends_from(20, 10, proc) and gpu_memory.descends_from(12, 10, proc)


def test_the_watch_reads_nvidia_smi_and_finds_a_child(tmp_path, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fake = tmp_path / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\nprintf '{os.getpid()}, 700\\n{child.pid}, 250\\n1, 9000\\nNo running, processes\\n'\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        assert gpu_memory.sample() == {os.getpid(): 700, child.pid: 250, 1: 9000}
        watch = gpu_memory.Watch(os.getpid(), interval_s=0.05).start()
        time.sleep(0.3)
        assert watch.stop() == {"parent_peak_mib": 700, "worker_peaks_mib": [250], "worker_peak_mib": 250,
                                "total_peak_mib": 950}
    finally:
        child.kill()
        child.wait()


def test_without_nvidia_smi_there_is_nothing_to_record(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory.sample() is None
    assert gpu_memory.Watch(os.getpid(), interval_s=0.01).start().stop() is None
