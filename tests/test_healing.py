"""Prompt-edge healing (healing.py): which tokens a prompt loses at its edge (trailing newline,
spaces, several whitespace tokens, mid-identifier, empty and one-token prompts, split UTF-8
characters), the prefix mask against brute force, forced rejection at every position for the
healing processor, greedy output with healing identical with and without drafts, and text that
never repeats or drops a character of the prompt (generate and serve-stdio)."""

import io
import json
import random

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mock_models import CYCLE
from test_processors import ScriptedDrafter, SoftCycleModel

import strata_cli.speculative.drafters as drafters
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.healing import (
    MAX_HEAL_TOKENS,
    HealConstraint,
    HealTable,
    TailSkipper,
    plan_heal,
)
from strata_cli.options import EngineOptions, GenerateOptions, ServeOptions, SpecOptions
from strata_cli.processors import Processors, ProcessorTrack
from strata_cli.serve.protocol import FrameWriter
from strata_cli.serve.server import Server
from strata_cli.telemetry import DecodeStats

V = 16
# id -> bytes; 0 is a special token (never allowed while healing).
VOCAB = [None, b"a", b"b", b"c", b" ", b"\n", b"ab", b"abc", b"  ", b"\n ", b"\n  ", b"   ", b"ca", b"cab",
         b" a", b"bc"]
TABLE = HealTable(VOCAB)
A, B, C, SP, NL, AB, ABC, SP2, NL_SP, NL_SP2, SP3, CA, CAB, SP_A, BC = range(1, V)


def text_of(ids):
    return b"".join(VOCAB[i] or b"<eos>" for i in ids)


def test_the_mask_is_the_prefix_test():
    rng = random.Random(0)
    vocab = [None] + [bytes(rng.choice(b"ab \n") for _ in range(rng.randint(1, 20))) for _ in range(300)]
    table = HealTable(vocab)
    for _ in range(200):
        tail = bytes(rng.choice(b"ab \n") for _ in range(rng.randint(1, 16)))
        want = [b is not None and (tail.startswith(b) or b.startswith(tail)) for b in vocab]
        assert table.allowed(tail).tolist() == want, tail
        assert table.allowed(tail) is table.allowed(tail)  # cached per tail
    width = len(vocab) + 5  # padded logits: the extra ids are never allowed
    assert np.array(table.allowed_mx(b"a", width)).tolist()[-5:] == [False] * 5


@pytest.mark.parametrize("ids, removed, tail", [
    ([A, B, NL], 1, b"\n"),  # trailing newline: "\n " and "\n  " extend it
    ([A, SP2], 1, b"  "),  # trailing spaces
    ([A, NL, SP2], 2, b"\n  "),  # whitespace that spans tokens
    ([A, NL, SP, SP, SP], MAX_HEAL_TOKENS, b"   "),  # at most MAX_HEAL_TOKENS
    ([B, CA], 1, b"ca"),  # mid-identifier: "cab" goes on
    ([A, BC], 0, b""),  # no token goes on past "bc": nothing to heal
    ([], 0, b""),  # empty prompt
    ([CA], 0, b""),  # one token: never removed (the engine has no empty state)
    ([A, 0], 0, b""),  # a special token
])
def test_plan_at_the_edges(ids, removed, tail):
    plan = plan_heal(ids, TABLE)
    assert (plan.removed, plan.tail) == (removed, tail)
    assert plan.prompt_ids + ids[len(plan.prompt_ids):] == ids and len(plan.prompt_ids) == len(ids) - removed
    assert text_of(ids[len(plan.prompt_ids):]) == tail


def test_plan_caps_bytes_and_keeps_utf8_characters_whole():
    spaces = HealTable([None, b"x", b" " * 10, b" " * 12])
    assert plan_heal([1, 2, 2], spaces).tail == b" " * 10  # 20 bytes would pass MAX_HEAL_BYTES
    split = HealTable([None, b"x", b"\xc3", b"\xa9", b"\xa9t", b"\xc3\xa9"])
    plan = plan_heal([1, 2, 3], split)  # "x" + "é" as two byte tokens: both go, or none
    assert (plan.removed, plan.tail_text) == (2, "é")
    assert plan_heal([2, 3], split).removed == 0  # would need the first token too


def test_tail_skipper_drops_the_tail_across_deltas():
    skip = TailSkipper("\n  ")
    assert [skip.feed(d) for d in ["\n", " ", " x", "y"]] == ["", "", "x", "y"]


def heal_processors(tail, **options):
    return Processors(GenerateOptions(**options), (), HealConstraint(TABLE, tail))


def test_apply_masks_exactly_the_inconsistent_tokens():
    processors = heal_processors(b"\n  ")
    prompt = [A, B, C]
    logits = mx.array(np.random.default_rng(0).normal(size=(1, V)).astype(np.float32))
    state = processors.start(prompt, len(prompt))
    assert state.tail == b"\n  "
    got = np.array(processors.apply(logits, [state]))[0]
    allowed = {NL, NL_SP, NL_SP2}
    assert {i for i in range(V) if np.isfinite(got[i])} == allowed
    assert all(got[i] == np.array(logits)[0, i] for i in allowed)
    after = processors.start(prompt + [NL_SP], len(prompt))  # "\n " consumed: " " is left
    assert after.tail == b" "
    assert processors.start(prompt + [NL_SP, SP_A], len(prompt)).tail == b""  # consumed: free again
    assert np.array_equal(np.array(processors.apply(logits, [processors.start(prompt + [NL_SP2], 3)])),
                          np.array(logits))


@pytest.mark.parametrize("T", range(2, 9))
def test_forced_rejection_at_every_position(T):
    """Commit every keep of a window of T: the heal state (with a repetition penalty beside it)
    and the next row's processed logits equal serial processing of the kept tokens."""
    processors = heal_processors(b"\n  ", repetition_penalty=1.5, repetition_context=4)
    rng = random.Random(T)
    prompt = [A, B, C, AB]
    prompt_length = len(prompt) + 1  # the root is the prompt's last token
    logits = mx.array(np.random.default_rng(T).normal(size=(1, V)).astype(np.float32))
    for keep in range(1, T + 1):
        inputs = [CA] + [rng.choice([NL, SP, NL_SP, NL_SP2, SP2, A, SP_A]) for _ in range(T - 1)]
        track = ProcessorTrack(processors, prompt, prompt_length)
        rows = track.run(inputs)
        track.commit(keep)
        serial = ProcessorTrack(processors, prompt, prompt_length)
        for i, token in enumerate(inputs[:keep]):
            assert serial.run([token])[0] == rows[i]
            serial.commit(1)
        rebuilt = processors.start(prompt + inputs[:keep], prompt_length)
        assert track.state == serial.state == rebuilt
        nxt = [rng.choice([NL, SP, B])]
        assert mx.array_equal(processors.apply(logits, track.run(nxt)), processors.apply(logits, serial.run(nxt)))


def decode_all(engine, prompt, spec, heal, **options):
    stats = DecodeStats()
    steps = generate(engine, prompt, options=GenerateOptions(**{"max_tokens": 30, **options}), spec=spec,
                     eos_ids=(), stats=stats, heal=heal)
    return [t for s in steps for t in s.tokens], stats.summary()


@pytest.mark.parametrize("tail", [b"\n  ", b"ca", b"  "])
def test_greedy_with_healing_is_identical_with_drafts(tail):
    """A random model: the constraint changes the output, whose text starts with the tail, and
    suffix drafts (fixed and auto) leave it token-identical to serial."""
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    engine = WindowEngine(random_model(tiny_qwen3_next_config(vocab_size=V), seed=0))
    prompt = [A, B, C, AB, A, B, C, AB, A, B]
    heal = HealConstraint(TABLE, tail)
    serial, _ = decode_all(engine, prompt, SpecOptions(), heal)
    free, _ = decode_all(engine, prompt, SpecOptions(), None)
    assert serial != free and text_of(serial).startswith(tail)
    for spec in (SpecOptions(max_drafts=1, min_match=3), SpecOptions(max_drafts=4, min_match=3),
                 SpecOptions(max_drafts=7, min_match=3, auto=True)):
        assert decode_all(engine, prompt, spec, heal)[0] == serial, spec.label


def test_scripted_drafts_rejected_at_every_position_keep_healed_greedy_output(monkeypatch):
    """Drafts that break the constraint are rejected by the constrained rows; the output equals
    serial decoding."""
    engine = WindowEngine(SoftCycleModel())
    prompt = list(range(CYCLE)) * 2 + [0, 1]
    heal = HealConstraint(TABLE, b"\n  ")
    serial, _ = decode_all(engine, prompt, SpecOptions(), heal, max_tokens=40)
    assert text_of(serial).startswith(b"\n  ")
    monkeypatch.setattr(drafters, "SuffixDrafter", ScriptedDrafter)
    out, summary = decode_all(engine, prompt, SpecOptions(max_drafts=7), heal, max_tokens=40)
    assert out == serial
    assert 0 < summary["drafts_kept"] < summary["drafts_offered"]


# -- text edges: generate on the demo model, serve-stdio on a mock tokenizer ---------------------

@pytest.fixture(scope="module")
def demo_tokenizer():
    from strata_cli.runtime import resolve_model_path
    from strata_cli.tokenizer import Tokenizer

    return Tokenizer(resolve_model_path("demo"))


def test_token_bytes_of_the_demo_tokenizer_decode_like_the_tokenizer(demo_tokenizer):
    table = demo_tokenizer.heal_table()
    assert table is demo_tokenizer.heal_table()  # built once
    for i, b in enumerate(table.token_bytes):
        if b is not None:
            assert b.decode("utf-8", "replace") == demo_tokenizer.decode([i]), i
    assert all(table.token_bytes[i] is None for i in demo_tokenizer.eos_ids)


@pytest.mark.parametrize("prompt", ["def fibonacci(n):\n", "x = [1,  ", "def fibon", "for x in y:\n    "])
def test_generate_prints_the_prompt_continuation_once(prompt, demo_tokenizer):
    runner = CliRunner()
    args = ["generate", prompt, "--max-tokens", "12", "--suffix-draft", "3"]
    record = json.loads(runner.invoke(cli_group(), [*args, "--json"]).stdout)
    plain = runner.invoke(cli_group(), args).stdout
    ids = demo_tokenizer.encode(prompt)
    healed = record["stats"]["healed_tokens"]
    assert healed >= 1 and record["stats"]["prompt_tokens"] == len(ids) - healed
    assert record["stats"]["generated_tokens"] == len(record["token_ids"])
    # The model read prompt-less-tail, then wrote the tail and more: printed is only the more.
    assert demo_tokenizer.decode(ids[:-healed] + record["token_ids"]) == prompt + record["text"]
    assert plain == record["text"] + "\n"  # streamed text is the JSON text
    off = runner.invoke(cli_group(), [*args, "--json", "--no-heal"])
    env_off = runner.invoke(cli_group(), [*args, "--json"], env={"STRATA_NO_HEAL": "1"})
    for result in (off, env_off):
        stats = json.loads(result.stdout)["stats"]
        assert stats["healed_tokens"] == 0 and stats["prompt_tokens"] == len(ids)


def test_a_one_token_prompt_is_not_healed(demo_tokenizer):
    prompt = next(t for t in ("\n", " ", "def") if len(demo_tokenizer.encode(t)) == 1)
    record = json.loads(CliRunner().invoke(cli_group(), ["generate", prompt, "-n", "3", "--json"]).stdout)
    assert record["stats"]["healed_tokens"] == 0 and record["stats"]["prompt_tokens"] == 1


def cli_group():
    from strata_cli.cli import cli

    return cli


class WordTokenizer:
    """The test vocabulary with greedy longest-match encoding."""

    eos_ids = frozenset()
    max_token_bytes = 3

    def encode(self, text):
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            best = max((t for t in range(1, V) if data.startswith(VOCAB[t], i)), key=lambda t: len(VOCAB[t]))
            ids.append(best)
            i += len(VOCAB[best])
        return ids

    def decode(self, ids):
        return text_of(ids).decode()

    def heal_table(self):
        return TABLE


@pytest.fixture(scope="module")
def word_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=V), seed=3)


def ask(model, **request):
    out = io.BytesIO()
    server = Server(WindowEngine(model, EngineOptions()), WordTokenizer(), chat=None,
                    options=ServeOptions(prefix_cache_entries=4), defaults=GenerateOptions(max_tokens=12),
                    spec=SpecOptions(max_drafts=3, min_match=3), frames=FrameWriter(out))
    server.handle(json.dumps(request).encode())
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_serve_heals_prompt_requests_and_streams_the_text_once(word_model):
    prompt = "abcabcab\n"  # ends in "\n": "\n " and "\n  " go on
    *deltas, done = ask(word_model, id=1, prompt=prompt, stream=True)
    assert done["stats"]["healed_tokens"] == 1 and done["usage"]["prompt_tokens"] == len(WordTokenizer().encode(prompt)) - 1
    assert "".join(d["delta"] for d in deltas) == done["text"]
    kept = WordTokenizer().encode(prompt)[:-1]
    assert WordTokenizer().decode(kept + done["token_ids"]) == prompt + done["text"]
    assert done["usage"]["completion_tokens"] == len(done["token_ids"])
    off = ask(word_model, id=2, prompt=prompt, heal=False)[-1]
    assert off["stats"]["healed_tokens"] == 0 and off["usage"]["prompt_tokens"] == len(kept) + 1
    bad = ask(word_model, id=3, prompt=prompt, heal="no")[-1]
    assert bad["error"]["code"] == "invalid_request" and "'heal'" in bad["error"]["message"]


def test_stop_strings_see_only_the_text_after_the_prompt(word_model):
    """A stop string that the healed tail itself contains does not end the reply at once."""
    prompt = "abcabcab\n"
    free = ask(word_model, id=1, prompt=prompt, stream=False)[-1]
    stopped = ask(word_model, id=2, prompt=prompt, stream=False, stop=["\n"])[-1]
    assert free["stats"]["healed_tokens"] == 1 and "\n" in free["text"]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == free["text"].split("\n")[0] != ""
