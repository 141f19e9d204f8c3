"""Sampling without --seed draws a fresh seed per prompt and reports it; --seed N reproduces it."""

import json

from click.testing import CliRunner

import strata_cli.request as request_module
from strata_cli.cli import cli


def run(*args):
    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-t", "0.8", "-n", "12", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_each_unseeded_prompt_gets_its_own_seed_and_reports_it(monkeypatch):
    seeds = iter([1234, 98765])
    monkeypatch.setattr(request_module.secrets, "randbits", lambda bits: next(seeds))
    first, second = run(), run()
    assert first["stats"]["seed"] == 1234 and second["stats"]["seed"] == 98765
    assert first["text"] != second["text"]  # no longer the same text every run


def test_the_reported_seed_gives_the_same_text_again_with_any_drafts(monkeypatch):
    monkeypatch.setattr(request_module.secrets, "randbits", lambda bits: 424242)
    drawn = run()
    for drafts in ("0", "3", "auto"):
        again = run("--seed", str(drawn["stats"]["seed"]), "--suffix-draft", drafts)
        assert again["token_ids"] == drawn["token_ids"] and again["stats"]["seed"] == 424242


def test_greedy_reports_no_seed_and_stats_show_it():
    result = CliRunner().invoke(cli, ["generate", "x", "-n", "2", "--json"])
    assert json.loads(result.stdout)["stats"]["seed"] is None
    shown = CliRunner().invoke(cli, ["generate", "x", "-n", "2", "-t", "0.5", "--seed", "77", "--stats"])
    assert "sampling seed" in shown.stderr and " 77 " in shown.stderr
