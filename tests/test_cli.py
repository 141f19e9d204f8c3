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


def test_prompt_tokens_counts_the_whole_prompt(runner):
    """stats.prompt_tokens is the prompt's length; prefill_tokens leaves out the root (run by the first window)."""
    from strata_cli.runtime import open_model

    prompt = "def add(a, b):"
    n = len(open_model().tokenizer.encode(prompt))
    result = runner.invoke(cli, ["generate", prompt, "--json", "--max-tokens", "3"])
    stats = json.loads(result.stdout)["stats"]
    healed = stats["healed_tokens"]  # prompt-edge healing may back up over "):" (a new tokenizer's choice)
    assert n == 7 and stats["prompt_tokens"] == n - healed and stats["prefill_tokens"] == n - healed - 1


@pytest.mark.parametrize("args, env, expected", [
    (["--temperature", "inf"], {}, "'--temperature' / '-t': inf is not a finite number"),
    (["--temperature", "nan"], {}, "nan is not a finite number"),
    ([], {"STRATA_TEMPERATURE": "inf"}, "(from STRATA_TEMPERATURE='inf')"),
    ([], {"STRATA_SUFFIX_DRAFT": "9"}, "'--suffix-draft' (from STRATA_SUFFIX_DRAFT='9')"),
    ([], {"STRATA_EXPERT_CACHE": "inf"}, "(from STRATA_EXPERT_CACHE='inf')"),
])
def test_bad_values_are_refused_naming_their_source(runner, args, env, expected):
    result = runner.invoke(cli, ["generate", "x", "--max-tokens", "2", *args], env=env)
    assert result.exit_code == 2 and expected in result.output, result.output


def test_max_context_above_the_model_limit_is_refused(runner):
    result = runner.invoke(cli, ["generate", "x", "--max-context", "100000"])
    assert result.exit_code == 1
    assert "max_context 100000 is above this model's limit of 4096 positions" in result.output
    assert runner.invoke(cli, ["generate", "x", "--max-context", "4096", "-n", "2"]).exit_code == 0


def test_dash_at_a_terminal_says_it_reads_until_ctrl_d(monkeypatch, capsys):
    import io

    from strata_cli import cli as cli_module

    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(io.BytesIO(b"def f(x):\n"), encoding="utf-8"))
    assert cli_module.read_prompts("-", each_line=False) == ["def f(x):\n"]
    assert "reading the prompt from stdin until Ctrl-D" in capsys.readouterr().err
    with pytest.raises(cli_module.UserError, match="no prompt"):
        cli_module.read_prompts(None, each_line=False)


def test_each_line_plain_answers_are_separated_and_json_rows_say_which_prompt(runner):
    stdin = "def f(x):\nimport sys\n"
    plain = runner.invoke(cli, ["generate", "--each-line", "--max-tokens", "4"], input=stdin)
    assert plain.exit_code == 0 and plain.stdout.count("\n---\n") == 1, plain.output
    rows = [json.loads(line) for line in runner.invoke(
        cli, ["generate", "--each-line", "--json", "--max-tokens", "4"], input=stdin).stdout.splitlines()]
    assert [(r["index"], r["prompt"]) for r in rows] == [(0, "def f(x):"), (1, "import sys")]


@pytest.mark.parametrize("signum, status, message", [(2, 130, "interrupted"), (15, 143, "terminated")])
def test_a_signal_still_writes_the_json_record(signum, status, message):
    """SIGINT/SIGTERM mid-generation: the cancelled prompt's record is written, then exit 130/143.

    The first prompt nearly fills the context, so its record comes out after a few tokens and
    marks the start of the second, which has room for hundreds; the signal follows that record."""
    from strata_cli.runtime import open_model

    first = "x = 1; " * 60
    limit = len(open_model().tokenizer.encode(first)) + 3
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata_cli.cli", "generate", "--each-line", "--json", "--max-tokens", "100000",
         "--max-context", str(limit)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdin.write(first + "\nimport os\n")
    proc.stdin.close()
    head = json.loads(proc.stdout.readline())
    assert head["index"] == 0 and head["finish_reason"] == "context"
    proc.send_signal(signum)
    rest, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == status and err.strip().splitlines()[-1] == message, err
    record = json.loads(rest)
    assert record["index"] == 1 and record["prompt"] == "import os" and record["finish_reason"] == "cancelled"
    assert len(record["token_ids"]) < limit - 3 and record["stats"]["generated_tokens"] == len(record["token_ids"])


def test_serve_and_generate_count_prompt_tokens_alike():
    request = json.dumps({"id": 1, "prompt": "def add(a, b):", "max_tokens": 3})
    result = run_strata("serve-stdio", stdin=request + "\n" + request + "\n")
    done = [f for f in map(json.loads, result.stdout.splitlines()) if f.get("done")]
    cold, warm = done
    n = 7 - cold["stats"]["healed_tokens"]  # the prompt less what healing backed up over
    assert cold["stats"]["prompt_tokens"] == cold["usage"]["prompt_tokens"] == n
    assert cold["stats"]["prefill_tokens"] == n - 1
    assert warm["stats"]["prompt_tokens"] == n and warm["stats"]["prefill_tokens"] == n - 1 - warm["usage"]["cached_tokens"]


def test_a_signal_between_prompts_is_latched_for_the_next_one():
    import signal

    from strata_cli.terminal import InterruptLatch, Terminated

    latch = InterruptLatch()
    latch(signal.SIGTERM, None)  # disarmed (between prompts): recorded, not raised
    with pytest.raises(InterruptLatch.Cancelled):
        latch.check()  # the next prompt stops at once, and its record says cancelled
    assert isinstance(latch.exit_exception(), Terminated)
    armed = InterruptLatch()
    armed.check()
    with pytest.raises(InterruptLatch.Cancelled):
        armed(signal.SIGINT, None)  # armed (decoding): raised where the decode loop runs
    assert isinstance(armed.exit_exception(), KeyboardInterrupt) and not armed.armed


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
