"""Lossless speculative sampling: the filters against a numpy reference, the coupling rule
against speculative sampling's accept/residual rule, and the output distribution of speculative
decoding against the exact serial distribution of a tiny Markov model (fixed seeds, so the
bounds cannot flake), with drafts rejected at every position."""

import itertools
import random

import mlx.core as mx
import numpy as np
import pytest

import strata_cli.speculative.drafters as drafters
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.sampling import TokenChooser, filtered_logits
from strata_cli.speculative.controller import DraftController
from strata_cli.speculative.suffix_drafter import Proposal
from strata_cli.speculative.acceptance import residual
from strata_cli.telemetry import DecodeStats

V = 4


def reference_filter(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    x = (logits - logits.max()) / temperature
    p = np.exp(x) / np.exp(x).sum()
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep &= x >= np.sort(x)[-top_k]
    if top_p < 1:  # on what top-k left, renormalised
        p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep_sorted = np.zeros_like(keep)
        keep_sorted[order] = before < top_p
        keep &= p >= p[keep_sorted].min()
    if min_p:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (0.5, 0, 1.0, 0.2), (0.9, 5, 0.8, 0.05),
])
def test_filters_match_a_numpy_reference(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 12)).astype(np.float32) * 2
    got = mx.exp(filtered_logits(mx.array(logits), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    for row, want in zip(np.array(got), logits):
        np.testing.assert_allclose(row, reference_filter(want, temperature, top_k, top_p, min_p), atol=1e-6)


def test_coupled_acceptance_is_the_accept_residual_rule():
    """Accepting while the row's own draw equals the draft accepts with p(d) and, on a
    rejection, emits a residual draw: checked on 8000 fixed keys (bounds of about 3.5 standard errors)."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.array(np.log(probs)[None].astype(np.float32))
    chooser = TokenChooser(GenerateOptions(temperature=1.0, seed=11), prompt_length=1)
    n = 8000
    draws = np.array([chooser.choose(logits, i, [0]).tokens[0] for i in range(n)])
    for draft in range(V):
        accepted = draws == draft
        assert abs(accepted.mean() - probs[draft]) < 0.02
        rest = np.bincount(draws[~accepted], minlength=V) / (~accepted).sum()
        assert 0.5 * np.abs(rest - np.array(residual(list(probs), draft))).sum() < 0.03


class MarkovModel:
    """A stateless mock: the next token's logits depend on the current token only."""

    state_kinds = []

    class config:
        vocab_size = V
        max_position_embeddings = 64

    table = mx.array(np.log(np.array([
        [0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1],
    ])).astype(np.float32))

    def __call__(self, tokens, states, *, last_only=False):
        logits = self.table[tokens]
        return logits[:, -1:] if last_only else logits


class ScriptedDrafter:
    """Proposes pseudo-random drafts (mostly wrong), so every position gets rejected somewhere."""

    def __init__(self, prompt_ids, min_match=4):
        self.history = list(prompt_ids)
        self.rng = random.Random(len(prompt_ids))

    def propose(self, max_drafts):
        n = self.rng.randint(1, max_drafts)
        return Proposal(tuple(self.rng.randrange(V) for _ in range(n)), match_length=4, position=0)

    def extend(self, tokens):
        self.history += tokens


def exact_serial(prompt_last, length, temperature):
    table = np.exp(np.array(MarkovModel.table))
    dist = {}
    for seq in itertools.product(range(V), repeat=length):
        p, prev = 1.0, prompt_last
        for t in seq:
            row = reference_filter(np.log(table[prev]), temperature)
            p, prev = p * row[t], t
        dist[seq] = p
    return dist


def test_speculative_distribution_equals_exact_serial(monkeypatch):
    """3 tokens from the Markov model with drafts forced wrong at random positions, over 3000
    fixed seeds: the empirical distribution of the 64 sequences is within TV 0.06 of the exact
    one, and every seed's output equals serial sampling's."""
    monkeypatch.setattr(drafters, "SuffixDrafter", ScriptedDrafter)
    engine, prompt = WindowEngine(MarkovModel()), [0, 1, 2]
    exact = exact_serial(prompt[-1], 3, 0.8)
    counts, stats = {}, DecodeStats()
    for seed in range(3000):
        options = GenerateOptions(max_tokens=3, temperature=0.8, seed=seed)
        spec = [t for s in generate(engine, prompt, options=options, spec=SpecOptions(max_drafts=7), eos_ids=(),
                                    stats=stats) for t in s.tokens]
        if seed % 10 == 0:
            serial = [t for s in generate(engine, prompt, options=options, spec=SpecOptions(), eos_ids=())
                      for t in s.tokens]
            assert spec == serial, seed
        counts[tuple(spec)] = counts.get(tuple(spec), 0) + 1
    tv = 0.5 * sum(abs(counts.get(seq, 0) / 3000 - p) for seq, p in exact.items())
    assert tv < 0.06, tv  # measured 0.046; the distribution at temperature 1.6 instead is at 0.23
    summary = stats.summary()
    assert 0 < summary["drafts_kept"] < summary["drafts_offered"]  # both outcomes happened


@pytest.mark.parametrize("which", ["cycle", "random16"])
def test_seeded_runs_match_across_draft_modes(which):
    """Sampled output equals serial sampling's for every draft mode and seed (the draw of a
    position never depends on its window). The cycle mock at temperature 3 keeps about 2/3 of
    its drafts; the 16-token random model keeps few."""
    from mock_models import CYCLE, CycleModel

    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    if which == "cycle":
        engine, temperature, prompt = WindowEngine(CycleModel()), 3.0, list(range(CYCLE)) * 2
    else:
        engine = WindowEngine(random_model(tiny_qwen3_next_config(vocab_size=16), seed=0))
        temperature, prompt = 0.3, [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
    kept = rejected = 0
    for seed in range(3):
        options = GenerateOptions(max_tokens=32, temperature=temperature, top_p=0.95, seed=seed)
        outputs = []
        for spec in (SpecOptions(), SpecOptions(max_drafts=3, min_match=3),
                     SpecOptions(max_drafts=7, min_match=3, auto=True)):
            stats = DecodeStats()
            outputs.append([t for s in generate(engine, prompt, options=options, spec=spec, eos_ids=(), stats=stats)
                            for t in s.tokens])
            kept += stats.summary()["drafts_kept"]
            rejected += stats.summary()["drafts_offered"] - stats.summary()["drafts_kept"]
        assert outputs[0] == outputs[1] == outputs[2], seed
    assert kept > 0 and rejected > 0


def test_controller_learns_expected_acceptance_when_sampling():
    controller = DraftController(3, decay=1.0)
    controller.observe(T=4, keep=2, seconds=0.01, match_length=8, acceptance=[0.9, 0.4])
    a1, a2 = controller.acceptance(8, 1), controller.acceptance(8, 2)
    greedy = DraftController(3, decay=1.0)
    greedy.observe(T=4, keep=2, seconds=0.01, match_length=8)
    # The first draft counts 0.9 (not 1), the second 0.4 (not 0).
    assert a1 < greedy.acceptance(8, 1) and a2 > greedy.acceptance(8, 2)


@pytest.fixture(scope="module")
def demo_engine():
    from strata_cli.model import load_model
    from strata_cli.runtime import embedded_model_path
    from strata_cli.tokenizer import Tokenizer

    path = embedded_model_path()
    return WindowEngine(load_model(path)), Tokenizer(path)


def test_demo_model_sampling_with_drafts(demo_engine):
    """On the embedded model and a copy-heavy prompt: seeded output equals serial sampling's
    in every draft mode; and the first token's frequencies over 120 seeds, drawn in windows with
    drafts, are within TV 0.12 of the model's exact processed distribution (two tokens hold 0.89
    of it, so a wrong rule shows). The prompt stops mid-line: at a line's end the model may
    start a new file."""
    engine, tokenizer = demo_engine
    ids = tokenizer.encode("for i in range(10):\n    total += values[i]\n" * 4 + "for i in")
    kept = 0
    for seed in range(2):
        options = GenerateOptions(max_tokens=16, temperature=0.7, seed=seed)
        outs = []
        for spec in (SpecOptions(), SpecOptions(max_drafts=3), SpecOptions(max_drafts=7, auto=True)):
            out, summary = [], DecodeStats()
            for step in generate(engine, ids, options=options, spec=spec, eos_ids=(), stats=summary):
                out += step.tokens
            outs.append(out)
            kept += summary.summary()["drafts_kept"]
        assert outs[0] == outs[1] == outs[2], seed
    assert kept > 0

    engine.reset()
    engine.prefill(ids[:-1])
    snapshot = engine.snapshot()
    exact = np.array(mx.exp(filtered_logits(engine.run([ids[-1]], len(ids) - 1).logits[:1], temperature=1.5,
                                            top_k=8)))[0]
    engine.commit(1)
    counts, stats = np.zeros_like(exact), DecodeStats()
    for seed in range(120):
        engine.restore(snapshot)
        options = GenerateOptions(max_tokens=4, temperature=1.5, top_k=8, seed=1000 + seed)
        first = next(generate(engine, ids, options=options, spec=SpecOptions(max_drafts=3), eos_ids=(),
                              stats=stats, prefilled=len(ids) - 1))
        counts[first.tokens[0]] += 1
    assert stats.summary()["drafts_offered"] > 0
    assert 0.5 * np.abs(counts / 120 - exact).sum() < 0.12
