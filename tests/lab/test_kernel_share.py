"""scripts/lab/kernel_share.py: a kernel made to launch twice gives the same outputs and keeps
both launches in the graph; the tiny CPU run (where no strata kernel runs) times the plain
windows and writes its report."""

import json

import mlx.core as mx

from scripts.lab import kernel_share


def test_twice_launches_twice_and_keeps_the_first_launch_in_the_graph():
    calls = []

    def kernel(*, inputs, **_):
        calls.append(1)
        return [inputs[0] * 2, inputs[0] + 1]

    doubled = kernel_share.Twice(kernel)
    out = doubled(inputs=[mx.array([1.0, 2.0])])
    assert len(calls) == 2 and len(out) == 2
    assert out[0].tolist() == [2.0, 4.0] and out[1].tolist() == [2.0, 3.0]


def test_tiny_run_times_the_plain_windows(tmp_path):
    out = tmp_path / "share.json"
    report = kernel_share.main(["--tiny", "--dir", str(tmp_path), "--rounds", "1", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text())["windows"] == [1, 8]
    assert report["kernels"] == {} and report["sum_ms"] == {"1": 0, "8": 0}
    assert all(report["window_ms"][T] > 0 for T in ("1", "8"))


def test_drop_traces_makes_every_compiled_part_trace_again():
    import mlx.nn as nn

    from strata_cli.model.compiled import Compiled

    outer = nn.Module()
    outer.inner = nn.Linear(2, 2)
    for module in (outer, outer.inner):
        compiled = module.__dict__["_compiled"] = Compiled(module, lambda x: x + 1)
        compiled.functions()  # the first call of a setting runs eagerly
        assert compiled.functions()[0](mx.array([1.0])).item() == 2.0 and compiled.compiled is not None
    assert kernel_share.drop_traces(outer) == 2
    assert all(m.__dict__["_compiled"].compiled is None and m.__dict__["_compiled"].held is None
               for m in (outer, outer.inner))
