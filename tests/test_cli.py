"""`strata generate` end to end, through click's CliRunner and through a real subprocess."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from strata_cli.cli import cli


@pytest.fixture
def runner():
    return CliRunner()


def test_prompt_as_argument(runner):
    result = runner.invoke(cli, ["generate", "def add(a, b):", "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_prompt_on_stdin_and_dash(runner):
    piped = runner.invoke(cli, ["generate", "--max-tokens", "8"], input="import os\n")
    dash = runner.invoke(cli, ["generate", "-", "--max-tokens", "8"], input="import os\n")
    arg = runner.invoke(cli, ["generate", "import os\n", "--max-tokens", "8"])
    assert piped.exit_code == dash.exit_code == arg.exit_code == 0
    assert piped.stdout == dash.stdout == arg.stdout


def test_json_output(runner):
    result = runner.invoke(cli, ["generate", "class Foo:", "--max-tokens", "12", "--json", "--suffix-draft", "3"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert set(record) >= {"text", "token_ids", "finish_reason", "stats"}
    assert len(record["token_ids"]) <= 12 and record["finish_reason"] in ("stop", "length")
    assert set(record["stats"]) >= {"tokens_per_s", "windows", "drafts_offered", "drafts_kept"}


def test_each_line(runner):
    stdin = "def f(x):\n\n   \nimport sys\nclass A:\n"
    result = runner.invoke(cli, ["generate", "--each-line", "--json", "--max-tokens", "5"], input=stdin)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 3  # blank lines are skipped
    single = runner.invoke(cli, ["generate", "import sys", "--json", "--max-tokens", "5"])
    assert records[1]["token_ids"] == json.loads(single.stdout)["token_ids"]


def test_greedy_speculative_cli_output_is_identical(runner):
    prompt = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n"
    outs = [
        runner.invoke(cli, ["generate", prompt, "--max-tokens", "40", "--suffix-draft", d]).stdout
        for d in ("0", "3")
    ]
    assert outs[0] == outs[1]


def test_environment_variables(runner):
    via_env = runner.invoke(cli, ["generate", "x = 1", "--json"], env={"STRATA_MAX_TOKENS": "3"})
    assert len(json.loads(via_env.stdout)["token_ids"]) <= 3
    bad = runner.invoke(cli, ["generate", "x"], env={"STRATA_SUFFIX_DRAFT": "99"})
    assert bad.exit_code == 2 and "99" in bad.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--suffix-draft", "9"], "--suffix-draft"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--min-match", "2"], "--min-match"),
        (["--temperature", "-1"], "--temperature"),
    ],
)
def test_out_of_range_options(runner, args, message):
    result = runner.invoke(cli, ["generate", "x", *args])
    assert result.exit_code == 2 and message in result.output


def test_each_line_refuses_an_argument(runner):
    result = runner.invoke(cli, ["generate", "hello", "--each-line"], input="a\n")
    assert result.exit_code == 1 and "--each-line reads prompts from stdin" in result.output


def test_empty_prompt(runner):
    result = runner.invoke(cli, ["generate"], input="")
    assert result.exit_code == 1 and "empty" in result.output


def run_strata(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "strata_cli.cli", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_bad_model_path_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = run_strata("generate", "hello", "--model", str(missing))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"Error: model path '{missing}' does not exist"]


@pytest.mark.parametrize("broken", ["no_config", "bad_json", "truncated_weights", "unknown_type"])
def test_broken_checkpoints_are_named(tmp_path, broken):
    import shutil

    from strata_cli.runtime import embedded_model_path

    model = tmp_path / "model"
    shutil.copytree(embedded_model_path(), model)
    if broken == "no_config":
        (model / "config.json").unlink()
    elif broken == "bad_json":
        (model / "config.json").write_text("{not json")
    elif broken == "truncated_weights":
        shard = sorted(model.glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        config = json.loads((model / "config.json").read_text())
        config["model_type"] = "llama_xl"
        (model / "config.json").write_text(json.dumps(config))
    proc = run_strata("generate", "hi", "--model", str(model))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in proc.stderr
    assert str(model) in lines[0]


def test_stdin_streaming_subprocess():
    proc = run_strata("generate", "--max-tokens", "6", "--stats", stdin="import json\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tokens_per_s" in proc.stderr  # telemetry goes to stderr, not stdout


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("terminal, first_chunk_s, shown", [
    (True, 0.5, True),  # 512 of 3000 rows in 0.5 s: about 3 s in all
    (True, 0.05, False),  # about 0.3 s in all: no bar
    (False, 0.5, False),  # stderr is not a terminal: quiet
])
def test_prefill_bar(terminal, first_chunk_s, shown):
    import io

    from rich.console import Console

    from strata_cli.cli import PrefillBar

    stream = io.StringIO()
    clock = FakeClock()
    bar = PrefillBar(Console(file=stream, force_terminal=terminal, width=80), clock=clock)
    clock.now = first_chunk_s
    bar(512, 3000)
    assert (bar.bar is not None) is shown
    clock.now = 6 * first_chunk_s
    bar(3000, 3000)
    assert bar.bar is None  # removed once the prompt is in
    assert ("prompt" in stream.getvalue()) is shown
