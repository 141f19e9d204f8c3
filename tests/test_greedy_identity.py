"""Greedy `--suffix-draft 3` output is token-identical to `--suffix-draft 0` on the embedded model,
over code, prose and copy-heavy prompts (lazy and eager fold, partial mode on and off)."""

import inspect
import json
import textwrap

import pytest

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.runtime import embedded_model_path
from strata_cli.telemetry import DecodeStats
from strata_cli.tokenizer import Tokenizer


def build_prompts() -> list[str]:
    import argparse
    import collections
    import difflib
    import heapq
    import shlex
    import string

    code = [
        inspect.getsource(fn)[:400]
        for fn in (
            textwrap.dedent, textwrap.indent, json.dumps, heapq.merge, heapq.nlargest,
            shlex.split, string.capwords, difflib.get_close_matches, collections.namedtuple,
            argparse.ArgumentParser.add_argument, collections.Counter.most_common, json.loads,
        )
    ]
    prose = [
        (mod.__doc__ or "").strip()[:400]
        for mod in (argparse, collections, difflib, heapq, json, shlex, string, textwrap, inspect)
    ] + ["The committee met on Tuesday to discuss the budget, and after a long debate they agreed"]
    func = inspect.getsource(heapq.nsmallest)
    copy_heavy = [
        func[:300] + "\n\n" + func[:300].replace("nsmallest", "n_smallest"),
        func + "\n# the same, renamed:\n" + func.replace("heap", "pile")[:200],
        "the quick brown fox jumps over the lazy dog. " * 6,
        "for i in range(10):\n    total += values[i]\n" * 4,
        "import os\nimport sys\nimport json\n" * 3 + "import",
        "- item one\n- item two\n- item three\n" * 3 + "- item",
        "a, b, c, d, e, f, g, a, b, c, d, e, f, g, a, b, c",
        textwrap.dedent.__doc__[:200] * 2,
    ]
    prompts = code + prose + copy_heavy
    assert len(prompts) >= 30 and all(p.strip() for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def demo():
    path = embedded_model_path()
    return load_model(path), Tokenizer(path)


def decode_all(engine, ids, eos_ids, drafts):
    stats = DecodeStats()
    tokens = []
    for step in generate(engine, ids, options=GenerateOptions(max_tokens=24), spec=SpecOptions(max_drafts=drafts),
                         eos_ids=eos_ids, stats=stats):
        tokens += step.tokens
    return tokens, stats.summary()


@pytest.mark.parametrize("fold, partial, every", [("lazy", False, 1), ("eager", True, 3)])
def test_speculative_greedy_is_token_identical(demo, fold, partial, every):
    model, tokenizer = demo
    engine = WindowEngine(model, EngineOptions(fold=fold, partial=partial))
    offered = kept = 0
    for n, prompt in enumerate(build_prompts()[::every]):
        ids = tokenizer.encode(prompt)
        serial, _ = decode_all(engine, ids, tokenizer.eos_ids, 0)
        spec, summary = decode_all(engine, ids, tokenizer.eos_ids, 3)
        assert spec == serial, f"prompt {n} diverged"
        offered += summary["drafts_offered"]
        kept += summary["drafts_kept"]
    # Speculation really happened: drafts were proposed and some were verified and kept.
    assert offered > 0 and kept > 0
