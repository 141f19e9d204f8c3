"""Sampling knobs at their extremes never give an empty answer reported as a normal stop.

Logits are float32, so a temperature below float32's smallest normal (its reciprocal overflows,
and below about 7e-46 it rounds to 0) is greedy; a top_p or min_p past float32's resolution keeps
the most likely token(s); a temperature or penalty past float32's range takes its limit. Checked
on the filters and the processors, then through `strata generate` and serve-stdio in every draft
mode against greedy output."""

import json
import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from strata_cli import options as options_module
from strata_cli.cli import cli
from strata_cli.options import GenerateOptions
from strata_cli.processors import Processors
from strata_cli.sampling import TokenChooser, filtered_logits

FLOAT32_MAX = float(np.finfo(np.float32).max)
UNDERFLOWING = [5e-324, 1e-50, 1e-46, 1e-45, 1e-40, 2.0**-127]  # each below float32's smallest normal
# Row 0 has one most likely token (2); row 1 a tie between 1 and 3; row 2 a banned (-inf) token.
LOGITS = np.array([[0.5, -1.0, 3.0, 2.999, 0.0, -7.0],
                   [0.1, 4.0, -2.0, 4.0, 3.5, 0.0],
                   [-np.inf, 1.0, 0.0, -3.0, 0.9, 0.5]], dtype=np.float32)


def top_only(logits):
    """The t -> 0 limit: the most likely token(s) of each row, evenly."""
    top = logits == logits.max(axis=-1, keepdims=True)
    return top / top.sum(axis=-1, keepdims=True)


def probabilities(**knobs):
    got = np.array(mx.exp(filtered_logits(mx.array(LOGITS), **knobs)))
    assert not np.isnan(got).any(), knobs
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5, err_msg=str(knobs))
    return got


def test_the_greedy_threshold_is_float32s_smallest_normal():
    assert getattr(options_module, "MIN_SAMPLING_TEMPERATURE", None) == float(np.finfo(np.float32).tiny) == 2.0**-126


@pytest.mark.parametrize("temperature", UNDERFLOWING)
def test_an_underflowing_temperature_is_greedy(temperature):
    options = GenerateOptions(temperature=temperature, top_p=0.5, top_k=3, min_p=0.1)  # filters stay allowed
    assert not options.is_sampling
    assert not TokenChooser(options, prompt_length=1).is_sampling
    assert TokenChooser(GenerateOptions(temperature=2.0**-126), prompt_length=1).is_sampling


@pytest.mark.parametrize("temperature", [*UNDERFLOWING, 2.0**-126, 1e-30, 1e-6])
def test_a_tiny_temperature_keeps_the_most_likely_tokens(temperature):
    np.testing.assert_allclose(probabilities(temperature=temperature), top_only(LOGITS), atol=1e-6)


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-45, 1e-40, 1e-8])
def test_a_top_p_below_float32s_resolution_keeps_the_most_likely_tokens(top_p):
    np.testing.assert_allclose(probabilities(temperature=1.0, top_p=top_p), top_only(LOGITS), atol=1e-6)


@pytest.mark.parametrize("min_p", [0.99999999, 1 - 2**-53])
def test_a_min_p_next_to_one_keeps_the_most_likely_tokens(min_p):
    np.testing.assert_allclose(probabilities(temperature=1.0, min_p=min_p), top_only(LOGITS), atol=1e-6)


@pytest.mark.parametrize("knobs", [{"min_p": 5e-324}, {"top_k": LOGITS.shape[1]}, {"top_k": 2**62},
                                   {"top_p": 1 - 2**-53}])
def test_filters_at_their_open_ends_keep_everything(knobs):
    np.testing.assert_allclose(probabilities(temperature=1.0, **knobs), probabilities(temperature=1.0), atol=1e-6)


def test_top_k_one_keeps_the_most_likely_tokens():
    np.testing.assert_allclose(probabilities(temperature=1.0, top_k=1), top_only(LOGITS), atol=1e-6)


@pytest.mark.parametrize("temperature", [1e30, FLOAT32_MAX, 1e39, 1e308])
def test_a_huge_temperature_is_uniform_over_the_allowed_tokens(temperature):
    allowed = np.isfinite(LOGITS)
    np.testing.assert_allclose(probabilities(temperature=temperature), allowed / allowed.sum(-1, keepdims=True),
                               atol=1e-6)


def test_infinite_logits_take_all_the_mass():
    """What a repetition penalty that underflows leaves: +inf logits, each infinitely more likely."""
    logits = np.array([[1.0, np.inf, 0.0, np.inf], [np.inf, -np.inf, 2.0, 1.0]], dtype=np.float32)
    for knobs in ({"temperature": 1.0}, {"temperature": 1e-46}, {"temperature": 1e39},
                  {"temperature": 0.5, "top_p": 0.3}, {"temperature": 2.0, "top_k": 1},
                  {"temperature": 1.0, "min_p": 0.5}):
        got = np.array(mx.exp(filtered_logits(mx.array(logits), **knobs)))
        np.testing.assert_allclose(got, [[0, 0.5, 0, 0.5], [1, 0, 0, 0]], atol=1e-6, err_msg=str(knobs))


@pytest.mark.parametrize("penalty", [5e-324, 1e-46, 1e-40, 1e-30, 1e30, 1e39, 1e308, math.inf])
def test_penalties_at_their_extremes_never_make_nan(penalty):
    """Repeated tokens with positive, zero and negative logits (a model's are finite); then a draw's filters."""
    for presence, frequency in ((0.0, 0.0), (2.0, 2.0), (-2.0, -2.0)):
        options = GenerateOptions(repetition_penalty=penalty, repetition_context=8, presence_penalty=presence,
                                  frequency_penalty=frequency)
        processors = Processors(options)
        state = processors.start([0, 1, 2, 3, 5, 1], prompt_length=3)
        logits = mx.array([[-50.0, 2.0, 0.0, -1.5, 0.25, 3.0]], dtype=mx.float32)
        processed = np.array(processors.apply(logits, [state]))
        assert not np.isnan(processed).any(), (penalty, presence, frequency, processed)
        for temperature in (1.0, 1e-46, 1e39):
            got = np.array(mx.exp(filtered_logits(mx.array(processed), temperature=temperature)))
            assert not np.isnan(got).any() and abs(got.sum() - 1) < 1e-5, (penalty, temperature, got)


# --- end to end: `strata generate` and serve-stdio on the demo model, every draft mode ---------

PROMPT = "for i in range(10):\n    total += values[i]\n" * 3 + "for i in"
HEALED = "def f(x):\n    "  # healing masks tokens with -inf: what a huge temperature divided into NaN
MAX_TOKENS = 10
MODES = ["0", "3", "auto"]
# Settings that must give exactly the greedy tokens.
GREEDY_LIKE = [
    ["-t", "1e-45"], ["-t", "1e-46"], ["-t", "1e-50"], ["-t", "5e-324"], ["-t", "1e-40"],
    ["-t", "1e-46", "--top-p", "0.5", "--top-k", "3", "--min-p", "0.5"],
    ["-t", "1", "--top-p", "1e-46"], ["-t", "1", "--top-p", "5e-324"], ["-t", "1", "--top-k", "1"],
    ["-t", "1", "--min-p", "0.99999999"],
]
# Settings that sample: a full answer, the same tokens in every draft mode (lossless sampling).
SAMPLED = [
    ["-t", "1e39"], ["-t", "1e308", "--top-k", "5"], ["-t", "1", "--repetition-penalty", "1e-46"],
    ["-t", "1", "--repetition-penalty", "1e-40"], ["-t", "1", "--repetition-penalty", "1e308"],
    ["-t", "1", "--presence-penalty", "-2", "--frequency-penalty", "-2"],
    ["-t", "1", "--presence-penalty", "2", "--frequency-penalty", "2", "--top-p", "1", "--min-p", "0"],
    ["-t", "1e-30", "--top-k", "100000000000"],
]


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # `auto`'s cost curve, measured once for the module


def generate_json(args, monkeypatch, cache_home):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    result = CliRunner().invoke(cli, ["generate", *args, "--max-tokens", str(MAX_TOKENS), "--json", "--seed", "0"])
    assert result.exit_code == 0, (args, result.output)
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", MODES)
def test_cli_underflowing_knobs_give_the_greedy_tokens(mode, monkeypatch, cache_home):
    greedy = generate_json([PROMPT, "--suffix-draft", mode], monkeypatch, cache_home)
    assert len(greedy["token_ids"]) == MAX_TOKENS and greedy["finish_reason"] == "length"
    if mode == "3":
        assert greedy["stats"]["drafts_offered"] > 0
    for knobs in GREEDY_LIKE:
        out = generate_json([PROMPT, "--suffix-draft", mode, *knobs], monkeypatch, cache_home)
        assert (out["token_ids"], out["finish_reason"]) == (greedy["token_ids"], "length"), knobs


@pytest.mark.parametrize("knobs", SAMPLED, ids=" ".join)
def test_cli_extreme_knobs_give_full_answers_in_every_mode(knobs, monkeypatch, cache_home):
    for prompt in (PROMPT, HEALED):
        outs = [generate_json([prompt, "--suffix-draft", mode, *knobs], monkeypatch, cache_home) for mode in MODES]
        for out in outs:
            assert len(out["token_ids"]) == MAX_TOKENS and out["finish_reason"] == "length", (knobs, out["text"])
        assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"], (knobs, prompt)


def test_cli_huge_temperature_with_a_banned_phrase(tmp_path, monkeypatch, cache_home):
    bans = tmp_path / "bans.txt"
    bans.write_text("b\n")
    outs = [generate_json(["a", "-t", "1e39", "--ban-phrases", str(bans), "--suffix-draft", mode], monkeypatch,
                          cache_home) for mode in MODES]
    assert all(len(out["token_ids"]) == MAX_TOKENS for out in outs), [out["text"] for out in outs]
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]


def test_serve_stdio_underflowing_knobs_give_the_greedy_tokens():
    requests = []
    for mode in (0, 3, "auto"):
        base = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "suffix_draft": mode, "stream": False, "seed": 0}
        requests.append({"id": f"greedy {mode}", **base})
        for i, knobs in enumerate(({"temperature": 5e-324}, {"temperature": 1e-46, "top_p": 0.5},
                                   {"temperature": 1, "top_p": 5e-324}, {"temperature": 1, "top_p": 1e-46},
                                   {"temperature": 1, "top_k": 1}, {"temperature": 1e-40, "min_p": 0.5})):
            requests.append({"id": f"{i} {mode}", **base, **knobs})
        for i, knobs in enumerate(({"temperature": 1e308}, {"temperature": 1, "repetition_penalty": 5e-324},
                                   {"temperature": 1, "repetition_penalty": 1e308},
                                   {"temperature": 1e39, "ban_phrases": ["b"]})):
            requests.append({"id": f"sampled {i} {mode}", **base, **knobs})
    stdin = "".join(json.dumps(r) + "\n" for r in requests)
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "serve-stdio"], input=stdin, capture_output=True,
                          text=True, timeout=300, check=False)  # the environment conftest.py points at tmp
    assert proc.returncode == 0, proc.stderr[-2000:]
    frames = {f["id"]: f for f in map(json.loads, proc.stdout.splitlines()[1:])}
    assert len(frames) == len(requests) and all(f.get("done") for f in frames.values()), proc.stdout[-2000:]
    for rid, frame in frames.items():
        assert len(frame["token_ids"]) == MAX_TOKENS and frame["finish_reason"] == "length", (rid, frame["text"])
        if not rid.startswith(("greedy", "sampled")):
            assert frame["token_ids"] == frames[f"greedy {rid.split()[-1]}"]["token_ids"], rid
    for i in range(4):
        assert frames[f"sampled {i} 0"]["token_ids"] == frames[f"sampled {i} 3"]["token_ids"] \
            == frames[f"sampled {i} auto"]["token_ids"], i
