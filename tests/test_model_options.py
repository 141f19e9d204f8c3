"""Every command that opens a model takes the same model options (`@model_options`), and the
runtime honours them: serve-stdio and bench cap a streamed checkpoint's experts, and convert
takes `demo` as its source."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.options import ConvertOptions, LoadOptions, StreamOptions
from strata_cli.runtime import embedded_model_path, open_model

MODEL_OPTIONS = ("--model", "--dtype", "--expert-cache", "--resident-experts", "--expert-prefetch",
                 "--spec-root-prefetch", "--expert-io", "--expert-io-threads", "--moce-protect", "--moce-bonus",
                 "--draft-moce-protect", "--draft-moce-bonus", "--expert-budget", "--moce-exact-prefill",
                 "--moce-natural-prefetch", "--moce-count-inflight")
MOCE = ("--resident-experts", "4", "--moce-protect", "1", "--moce-bonus", "2", "--draft-moce-protect", "1",
        "--expert-budget", "2")
NUM_LAYERS = 6  # the demo model's, every one of them a MoE block


@pytest.fixture(scope="module")
def streamed_demo(tmp_path_factory):
    """The embedded demo model with its experts in the streaming layout (tokenizer included)."""
    return convert(embedded_model_path(), tmp_path_factory.mktemp("demo") / "stream",
                   options=ConvertOptions(stream=True)).path


@pytest.mark.parametrize("command", ["generate", "serve-stdio", "bench"])
def test_every_model_command_takes_the_model_options(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0
    for option in MODEL_OPTIONS:
        assert option in result.output, (command, option)


def serve(model, *args):
    request = {"id": 1, "prompt": "def add(a, b):", "max_tokens": 6, "stream": False}
    env = {**os.environ, "STRATA_RAISE_ERRORS": "0"}
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "serve-stdio", "--model", str(model), *args],
                          input=json.dumps(request) + "\n", capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    ready, reply = [json.loads(line) for line in proc.stdout.splitlines()]
    assert ready["ready"] is True
    return reply


def test_serve_stdio_honours_the_expert_budget(streamed_demo):
    full = serve(streamed_demo)
    capped = serve(streamed_demo, "--resident-experts", "1", "--expert-prefetch", "off")
    assert capped["token_ids"] == full["token_ids"]  # a budget never changes the output
    windows = capped["stats"]["windows"]
    assert full["stats"]["experts"]["capacity_misses"] == 0
    # One slot per block: every union of two or more experts is computed in several passes.
    assert capped["stats"]["experts"]["passes"] > windows * NUM_LAYERS
    assert capped["stats"]["experts"]["capacity_misses"] > 0


def test_serve_stdio_refuses_a_budget_for_a_model_that_does_not_stream():
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "serve-stdio", "--expert-cache", "1"],
                          input="", capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1 and "apply to a streamed checkpoint" in proc.stderr


def test_bench_honours_the_expert_budget(streamed_demo, tmp_path):
    runs = {}
    for budget in ([], ["--resident-experts", "1", "--expert-prefetch", "off"]):
        out = tmp_path / f"bench{len(budget)}.json"
        result = CliRunner().invoke(cli, ["bench", "prose", "--model", str(streamed_demo), "--modes", "serial",
                                          "--no-peers", "-n", "4", "-r", "1", "--warmup", "0", "--out", str(out),
                                          *budget])
        assert result.exit_code == 0, result.output
        runs[bool(budget)] = json.loads(out.read_text())["workloads"][0]["modes"][0]["runs"][0]
    assert runs[True]["output_digest"] == runs[False]["output_digest"]
    assert runs[False]["stats"]["experts"]["capacity_misses"] == 0
    assert runs[True]["stats"]["experts"]["capacity_misses"] > 0


def test_open_model_streams_with_the_budget(streamed_demo):
    runtime = open_model(LoadOptions(model=str(streamed_demo), stream=StreamOptions(resident_experts=3)))
    assert runtime.model.expert_cache.num_slots == 3
    assert runtime.path == streamed_demo and len(runtime.identity) == 64


def test_convert_takes_demo_as_its_source(tmp_path):
    result = CliRunner().invoke(cli, ["convert", "demo", str(tmp_path / "copy")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "copy" / "config.json").is_file() and (tmp_path / "copy" / "tokenizer.json").is_file()
    generated = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "4", "--model", str(tmp_path / "copy")])
    reference = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "4"])
    assert generated.exit_code == 0 and generated.output == reference.output


def test_generate_labels_cache_aware_routing_approximate(streamed_demo):
    args = ["generate", "def add(a, b):", "-n", "6", "--json", "--model", str(streamed_demo)]
    exact = CliRunner().invoke(cli, args)
    approx = CliRunner().invoke(cli, [*args, *MOCE])
    assert exact.exit_code == 0 and approx.exit_code == 0, approx.output
    assert "approximate" not in json.loads(exact.stdout)["stats"]
    stats = json.loads(approx.stdout)["stats"]
    assert stats["approximate"] is True and "moce" in stats["experts"]
    shown = CliRunner().invoke(cli, ["generate", "def add(a, b):", "-n", "6", "--stats", "--model",
                                     str(streamed_demo), *MOCE])
    assert shown.exit_code == 0 and "approximate: cache-aware routing" in shown.output


def test_cache_aware_routing_is_refused_for_a_model_that_does_not_stream():
    result = CliRunner().invoke(cli, ["generate", "hi", "-n", "2", "--moce-protect", "1"])
    assert result.exit_code == 1 and "applies to a streamed checkpoint" in result.output
    result = CliRunner().invoke(cli, ["generate", "hi", "-n", "2", "--moce-bonus", "1"])
    assert result.exit_code == 2 and "--moce-bonus needs --moce-protect" in result.output


def test_serve_stdio_and_bench_take_cache_aware_routing(streamed_demo, tmp_path):
    reply = serve(streamed_demo, *MOCE)
    assert reply["stats"]["approximate"] is True
    assert "approximate" not in serve(streamed_demo)["stats"]
    out = tmp_path / "moce.json"
    result = CliRunner().invoke(cli, ["bench", "prose", "--model", str(streamed_demo), "--modes", "serial",
                                      "--no-peers", "-n", "4", "-r", "1", "--warmup", "0", "--out", str(out), *MOCE])
    assert result.exit_code == 0, result.output
    mode = json.loads(out.read_text())["workloads"][0]["modes"][0]
    assert mode["approximate"] is True and mode["runs"][0]["stats"]["approximate"] is True
