"""The parallel kernel warm-up of a fresh GPU machine (strata_cli/kernel_warm.py and its worker),
checked on the CPU with the demo model: the plan covers every call the engine's own warm-up
makes, units are disjoint, workers run and report, their modules are published whole, a
failure or the timeout is a warning, and a warmed model is not warmed again."""

import json
import re
import subprocess
import sys
from dataclasses import asdict

import pytest

from strata_cli import kernel_warm
from strata_cli.kernel_warm import Unit, assign, layer_kinds, plan_units, warm_in_parallel
from strata_cli.kernel_warm_worker import load_for, run_units, state_kinds_of
from strata_cli.options import EngineOptions, LoadOptions
from strata_cli.runtime import embedded_model_path, open_model

from metal_shaders import kept


@pytest.fixture(scope="module")
def demo():
    return open_model(LoadOptions())


def record_calls(monkeypatch, model, calls: set):
    """Record (kind, rows) of every decoder layer call (kind: the index standing for the layer's
    kind) and ("head", rows) of every head call."""
    rep = {i: r for r, members in layer_kinds(model).items() for i in members}
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    for cls in {type(layer) for layer in model.layers}:
        call = cls.__call__

        def layer_call(self, x, state, call=call):
            calls.add((rep[index[id(self)]], x.shape[1]))
            return call(self, x, state)
        monkeypatch.setattr(cls, "__call__", layer_call)
    head = type(model).head

    def head_call(self, h, *, last_only=False):
        calls.add(("head", h.shape[1]))
        return head(self, h, last_only=last_only)
    monkeypatch.setattr(type(model), "head", head_call)


def test_the_plan_covers_every_call_of_the_engines_warm_up_and_units_are_disjoint(demo, monkeypatch):
    from strata_cli.engine.window import WindowEngine

    model, max_T, chunk = demo.model, 3, 16
    engine = WindowEngine(model, EngineOptions(max_context=64))
    units = plan_units(model, engine, max_T=max_T, chunk=chunk)
    assert len(set(units)) == len(units)
    groups = assign(units, 4)
    assert sorted(u for g in groups for u in g) == sorted(units) and all(groups)
    assert {u.piece for u in units} == {"layer", "head"} and {u.layer for u in units} == {-1, 0, 1}

    expected, actual = set(), set()
    record_calls(monkeypatch, model, expected)
    engine.warm_up(max_T, chunk=chunk)
    record_calls(monkeypatch, model, actual)
    kinds = state_kinds_of(model, layer_kinds(model))
    lines = []
    run_units(model, units, kinds, EngineOptions(max_context=64), report=lines.append)
    assert expected <= actual, expected - actual
    assert [json.loads(line)["unit"] for line in lines] == [u.name for u in units]
    assert engine.length == 0


def test_the_first_token_waits_only_for_windows_and_window_sized_prompt_chunks(demo):
    from strata_cli.engine.window import WINDOW_BUCKETS, WindowEngine

    engine = WindowEngine(demo.model, EngineOptions(max_context=64))
    units = plan_units(demo.model, engine, max_T=8, chunk=512)
    first, later = kernel_warm.split_groups(units, 6)
    assert len(first) + len(later) == 6 and all(first) and all(later)
    assert all(u.first for g in first for u in g) and not any(u.first for g in later for u in g)
    assert sorted(u for g in first + later for u in g) == sorted(units)
    assert {u.rows for g in first for u in g if u.prompt} == {max(WINDOW_BUCKETS)}
    assert kernel_warm.split_groups(units, 1) == ([units], [])  # one worker: everything awaited
    # while the background runs, a prompt runs in window-sized chunks
    chunks = []
    forward = engine._forward
    engine._forward = lambda ids, *a, **k: chunks.append(ids.shape[1]) or forward(ids, *a, **k)
    engine.cap_prompt_chunks(max(WINDOW_BUCKETS))
    engine.prefill(list(range(20)))
    assert chunks == [8, 8, 4] and engine.length == 20
    engine.reset()
    engine.cap_prompt_chunks(None)
    chunks.clear()
    engine.prefill(list(range(20)))
    assert chunks == [20]


def test_a_worker_on_the_cpu_runs_its_units_and_exits_0():
    units = [Unit("layer", 1, 16, True), Unit("layer", 0, 2, False), Unit("head", -1, 1, False)]
    proc = subprocess.run([sys.executable, "-m", "strata_cli.kernel_warm_worker", "--model", str(embedded_model_path()),
                           "--units", json.dumps([asdict(u) for u in units]), "--options", '{"max_context": 64}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["unit"] for line in proc.stdout.splitlines()] == [u.name for u in units]


def test_workers_warm_once_and_a_warmed_model_is_not_warmed_again(demo, tmp_path, monkeypatch):
    kept.configure(tmp_path / "strata")
    try:
        monkeypatch.setenv(kernel_warm.ENV, "2")
        lines = []
        report = warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2, announce=lines.append)
        # one worker for the first token's units, awaited; one for the prompt path's, in the background
        assert report.workers == 2 and report.background_workers == 1 and 0 < report.background_units < report.units
        assert report.wait(120) and report.background_seconds >= report.seconds > 0
        assert demo.engine.prompt_rows_cap is None  # capped while the background ran
        assert report.done == report.units > 0 and not report.failed
        # the estimate a worker is counted at goes with the count: what to compare on a GPU
        assert len(lines) == 1 and re.fullmatch(r"strata: compiling GPU kernels for this machine, once: 2 workers "
                                                rf"of up to 1\.\d GB each \(kept in {re.escape(str(tmp_path))}\)", lines[0])
        assert not any(p.name.startswith(".warm-") for p in tmp_path.iterdir())  # scratch removed
        assert warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2) is None
        # other shapes are another plan: warmed again
        monkeypatch.setenv(kernel_warm.ENV, "0")
        assert warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=3) is None
    finally:
        kept.configure(None)


def test_no_workers_off_cuda_or_when_turned_off(demo, tmp_path, monkeypatch):
    assert warm_in_parallel(demo.path, None, demo.model, demo.engine, None, max_T=2) is None
    monkeypatch.setenv(kernel_warm.ENV, "0")
    assert warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2) is None
    assert plan_units(object(), demo.engine, max_T=2) == []  # no embed / run_layers / head: whole models only
    assert kernel_warm.turned_off("0") and kernel_warm.turned_off("yes")
    assert not any(kernel_warm.turned_off(env) for env in ("", "auto", " auto ", "3"))


def test_workers_fit_the_cores_and_half_of_each_memory():
    cores = max(0, kernel_warm.available_cores() - 1)
    count = kernel_warm.worker_count
    assert count(30, env="auto") == count(30, env="") == min(cores, 30)  # no memory named: the cores
    assert count(30, env="", per_worker=10, free=(200, 60)) == min(cores, 3)  # half the host's 60: three of 10
    assert count(30, env="auto", per_worker=10, free=(50, 1000)) == min(cores, 2)
    assert count(30, env="", per_worker=10, free=(19, 1000)) == 0
    assert count(30, env="", per_worker=10, free=(None, 1000)) == 0  # a GPU that cannot say: not filled blind
    assert count(30, env="auto", per_worker=10, free=(None, 1000)) == min(cores, 30)  # asked for: the cores
    assert count(30, env="4", per_worker=10, free=(0, 0)) == 4 and count(3, env="8") == 3  # a number is a number
    assert count(30, env="0") == count(30, env="yes") == 0


def test_a_worker_is_counted_at_every_piece_it_may_load(demo):
    from mlx.utils import tree_flatten

    def nbytes(tree):
        return sum(v.nbytes for _, v in tree_flatten(tree))

    layer, head = Unit("layer", 0, 1, False), Unit("head", -1, 1, False)
    whole, layers = nbytes(demo.model.parameters()), [nbytes(x.parameters()) for x in demo.model.layers]
    overhead = kernel_warm.WORKER_OVERHEAD_BYTES
    assert kernel_warm.worker_bytes(demo.model, [layer]) == layers[0] + overhead
    assert kernel_warm.worker_bytes(demo.model, [layer, head]) == whole - sum(layers[1:]) + overhead
    assert kernel_warm.worker_bytes(demo.model, [head, Unit("head", -1, 8, True)]) == whole - sum(layers) + overhead


def test_where_memory_rules_workers_out_one_line_says_so(demo, tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_warm.ENV, raising=False)  # the default
    monkeypatch.setattr(kernel_warm.cuda_driver, "free_memory", lambda: 2 << 30)  # half of it: 1 GiB, less than a worker
    monkeypatch.setattr(kernel_warm, "available_cores", lambda: 16)
    lines = []
    assert warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2, announce=lines.append) is None
    assert len(lines) == 1 and lines[0].startswith("strata: compiling GPU kernels in this process: a kernel worker "
                                                   "needs up to 1.")
    assert "free memory is GPU 2.1 GB, host " in lines[0] and lines[0].endswith(
        "(STRATA_PARALLEL_WARM=N launches N workers anyway)")
    assert not any(p.name.startswith(".warm-") for p in tmp_path.iterdir())  # nothing launched
    quiet = []  # a machine whose kernel cache was filled before: nothing to say
    warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2, announce=quiet.append,
                     explain_refusal=False)
    assert quiet == []


def test_a_failed_or_late_worker_is_a_warning_and_keeps_nothing_of_its_own(demo, tmp_path, monkeypatch):
    kept.configure(tmp_path / "strata")
    try:
        monkeypatch.setenv(kernel_warm.ENV, "1")
        monkeypatch.setattr(kernel_warm, "WORKER_MODULE", "strata_cli.no_such_worker")
        lines = []
        report = warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=2, announce=lines.append)
        assert report.failed and "exit 1" in report.failed[0] and "warning: kernel worker 0 failed" in lines[-1]
        monkeypatch.setattr(kernel_warm, "WORKER_MODULE", "strata_cli.kernel_warm_worker")
        report = warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=3, announce=lines.append,
                                  timeout=0.01)
        assert report.timed_out and "no answer" in lines[-1]
        # a late worker leaves no marker: the next process tries again
        assert warm_in_parallel(demo.path, None, demo.model, demo.engine, tmp_path, max_T=3, timeout=0.01).timed_out
        not_a_dir = tmp_path / "file"
        not_a_dir.write_text("")
        report = warm_in_parallel(demo.path, None, demo.model, demo.engine, not_a_dir, max_T=3, announce=lines.append)
        assert report.failed and "could not start" in lines[-1]
    finally:
        kept.configure(None)


def test_modules_are_seeded_as_links_and_published_whole_ptx_last(tmp_path, monkeypatch):
    kept_dir, private = tmp_path / "kept", tmp_path / "kept" / ".warm-1" / "0"
    (kept_dir / "strata").mkdir(parents=True)
    (kept_dir / "old.ptx").write_text("old")
    (kept_dir / "strata" / "x.bin").write_text("strata's own")
    private.mkdir(parents=True)
    kernel_warm.seed(private, kept_dir, kept_dir / "strata")
    assert sorted(str(p.relative_to(private)) for p in private.rglob("*") if p.is_file()) == ["old.ptx"]
    (private / "long").mkdir()
    for name in ("new.ptx", "new.txt", "new.cu", "long/rest.ptx", "long/rest.txt"):
        (private / name).write_text(name)
    order = []
    replace = kernel_warm.os.replace
    monkeypatch.setattr(kernel_warm.os, "replace", lambda a, b: (order.append(b.name), replace(a, b)))
    assert kernel_warm.publish(private, kept_dir) == 2
    assert order[-2:] == ["rest.ptx", "new.ptx"] and set(order[:-2]) == {"new.txt", "new.cu", "rest.txt"}
    assert (kept_dir / "long" / "rest.ptx").read_text() == "long/rest.ptx" and (kept_dir / "old.ptx").read_text() == "old"
    assert not [p for p in kept_dir.rglob(".tmp-*")]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (kept_dir / f".warm-{gone.stdout.strip()}" / "0").mkdir(parents=True)  # a killed parent's scratch
    kernel_warm.remove_stale(kept_dir)
    assert sorted(p.name for p in kept_dir.glob(".warm-*")) == [".warm-1"]  # pid 1 lives: its scratch stays


def test_a_worker_loads_only_its_layers_and_the_head_only_with_a_head_unit(demo):
    from mlx.utils import tree_flatten

    model, kinds = load_for(demo.path, [Unit("layer", 1, 2, False)], None)
    assert kinds == {1: [("kv", {})]}
    loaded = {name.split(".")[2] if name.startswith("model.layers.") else name.split(".")[0]
              for name, _ in tree_flatten(model.parameters())}
    assert loaded == {"1"}
    model, kinds = load_for(demo.path, [Unit("head", -1, 2, False)], None)
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert kinds == {} and names and not any(n.startswith("model.layers.") for n in names)


def test_open_model_on_a_fresh_cuda_machine_runs_the_workers_once(tmp_path, monkeypatch):
    """What a fresh CUDA machine's first and second runs do, with the CPU standing in for it."""
    from strata_cli import runtime as runtime_module
    from strata_cli.engine import window
    from strata_cli.kernel_cache import KernelCache

    monkeypatch.setattr(runtime_module, "prepare_kernel_cache",
                        lambda: KernelCache(path=tmp_path / "ptx", chosen_by="strata", cold=True))
    monkeypatch.setattr(window, "on_gpu", lambda: True)  # engines pad and warm shapes on first use
    monkeypatch.setenv(kernel_warm.ENV, "2")
    (tmp_path / "ptx").mkdir()
    kept.configure(tmp_path / "ptx" / "strata")
    try:
        events = []
        first = open_model(LoadOptions(), EngineOptions(max_context=64), announce=events.append,
                           warm_progress=lambda done, total: events.append((done, total)))
        assert events[0] == ("strata: compiling GPU kernels for this machine, once (kept in "
                             f"{tmp_path / 'ptx'}); the first run takes a minute or more")
        assert events[1].startswith("strata: compiling GPU kernels for this machine, once: 2 workers of up to ")
        assert events[1].endswith(f" GB each (kept in {tmp_path / 'ptx'})") and events[2:] == [(0, 1), (1, 1)]
        report = first.kernel_workers
        assert report.units == 3 * 8  # 3 pieces; windows of 1, 2, 4, 8 rows, prompts of 8, 16, 32, 63
        assert report.wait(120) and report.done == report.units and not report.failed
        assert first.engine.prompt_rows_cap is None
        assert first.warmup_seconds >= report.seconds > 0
        second = open_model(LoadOptions(), EngineOptions(max_context=64))
        assert second.kernel_workers is None
    finally:
        kept.configure(None)
