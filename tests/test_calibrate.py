"""Warm-up of every window shape at load, and the device's own cost curve for `auto` (issue 16):
neither may change an output, the curve is cached per model, backend and dtype, and telemetry
says which prior is in use."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from strata_cli import calibrate
from strata_cli.cli import cli
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine, WindowError
from strata_cli.options import EngineOptions, GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model, should_warm_shapes

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]


def _decode(engine, spec=SpecOptions(max_drafts=4)):
    return [t for step in generate(engine, PROMPT, options=GenerateOptions(max_tokens=24), spec=spec, eos_ids=())
            for t in step.tokens]


def _tensors(engine):
    return [{k: v for k, v in layer.items()} for layer in engine.state_tensors()]


def _same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].shape == y[k].shape and mx.array_equal(x[k], y[k]).item(), k


@pytest.mark.parametrize("fold,partial", [("lazy", False), ("eager", False), ("lazy", True)])
def test_warm_up_leaves_nothing_behind(tiny_model, fold, partial):
    options = EngineOptions(fold=fold, partial=partial, max_context=256)
    fresh, warmed = WindowEngine(tiny_model, options), WindowEngine(tiny_model, options)
    warmed.warm_up(8, chunk=32)
    assert warmed.length == 0
    assert _decode(warmed) == _decode(fresh)  # greedy, with drafts: every window and commit alike
    _same_state(_tensors(warmed), _tensors(fresh))
    assert _decode(warmed, SpecOptions()) == _decode(fresh, SpecOptions())


def test_warm_up_fits_a_short_context_and_refuses_a_busy_engine(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(max_context=6))
    engine.warm_up(8, chunk=512)  # windows and chunk shrink to the context
    assert engine.length == 0
    engine.prefill([1, 2, 3])
    with pytest.raises(WindowError, match="empty engine"):
        engine.warm_up(8)


def test_warm_shapes_default_is_off_on_the_cpu():
    assert mx.default_device().type == mx.cpu
    assert not should_warm_shapes(EngineOptions())
    assert should_warm_shapes(EngineOptions(warm_shapes=True))
    assert not should_warm_shapes(EngineOptions(warm_shapes=False))


def test_open_model_warm_up_is_load_time_and_changes_no_output():
    load = LoadOptions()
    cold = open_model(load, EngineOptions(max_context=96))
    warm = open_model(load, EngineOptions(max_context=96, warm_shapes=True))
    assert cold.warmup_seconds == 0.0 and warm.warmup_seconds > 0.0
    assert _decode(warm.engine) == _decode(cold.engine)


def test_measure_curve_restores_the_engine(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(max_context=256))
    engine.prefill(PROMPT[:10])
    before = _tensors(engine)
    curve = calibrate.measure_curve(engine, 4, windows=3, context=16)
    assert len(curve) == 4 and all(s > 0 for s in curve)
    assert engine.length == 10
    _same_state(_tensors(engine), before)
    with pytest.raises(ValueError, match="too short"):
        calibrate.measure_curve(WindowEngine(tiny_model, EngineOptions(max_context=8)), 8)


def test_device_cost_prior_is_cached_per_model_backend_and_dtype(tiny_model, tmp_path, monkeypatch):
    engine = WindowEngine(tiny_model, EngineOptions(max_context=256))
    calls = []
    real = calibrate.measure_curve
    monkeypatch.setattr(calibrate, "measure_curve", lambda *a, **k: calls.append(1) or real(*a, **k))
    first, spent = calibrate.device_cost_prior(engine, identity="a" * 64, dtype="float32", max_T=4,
                                               directory=tmp_path)
    assert first.source == "calibrated" and spent > 0 and len(calls) == 1
    path = calibrate.curve_path("a" * 64, calibrate.backend_name(), "float32", tmp_path)
    record = json.loads(path.read_text())
    assert record["identity"] == "a" * 64 and record["dtype"] == "float32" and len(record["seconds"]) == 4
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    again, spent = calibrate.device_cost_prior(engine, identity="a" * 64, dtype="float32", max_T=4,
                                               directory=tmp_path)
    assert again.source == "cached" and spent == 0.0 and len(calls) == 1
    assert again.relative == pytest.approx(first.relative) and again.seconds_per_row == first.seconds_per_row
    for identity, dtype, max_T in [("b" * 64, "float32", 4), ("a" * 64, "bfloat16", 4), ("a" * 64, "float32", 6)]:
        other, _ = calibrate.device_cost_prior(engine, identity=identity, dtype=dtype, max_T=max_T,
                                               directory=tmp_path)
        assert other.source == "calibrated"  # another model or dtype, or a longer curve: measured
    assert len(calls) == 4
    path.write_text("{not json")
    fixed, _ = calibrate.device_cost_prior(engine, identity="a" * 64, dtype="float32", max_T=4,
                                           directory=tmp_path)
    assert fixed.source == "calibrated" and json.loads(path.read_text())["seconds"]
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "mlx": "0.0.1"}))  # measured under another MLX
    assert calibrate.device_cost_prior(engine, identity="a" * 64, dtype="float32", max_T=4,
                                       directory=tmp_path)[0].source == "calibrated"


def test_a_context_too_short_to_calibrate_keeps_the_builtin_prior(tiny_model, tmp_path):
    engine = WindowEngine(tiny_model, EngineOptions(max_context=24))
    prior, spent = calibrate.device_cost_prior(engine, identity="c" * 64, dtype="float32", max_T=8,
                                               directory=tmp_path)
    assert prior.source == "builtin" and spent == 0.0 and not (tmp_path / "cost-curves").exists()


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrate.cache_dir() == tmp_path / "xdg" / "strata"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibrate.cache_dir() == tmp_path / "home" / ".cache" / "strata"


def test_generate_auto_reports_its_prior_and_load_time(tmp_path):
    args = ["generate", "def f(x): return x", "-n", "6", "--suffix-draft", "auto:3", "--json", "--max-context", "128"]
    runs = [json.loads(CliRunner().invoke(cli, args).stdout)["stats"] for _ in range(2)]
    assert [r["controller"]["cost_prior"] for r in runs] == ["calibrated", "cached"]
    assert runs[0]["calibration_seconds"] > 0 and runs[1]["calibration_seconds"] == 0.0
    assert runs[0]["warmup_seconds"] == 0.0  # off on the CPU by default
    outputs = [CliRunner().invoke(cli, args + extra).stdout for extra in ([], ["--warm-shapes"])]
    warmed = json.loads(outputs[1])
    assert warmed["stats"]["warmup_seconds"] > 0
    assert json.loads(outputs[0])["token_ids"] == warmed["token_ids"]
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps([0.01, 0.011, 0.012, 0.013]))
    fixed = CliRunner().invoke(cli, args + ["--draft-cost", str(curve)])
    assert json.loads(fixed.stdout)["stats"]["controller"]["cost_prior"] == f"file:{curve}"
    serial = CliRunner().invoke(cli, ["generate", "x", "-n", "2", "--json"])
    assert "controller" not in json.loads(serial.stdout)["stats"]


class SlowReads:
    """An expert cache that says every window spent `seconds` reading its drafts' cold experts."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.last_window = None

    def begin_window(self, *, kind):
        pass

    def end_window(self):
        from strata_cli.telemetry import ExpertWindowStats

        self.last_window = ExpertWindowStats(draft_read_seconds=self.seconds)
        return self.last_window


def test_measure_curve_leaves_draft_reads_out_as_decoding_does():
    from mock_models import CycleModel

    engine = WindowEngine(CycleModel())
    engine.expert_cache = SlowReads(0.0)
    plain = calibrate.measure_curve(engine, 3, windows=3, context=8)
    assert all(s > 1e-6 for s in plain)
    engine.expert_cache = SlowReads(100.0)  # far more than any window took: all of it was reads
    assert calibrate.measure_curve(engine, 3, windows=3, context=8) == [1e-9] * 3
