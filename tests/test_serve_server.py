"""The serve `Server` in process, on a tiny random model that falls into loops (so drafts are
offered, kept and rejected): every checkpoint equals serially prefilling its tokens, reuse
gives the cold output, cancellation and internal errors leave a working server."""

import dataclasses
import io
import json
import random

import mlx.core as mx
import pytest

from strata_cli.engine.window import WindowEngine
from strata_cli.healing import HealTable
from strata_cli.options import EngineOptions, GenerateOptions, ServeOptions, SpecOptions
from strata_cli.serve.protocol import FrameWriter
from strata_cli.serve.server import Server

VOCAB = 16
TOL = 1e-4


class LetterTokenizer:
    """One letter per id: 'a' is 0 ... 'p' is 15."""

    eos_ids = frozenset()
    max_token_bytes = 4  # one character, up to 4 UTF-8 bytes

    def encode(self, text):
        return [(ord(c) - 97) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)

    def heal_table(self):  # no letter goes on past another: prompts are never healed
        return HealTable([bytes([97 + i]) for i in range(VOCAB)])


@pytest.fixture(scope="module")
def loop_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=VOCAB), seed=0)


def make_server(model, *, fold="lazy", cancelled=lambda: False, **options):
    out = io.BytesIO()
    server = Server(
        WindowEngine(model, EngineOptions(fold=fold)), LetterTokenizer(), chat=None,
        options=ServeOptions(**{"checkpoint_every": 8, **options}), defaults=GenerateOptions(max_tokens=16),
        spec=SpecOptions(max_drafts=7, min_match=3), frames=FrameWriter(out), cancelled=cancelled,
    )
    return server, out


def ask(server, out, **request):
    start = out.tell()
    server.handle(json.dumps(request).encode())
    out.seek(start)
    frames = [json.loads(line) for line in out.read().splitlines()]
    return frames[-1]


def prompts(n, seed=0):
    rng = random.Random(seed)
    base = "".join(rng.choice("abcdefghijklmnop") for _ in range(20))
    return [base[: rng.randrange(5, 20)] + "".join(rng.choice("abcd") for _ in range(rng.randrange(1, 12)))
            for _ in range(n)]


def assert_checkpoints_are_serial(model, checkpoints):
    for c in checkpoints:
        restored = WindowEngine(model)
        restored.restore(c.snapshot)
        serial = WindowEngine(model)
        serial.prefill(list(c.tokens))
        for a, b in zip(restored.state_tensors(), serial.state_tensors()):
            assert a.keys() == b.keys()
            for name in a:
                assert float(mx.abs(a[name] - b[name]).max()) < TOL, (c.length, name)


@pytest.mark.parametrize("fold", ["lazy", "eager"])
def test_every_checkpoint_equals_serial_prefill(loop_model, fold):
    server, out = make_server(loop_model, fold=fold)
    rejected = 0
    for i, prompt in enumerate(prompts(8)):
        reply = ask(server, out, id=i, prompt=prompt, suffix_draft=7)
        assert reply["done"], reply
        rejected += reply["stats"]["drafts_offered"] - reply["stats"]["drafts_kept"]
    assert rejected > 0 and len(server.checkpoints()) > 8
    assert_checkpoints_are_serial(loop_model, server.checkpoints())


def test_checkpoint_with_a_fold_pending_includes_it(loop_model):
    """Right after a window whose drafts were rejected, the lazy fold of the kept rows is pending."""
    server, _ = make_server(loop_model, fold="lazy")
    engine, tokens = server.engine, [1, 2, 3, 4, 5, 6, 7, 8, 9]
    engine.prefill(tokens[:-1])
    out = engine.run([tokens[-1], *[(t + 1) % VOCAB for t in range(4)]], len(tokens) - 1)
    wrong = next(i for i in range(1, 5) if out.tokens[i - 1] != (i % VOCAB))  # first rejected draft
    engine.commit(wrong)
    assert any(getattr(s, "pending", None) is not None for s in engine.states)
    committed = tokens + [(t + 1) % VOCAB for t in range(wrong - 1)]
    server._checkpoint(committed)
    assert_checkpoints_are_serial(loop_model, server.checkpoints())


def test_reuse_gives_the_cold_output(loop_model):
    warm, warm_out = make_server(loop_model)
    cold, cold_out = make_server(loop_model, prefix_cache_entries=0)
    reused = 0
    for i, prompt in enumerate(prompts(8, seed=1) * 2):
        a = ask(warm, warm_out, id=i, prompt=prompt, suffix_draft=i % 8)
        b = ask(cold, cold_out, id=i, prompt=prompt, suffix_draft=i % 8)
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"], i
        reused += a["usage"]["cached_tokens"]
        assert b["usage"]["cached_tokens"] == 0
    assert reused > 50


def test_cancel_answers_and_leaves_a_usable_checkpoint(loop_model):
    calls = {"n": 0}

    def cancel_after_some_steps():
        calls["n"] += 1
        return calls["n"] > 12

    server, out = make_server(loop_model, cancelled=cancel_after_some_steps)
    reply = ask(server, out, id="c", prompt="abcabcabcabcabcabcabcabc", max_tokens=500)
    assert reply["finish_reason"] == "cancelled" and 0 < reply["usage"]["completion_tokens"] < 500
    calls["n"] = -10**9  # no more cancelling
    again = ask(server, out, id="d", prompt="abcabcabcabcabcabcabcabc", max_tokens=20)
    fresh, fresh_out = make_server(loop_model, prefix_cache_entries=0)
    assert again["token_ids"] == ask(fresh, fresh_out, id="e", prompt="abcabcabcabcabcabcabcabc",
                                     max_tokens=20)["token_ids"]


def test_internal_error_is_answered_and_the_server_recovers(loop_model):
    server, out = make_server(loop_model)
    calls = {"n": 0}

    def flaky(step):  # the third step, a window (`run`) or an overlapped one-token step (`launch`)
        def call(inputs, pos0):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device failure")
            return step(inputs, pos0)
        return call

    server.engine.run, server.engine.launch = flaky(server.engine.run), flaky(server.engine.launch)
    reply = ask(server, out, id=1, prompt="abcdabcd", max_tokens=10)
    assert reply["error"]["code"] == "internal_error" and "simulated" in reply["error"]["message"]
    ok = ask(server, out, id=2, prompt="abcdabcd", max_tokens=10)
    fresh, fresh_out = make_server(loop_model, prefix_cache_entries=0)
    assert ok["token_ids"] == ask(fresh, fresh_out, id=3, prompt="abcdabcd", max_tokens=10)["token_ids"]


def test_an_auto_request_gets_its_spec_completed_by_the_runtime(loop_model):
    """A request asking for `auto` when the server's default is not auto still gets the device's
    cost curve: every request's spec goes through `spec_for` (Runtime.spec_for in serve-stdio)."""
    from strata_cli.speculative.controller import CostPrior

    seen = []
    prior = CostPrior.from_seconds([0.01 * (1 + 0.1 * t) for t in range(8)], source="test")

    def spec_for(spec):
        seen.append(spec)
        return dataclasses.replace(spec, cost_prior=prior) if spec.auto else spec

    out = io.BytesIO()
    server = Server(
        WindowEngine(loop_model), LetterTokenizer(), chat=None, options=ServeOptions(),
        defaults=GenerateOptions(max_tokens=8), spec=SpecOptions(), frames=FrameWriter(out), spec_for=spec_for,
    )
    reply = ask(server, out, id=1, prompt="abcabc", suffix_draft="auto")
    assert reply["stats"]["controller"]["cost_prior"] == "test"
    assert "controller" not in ask(server, out, id=2, prompt="abcabc")["stats"]
    assert [s.auto for s in seen] == [True, False] and seen[0].cost_prior is None
