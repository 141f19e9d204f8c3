"""The decode loop: EOS at any output position, the max_tokens boundary, the context margin,
and greedy output identical with and without drafts."""

import random

import pytest
from mock_models import CYCLE, CycleModel, MockConfig

from strata_cli.decode import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    PromptError,
    generate,
)
from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.telemetry import DecodeStats

PROMPT = list(range(CYCLE)) * 2 + [0, 1, 2]  # the cycle, twice, then a start of a third


def run(engine, prompt, *, max_tokens=40, drafts=0, eos=(), temperature=0.0, seed=0):
    stats = DecodeStats()
    tokens, finish = [], None
    for step in generate(
        engine, prompt, options=GenerateOptions(max_tokens=max_tokens, temperature=temperature, seed=seed),
        spec=SpecOptions(max_drafts=drafts), eos_ids=set(eos), stats=stats,
    ):
        tokens += step.tokens
        finish = step.finish_reason
    return tokens, finish, stats


def serial_cycle(n):
    return [(PROMPT[-1] + 1 + i) % CYCLE for i in range(n)]


@pytest.mark.parametrize("drafts", range(0, 8))
def test_drafts_are_accepted_and_output_is_serial(drafts):
    tokens, finish, stats = run(WindowEngine(CycleModel()), PROMPT, drafts=drafts)
    assert tokens == serial_cycle(40) and finish == FINISH_LENGTH
    summary = stats.summary()
    if drafts:
        assert summary["drafts_kept"] == summary["drafts_offered"] > 0
        assert summary["windows"] < 40


@pytest.mark.parametrize("drafts", [0, 1, 3, 7])
@pytest.mark.parametrize("eos_token", range(CYCLE))
def test_eos_at_every_output_position(drafts, eos_token):
    """Whatever row of a window the EOS lands on, emission stops there and nothing after it commits."""
    engine = WindowEngine(CycleModel())
    tokens, finish, _ = run(engine, PROMPT, drafts=drafts, eos=[eos_token])
    expected = serial_cycle(40)
    expected = expected[: expected.index(eos_token)]
    assert tokens == expected and finish == FINISH_STOP
    # Committed: the prompt minus its root, then one input per emitted token plus the root of the EOS row.
    assert engine.length == len(PROMPT) + len(expected)


@pytest.mark.parametrize("drafts", range(0, 8))
@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_boundary(drafts, max_tokens):
    tokens, finish, stats = run(WindowEngine(CycleModel()), PROMPT, max_tokens=max_tokens, drafts=drafts)
    assert tokens == serial_cycle(max_tokens) and finish == FINISH_LENGTH
    assert all(w.T <= max_tokens for w in stats.windows)


@pytest.mark.parametrize("drafts", [0, 3, 7])
@pytest.mark.parametrize("extra", range(0, 6))
def test_context_margin(drafts, extra):
    """Generation ends cleanly when the context is full; no window ever crosses it."""
    limit = len(PROMPT) + extra
    engine = WindowEngine(CycleModel(), EngineOptions(max_context=limit))
    tokens, finish, _ = run(engine, PROMPT, drafts=drafts)
    # Roots occupy positions len(PROMPT)-1 .. limit-1: one emitted token each.
    assert tokens == serial_cycle(extra + 1) and finish == FINISH_CONTEXT
    assert engine.length <= limit


def test_prompt_errors():
    engine = WindowEngine(CycleModel(), EngineOptions(max_context=8))
    with pytest.raises(PromptError, match="empty"):
        run(engine, [])
    with pytest.raises(PromptError, match="9 tokens but the context holds 8"):
        run(engine, list(range(9)))


def test_sampling_speculates_and_draws_by_position(tiny_model):
    """Drafts run at temperature > 0 (no "serial" note); each position's draw is keyed by
    position, so a seeded run emits the same tokens with and without drafts."""
    engine = WindowEngine(tiny_model)
    prompt = [1, 2, 3, 4, 5] * 3
    serial, _, quiet = run(engine, prompt, max_tokens=24, temperature=0.8, seed=3)
    spec, _, noisy = run(engine, prompt, max_tokens=24, drafts=3, temperature=0.8, seed=3)
    assert serial == spec
    assert quiet.notes == [] and noisy.notes == []
    assert noisy.summary()["drafts_offered"] > 0 and quiet.summary()["drafts_offered"] == 0
    other, _, _ = run(engine, prompt, max_tokens=24, temperature=0.8, seed=4)
    assert other != serial  # the seed matters


SMALL_VOCAB_SEEDS = range(10)


def random_prompt(rng):
    return [rng.randrange(16) for _ in range(12)]


@pytest.fixture(scope="module")
def small_vocab():
    """A 16-token random model and its serial output (default engine options) for each seed's
    prompt: built once, since each fold/partial mode's drafted runs are held to the same serial
    output (every mode's serial decoding is the same arithmetic; the test checks that on seed 0)."""
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    model = random_model(tiny_qwen3_next_config(vocab_size=16), seed=0)
    engine = WindowEngine(model)
    prompts = {seed: random_prompt(random.Random(seed)) for seed in SMALL_VOCAB_SEEDS}
    return model, prompts, {seed: run(engine, prompts[seed], max_tokens=100)[0] for seed in SMALL_VOCAB_SEEDS}


@pytest.mark.parametrize("fold", ["lazy", "eager"])
@pytest.mark.parametrize("partial", [False, True])
def test_small_vocab_model_speculates_and_stays_serial(small_vocab, fold, partial):
    """A 16-token random model falls into loops, so drafts get kept; output stays serial."""
    model, prompts, serial = small_vocab
    engine = WindowEngine(model, EngineOptions(fold=fold, partial=partial))
    assert run(engine, prompts[0], max_tokens=100)[0] == serial[0]  # this mode's serial decoding
    kept = 0
    for seed in SMALL_VOCAB_SEEDS:
        spec, _, stats = run(engine, prompts[seed], max_tokens=100, drafts=3)
        assert spec == serial[seed], seed
        kept += stats.summary()["drafts_kept"]
    assert kept > 20


def test_prefill_progress_reports_every_chunk():
    model = CycleModel()
    model.config = MockConfig(max_position_embeddings=2048)
    engine = WindowEngine(model)
    prompt = [i % CYCLE for i in range(1200)]
    seen = []
    steps = generate(engine, prompt, options=GenerateOptions(max_tokens=2), spec=SpecOptions(), eos_ids=(),
                     prefill_progress=lambda done, total: seen.append((done, total)))
    list(steps)
    assert seen == [(512, 1199), (1024, 1199), (1199, 1199)]  # PREFILL_CHUNK rows at a time
