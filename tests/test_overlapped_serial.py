"""Overlapped serial decoding (decode.overlapped_serial, WindowEngine.launch/abandon): the same
tokens, finish reasons and committed state as the window loop — at every length limit, at an
end-of-sequence token, at the context limit and when the caller stops early.

Each test sets overlapping on or off, whatever the backend's default.
"""

import random

import mlx.core as mx
import pytest

from strata_cli.decode import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, generate
from strata_cli.engine.window import WindowEngine, WindowError
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.telemetry import DecodeStats


def decode(tiny_model, prompt, *, overlap, monkeypatch, max_tokens=12, eos=(), max_context=None, stop_after=None,
           spec=None):
    """(tokens, finish, engine, stats) of greedy decoding (serial unless `spec` says otherwise),
    overlapped or not."""
    monkeypatch.setattr(WindowEngine, "can_overlap", property(lambda self: overlap))
    engine = WindowEngine(tiny_model, EngineOptions(max_context=max_context))
    stats = DecodeStats()
    steps = generate(engine, prompt, options=GenerateOptions(max_tokens=max_tokens), spec=spec or SpecOptions(),
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


# -- drafts: one-token steps between windows overlap too ------------------------------------------

@pytest.fixture(scope="module")
def repetitive(tiny_model):
    """A prompt whose motif recurs, so that the first window verifies drafts."""
    rng = random.Random(11)
    motif = [rng.randrange(tiny_model.config.vocab_size) for _ in range(5)]
    return motif * 3 + [rng.randrange(tiny_model.config.vocab_size) for _ in range(4)] + motif[:3]


@pytest.fixture(autouse=True)
def drafts_now_and_then(request, monkeypatch):
    """A random model's text never recurs, so (in the tests that take `repetitive`) the drafter
    also offers its last three tokens whenever the history's length is a multiple of 5: windows
    and stretches of one-token steps alternate all along."""
    if "repetitive" not in request.fixturenames:
        return
    from strata_cli.speculative.suffix_drafter import Proposal, SuffixDrafter

    propose = SuffixDrafter.propose

    def sometimes(self, max_drafts):
        found = propose(self, max_drafts)
        history = self.history
        if found.tokens or len(history) % 5 or not max_drafts:
            return found
        return Proposal(tokens=history[-3:][:max_drafts], match_length=3, position=len(history) - 4)

    monkeypatch.setattr(SuffixDrafter, "propose", sometimes)


def count_abandons(monkeypatch):
    calls = []
    abandon = WindowEngine.abandon
    monkeypatch.setattr(WindowEngine, "abandon", lambda self: (calls.append(1), abandon(self))[1])
    return calls


@pytest.mark.parametrize("max_tokens", [1, 7, 24])
def test_with_fixed_drafts_the_same_tokens_windows_and_state(tiny_model, repetitive, monkeypatch, max_tokens):
    """Fixed drafts plan every step from the same history either way, so even the windows match;
    a stretch of one-token steps ends when a token brings drafts (its launched step abandoned)."""
    spec = SpecOptions(max_drafts=3, min_match=3)
    plain = decode(tiny_model, repetitive, overlap=False, monkeypatch=monkeypatch, max_tokens=max_tokens, spec=spec)
    abandons = count_abandons(monkeypatch)
    overlapped = decode(tiny_model, repetitive, overlap=True, monkeypatch=monkeypatch, max_tokens=max_tokens,
                        spec=spec)
    assert overlapped[:2] == plain[:2] and plain[1] == FINISH_LENGTH and len(plain[0]) == max_tokens
    assert_same_state(overlapped[2], plain[2])
    assert overlapped[3].summary()["windows"] == plain[3].summary()["windows"]
    if max_tokens == 24:
        windows = plain[3].windows
        assert any(w.T > 1 for w in windows) and any(w.T == 1 for w in windows)
        assert abandons  # at least one stretch handed back to a window


@pytest.mark.parametrize("auto", [False, True])
def test_with_drafts_end_of_sequence_and_context_limit(tiny_model, repetitive, monkeypatch, auto):
    spec = SpecOptions(max_drafts=3, min_match=3, auto=auto)
    reference = decode(tiny_model, repetitive, overlap=False, monkeypatch=monkeypatch, max_tokens=24, spec=spec)[0]
    for kwargs in ({"eos": [reference[9]]}, {"max_context": len(repetitive) + 10}, {"stop_after": 4}):
        plain = decode(tiny_model, repetitive, overlap=False, monkeypatch=monkeypatch, max_tokens=24, spec=spec,
                       **kwargs)
        overlapped = decode(tiny_model, repetitive, overlap=True, monkeypatch=monkeypatch, max_tokens=24, spec=spec,
                            **kwargs)
        assert overlapped[:2] == plain[:2], kwargs
        assert_same_state(overlapped[2], plain[2])
        if "max_context" not in kwargs:
            overlapped[2].run([1], overlapped[2].length)  # nothing left open


def test_auto_learns_the_overlapped_steps_cost(tiny_model, repetitive, monkeypatch):
    """auto compares drafts with what a one-token step costs, so overlapped steps teach it (all
    but a last step that ends generation: nothing is decided after it)."""
    seen = []
    from strata_cli.speculative.controller import DraftController
    observe = DraftController.observe
    monkeypatch.setattr(DraftController, "observe", lambda self, **kw: (seen.append(kw["T"]), observe(self, **kw))[1])
    spec = SpecOptions(max_drafts=3, min_match=3, auto=True)
    tokens, _, _, stats = decode(tiny_model, repetitive, overlap=True, monkeypatch=monkeypatch, max_tokens=24,
                                 spec=spec)
    steps = sum(w.T == 1 for w in stats.windows)
    assert len(seen) - seen.count(1) == len(stats.windows) - steps
    assert steps - 1 <= seen.count(1) <= steps and steps > 1


@pytest.mark.parametrize("verify", [0, 2])
def test_drafts_auto_declines_in_a_stretch_are_counted(tiny_model, repetitive, monkeypatch, verify):
    """Drafts `auto` declines are counted (drafts_proposed, drafts_declined, proposal_coverage,
    mean match length) whether the one-token step then runs overlapped or in the window loop.
    `verify`: how many drafts the stub controller takes when it takes any (every 4th proposal)."""
    from strata_cli.speculative.controller import DraftController

    def choose(self, match_length, available, *, extra_cost=None):
        self.calls = getattr(self, "calls", 0) + 1
        return min(verify, available) if self.calls % 4 == 0 else 0

    monkeypatch.setattr(DraftController, "choose", choose)
    spec = SpecOptions(max_drafts=3, min_match=3, auto=True)
    keys = ("drafts_proposed", "drafts_offered", "drafts_declined", "proposal_coverage", "mean_match_length",
            "windows")
    plain = decode(tiny_model, repetitive, overlap=False, monkeypatch=monkeypatch, max_tokens=24, spec=spec)
    overlapped = decode(tiny_model, repetitive, overlap=True, monkeypatch=monkeypatch, max_tokens=24, spec=spec)
    assert overlapped[0] == plain[0]
    want = {k: plain[3].summary()[k] for k in keys}
    assert {k: overlapped[3].summary()[k] for k in keys} == want
    assert want["drafts_declined"] > 0 and want["proposal_coverage"] > 0
