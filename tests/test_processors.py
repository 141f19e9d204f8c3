"""Logit processors with per-position state: the phrase automaton against brute force, the
penalties against a numpy reference, forced rejection at every position (T = 2..8, every keep)
for each processor's state, greedy output with penalties and bans identical with and without
drafts, and a banned phrase never emitted."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mock_models import CYCLE, CycleModel

import strata_cli.speculative.drafters as drafters
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import ConfigError, GenerateOptions, SpecOptions
from strata_cli.processors import PhraseAutomaton, Processors, ProcessorTrack
from strata_cli.speculative.suffix_drafter import Proposal
from strata_cli.telemetry import DecodeStats

V = 16
PHRASES = [(3, 4), (5,), (1, 2, 3), (2, 3, 9), (7, 7, 7)]
CONFIGS = {
    "repetition": dict(repetition_penalty=2.5, repetition_context=12),
    "presence": dict(presence_penalty=1.2),
    "frequency": dict(frequency_penalty=0.6),
    "ban": dict(ban_phrases=("x",)),
    "all": dict(repetition_penalty=1.3, repetition_context=3, presence_penalty=-0.4, frequency_penalty=0.5,
                ban_phrases=("x",)),
}


def processors_for(name):
    options = GenerateOptions(**CONFIGS[name])
    return Processors(options, PHRASES if options.ban_phrases else ())


def test_automaton_bans_exactly_the_completing_tokens():
    rng = random.Random(0)
    for _ in range(30):
        phrases = [tuple(rng.randrange(5) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        automaton, node, history = PhraseAutomaton(phrases), 0, []
        for _ in range(40):
            want = {t for t in range(5) for p in phrases if tuple(history + [t])[-len(p):] == p}
            assert set(automaton.banned(node)) == want, (phrases, history)
            token = rng.randrange(5)
            node, history = automaton.step(node, token), history + [token]


def reference_apply(logits, tokens, prompt_length, options, banned):
    x = logits.copy()
    for t in set(tokens[-options.repetition_context:]) if options.repetition_penalty != 1 else ():
        x[t] = x[t] / options.repetition_penalty if x[t] > 0 else x[t] * options.repetition_penalty
    generated = tokens[prompt_length:]
    for t in set(generated):
        x[t] -= options.presence_penalty + options.frequency_penalty * generated.count(t)
    for p in banned:
        if tuple(tokens[len(tokens) - len(p) + 1:]) == p[:-1] or len(p) == 1:
            x[p[-1]] = -np.inf
    return x


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_apply_matches_a_reference(name):
    processors, options = processors_for(name), GenerateOptions(**CONFIGS[name])
    rng = np.random.default_rng(1)
    tokens = [1, 2, 3, 3, 4, 1, 2, 7, 7, 9, 5, 1, 2]
    for prompt_length in (4, 9, len(tokens)):
        state = processors.start(tokens, prompt_length)
        logits = rng.normal(size=V).astype(np.float32)
        got = np.array(processors.apply(mx.array(logits[None]), [state]))[0]
        want = reference_apply(logits, tokens, prompt_length, options, PHRASES if options.ban_phrases else ())
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("T", range(2, 9))
def test_forced_rejection_at_every_position(name, T):
    """Commit every keep of a window of T: the state, and the next row's processed logits,
    equal serial processing of the kept tokens (one token per window)."""
    processors = processors_for(name)
    rng = random.Random(T)
    prompt = [rng.choice([1, 2, 3, 7]) for _ in range(12)]
    prompt_length = 8  # the last 4 "prompt" tokens are generated ones: counts start non-empty
    logits = mx.array(np.random.default_rng(T).normal(size=(1, V)).astype(np.float32))
    for keep in range(1, T + 1):
        inputs = [rng.choice([1, 2, 3, 4, 5, 7, 9]) for _ in range(T)]
        track = ProcessorTrack(processors, prompt, prompt_length)
        rows = track.run(inputs)
        track.commit(keep)
        serial = ProcessorTrack(processors, prompt, prompt_length)
        for i, token in enumerate(inputs[:keep]):
            row = serial.run([token])[0]
            serial.commit(1)
            assert row == rows[i]  # row i is processed with the state after inputs[..i]
        rebuilt = processors.start(prompt + inputs[:keep], prompt_length)
        assert track.state == serial.state == rebuilt
        nxt = [rng.randrange(V)]
        a = processors.apply(logits, track.run(nxt))
        b = processors.apply(logits, serial.run(nxt))
        assert mx.array_equal(a, b)


class SoftCycleModel:
    """Like CycleModel, but with margins a penalty can overturn: (t+1) % 10 scores 2, (t+2) % 10
    scores 1, ids 10..15 score 0.9, the rest 0."""

    config = CycleModel.config
    state_kinds = []

    def __call__(self, tokens, states, *, last_only=False):
        ids = mx.arange(V)
        nxt = tokens[..., None]
        logits = (mx.where(ids == (nxt + 1) % CYCLE, 2.0, 0.0) + mx.where(ids == (nxt + 2) % CYCLE, 1.0, 0.0)
                  + mx.where(ids >= CYCLE, 0.9, 0.0))
        return logits[:, -1:] if last_only else logits


class ScriptedDrafter:
    """Proposes pseudo-random drafts from a small alphabet, so drafts are kept and rejected at
    every position."""

    def __init__(self, prompt_ids, min_match=4):
        self.history = list(prompt_ids)
        self.rng = random.Random(len(prompt_ids))

    def propose(self, max_drafts):
        n = self.rng.randint(1, max_drafts)
        tail = self.history[-1]
        tokens = tuple((tail + 1 + i) % CYCLE if self.rng.random() < 0.7 else self.rng.randrange(CYCLE)
                       for i in range(n))
        return Proposal(tokens, match_length=4, position=0)

    def extend(self, tokens):
        self.history += tokens


def decode_all(engine, prompt, options, spec, banned=()):
    stats = DecodeStats()
    tokens = [t for s in generate(engine, prompt, options=options, spec=spec, eos_ids=(), stats=stats,
                                  banned=banned) for t in s.tokens]
    return tokens, stats.summary()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_with_processors_is_identical_with_drafts(name, monkeypatch):
    """Greedy decoding with each processor: scripted drafts (kept and rejected at every position)
    and suffix drafts (fixed and auto) leave the output token-identical to serial."""
    options = GenerateOptions(max_tokens=40, **CONFIGS[name])
    banned = [(3, 4), (8,), (1, 2, 3)] if options.ban_phrases else ()
    engine = WindowEngine(SoftCycleModel())
    prompt = list(range(CYCLE)) * 2 + [0, 1]
    serial, _ = decode_all(engine, prompt, options, SpecOptions(), banned)
    plain, _ = decode_all(engine, prompt, GenerateOptions(max_tokens=40), SpecOptions())
    assert serial != plain  # the processors changed the output
    for spec in (SpecOptions(max_drafts=3, min_match=3), SpecOptions(max_drafts=7, min_match=3, auto=True)):
        assert decode_all(engine, prompt, options, spec, banned)[0] == serial, spec.label
    monkeypatch.setattr(drafters, "SuffixDrafter", ScriptedDrafter)
    spec, summary = decode_all(engine, prompt, options, SpecOptions(max_drafts=7), banned)
    assert spec == serial
    assert 0 < summary["drafts_kept"] < summary["drafts_offered"]


def test_greedy_with_processors_on_a_random_model_is_identical_with_drafts():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    engine = WindowEngine(random_model(tiny_qwen3_next_config(vocab_size=16), seed=0))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
    options = GenerateOptions(max_tokens=32, **CONFIGS["all"])
    banned = [(2, 2), (10, 3)]
    serial, _ = decode_all(engine, prompt, options, SpecOptions(), banned)
    for drafts in (1, 4, 7):
        assert decode_all(engine, prompt, options, SpecOptions(max_drafts=drafts, min_match=3), banned)[0] == serial


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_a_banned_phrase_never_appears(temperature):
    engine = WindowEngine(CycleModel())
    prompt = list(range(CYCLE)) * 2 + [0, 1]
    options = GenerateOptions(max_tokens=60, temperature=temperature, seed=1, ban_phrases=("x",))
    banned = [(3, 4), (6,), (8, 9, 0)]
    for spec in (SpecOptions(), SpecOptions(max_drafts=7, min_match=3)):
        out, _ = decode_all(engine, prompt, options, spec, banned)
        text = tuple(out)
        for phrase in banned:
            assert not any(text[i:i + len(phrase)] == phrase for i in range(len(text))), (phrase, out)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="top_p 0.9 only applies when sampling: set temperature above 0"):
        GenerateOptions(top_p=0.9)
    with pytest.raises(ConfigError, match="presence_penalty must be in"):
        GenerateOptions(presence_penalty=3)
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0"):
        GenerateOptions(repetition_penalty=0)
    with pytest.raises(ValueError, match="token sequences"):
        Processors(GenerateOptions(ban_phrases=("x",)))
