"""Overlapped serial decoding (decode.overlapped_serial, WindowEngine.launch/abandon): the same
tokens, finish reasons and committed state as the window loop — at every length limit, at an
end-of-sequence token, at the context limit and when the caller stops early.

The CPU does not overlap by default (it is slower there), so these tests force it on.
"""

import random

import mlx.core as mx
import pytest

from strata_cli.decode import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, generate
from strata_cli.engine.window import WindowEngine, WindowError
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.telemetry import DecodeStats


def decode(tiny_model, prompt, *, overlap, monkeypatch, max_tokens=12, eos=(), max_context=None, stop_after=None):
    """(tokens, finish, engine, stats) of greedy serial decoding, overlapped or not."""
    monkeypatch.setattr(WindowEngine, "can_overlap", property(lambda self: overlap))
    engine = WindowEngine(tiny_model, EngineOptions(max_context=max_context))
    stats = DecodeStats()
    steps = generate(engine, prompt, options=GenerateOptions(max_tokens=max_tokens), spec=SpecOptions(),
                     eos_ids=set(eos), stats=stats)
    tokens, finish = [], None
    for n, step in enumerate(steps, 1):
        tokens += step.tokens
        finish = step.finish_reason
        if stop_after is not None and n == stop_after:
            break
    steps.close()
    return tokens, finish, engine, stats


def assert_same_state(a: WindowEngine, b: WindowEngine):
    assert a.length == b.length
    for layer_a, layer_b in zip(a.state_tensors(), b.state_tensors()):
        assert layer_a.keys() == layer_b.keys()
        for name in layer_a:
            assert mx.array_equal(layer_a[name], layer_b[name]).item(), name


@pytest.fixture(scope="module")
def prompt(tiny_model):
    rng = random.Random(7)
    return [rng.randrange(tiny_model.config.vocab_size) for _ in range(9)]


@pytest.mark.parametrize("max_tokens", [1, 2, 12])
def test_same_tokens_and_state_as_the_window_loop(tiny_model, prompt, monkeypatch, max_tokens):
    plain = decode(tiny_model, prompt, overlap=False, monkeypatch=monkeypatch, max_tokens=max_tokens)
    overlapped = decode(tiny_model, prompt, overlap=True, monkeypatch=monkeypatch, max_tokens=max_tokens)
    assert overlapped[:2] == plain[:2] and plain[1] == FINISH_LENGTH
    assert len(overlapped[0]) == max_tokens
    assert_same_state(overlapped[2], plain[2])
    assert overlapped[3].summary()["windows"] == plain[3].summary()["windows"]


@pytest.mark.parametrize("at", [0, 3, 11])
def test_end_of_sequence_abandons_the_launched_step(tiny_model, prompt, monkeypatch, at):
    """The window after an EOS token was launched before the token was read: it leaves no trace."""
    reference = decode(tiny_model, prompt, overlap=False, monkeypatch=monkeypatch)[0]
    eos = reference[at]
    plain = decode(tiny_model, prompt, overlap=False, monkeypatch=monkeypatch, eos=[eos])
    overlapped = decode(tiny_model, prompt, overlap=True, monkeypatch=monkeypatch, eos=[eos])
    assert overlapped[:2] == plain[:2] and plain[1] == FINISH_STOP
    assert overlapped[0] == reference[: reference.index(eos)]
    assert_same_state(overlapped[2], plain[2])
    overlapped[2].run([1], overlapped[2].length)  # closed: the engine takes the next window


def test_context_limit(tiny_model, prompt, monkeypatch):
    plain = decode(tiny_model, prompt, overlap=False, monkeypatch=monkeypatch, max_context=len(prompt) + 4)
    overlapped = decode(tiny_model, prompt, overlap=True, monkeypatch=monkeypatch, max_context=len(prompt) + 4)
    assert overlapped[:2] == plain[:2] and plain[1] == FINISH_CONTEXT
    assert_same_state(overlapped[2], plain[2])


@pytest.mark.parametrize("stop_after", [1, 2, 5])
def test_caller_stopping_early_leaves_the_window_loops_state(tiny_model, prompt, monkeypatch, stop_after):
    """A stop string or a cancel closes the generator mid-way: the launched step is abandoned."""
    plain = decode(tiny_model, prompt, overlap=False, monkeypatch=monkeypatch, stop_after=stop_after)
    overlapped = decode(tiny_model, prompt, overlap=True, monkeypatch=monkeypatch, stop_after=stop_after)
    assert overlapped[0] == plain[0] and len(plain[0]) == stop_after
    assert_same_state(overlapped[2], plain[2])
    overlapped[2].run([1], overlapped[2].length)


def test_launch_and_abandon_guard_the_contract(tiny_model):
    engine = WindowEngine(tiny_model)
    with pytest.raises(WindowError):
        engine.abandon()  # nothing open
    pending = engine.launch(3, 0)
    with pytest.raises(WindowError):
        engine.launch(pending, 1)  # the first is not committed
    engine.commit(1)
    engine.launch(pending, 1)
    engine.abandon()
    assert engine.length == 1
    partial = WindowEngine(tiny_model, EngineOptions(partial=True))
    partial.run([3], 0)
    with pytest.raises(WindowError):
        partial.abandon()  # a partial run has committed its root already
