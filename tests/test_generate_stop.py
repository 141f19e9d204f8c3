"""`strata generate --stop`, the same stop strings serve-stdio requests take; errors in plain lines."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from strata_cli.cli import cli


def generate(*args, env=None):
    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "40", "--json", *args], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_stop_ends_the_text_before_the_first_stop_string():
    free = generate()
    assert free["finish_reason"] == "length"
    stop = free["text"][6:9]  # a piece of what the model writes anyway
    cut = generate("--stop", stop)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free["text"][: free["text"].index(stop)]
    assert generate("--stop", stop, "--suffix-draft", "3")["text"] == cut["text"]


def test_several_stop_strings_and_one_per_line_from_the_environment():
    free = generate()["text"]
    words = [w for w in free.split() if w.isalpha()]  # no newline in them: the variable splits on lines
    first, later = words[3], words[1]
    both = generate("--stop", first, "--stop", later)
    assert both["text"] == free[: min(free.index(first), free.index(later))]
    assert generate(env={"STRATA_STOP": f"{first}\n{later}"})["text"] == both["text"]


def test_an_empty_stop_string_is_a_usage_error_in_plain_lines():
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "generate", "x", "--stop", ""],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "Usage: strata generate [OPTIONS] [PROMPT]",
        "Try 'strata generate --help' for help.",
        "",
        "Error: Invalid value for '--stop': a stop string must not be empty",
    ]


def test_each_line_answers_take_the_separator_given():
    result = CliRunner().invoke(cli, ["generate", "--each-line", "-n", "4", "--separator", "=== next ==="],
                                input="def a():\nclass B:\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n=== next ===\n") == 1 and "---" not in result.stdout
    alone = CliRunner().invoke(cli, ["generate", "x", "-n", "2", "--separator", "@@"])
    assert alone.exit_code == 2 and "--separator applies only with --each-line" in alone.output


def test_a_filter_without_a_temperature_names_only_the_flags_given():
    result = CliRunner().invoke(cli, ["generate", "x", "--top-p", "0.9"])
    assert result.exit_code == 2
    assert "--top-p 0.9 only applies when sampling: set --temperature above 0 too" in result.output
    assert "top_k" not in result.output and "min_p" not in result.output
