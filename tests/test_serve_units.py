"""serve-stdio's parts, in process: request checking, stop strings, the checkpoint ring, the
cross-request suffix cache, session files, chat templates and the line reader."""

import json
import os
import random
import threading

import mlx.core as mx
import numpy as np
import pytest

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.serve.chat import ChatTemplate, ChatTemplateError
from strata_cli.serve.checkpoints import CheckpointRing, common_prefix, plan
from strata_cli.serve.io import EOF, NOTHING, LineReader, OversizeLine
from strata_cli.serve.protocol import (
    INVALID_REQUEST,
    INVALID_UTF8,
    OUT_OF_RANGE,
    PARSE_ERROR,
    RequestError,
    check_request,
    decode_line,
)
from strata_cli.serve.session import SessionError, load_session, save_session
from strata_cli.stop import StopMatcher
from strata_cli.speculative.suffix_cache import GlobalSuffixCache
from strata_cli.speculative.drafters import request_drafter
from strata_cli.speculative.suffix_drafter import SuffixDrafter
from strata_cli.telemetry import DecodeStats

DEFAULTS = GenerateOptions(max_tokens=16)
SPEC = SpecOptions()


def check(line):
    return check_request(decode_line(line.encode() if isinstance(line, str) else line), defaults=DEFAULTS, spec=SPEC)


def error_of(line):
    with pytest.raises(RequestError) as e:
        check(line)
    return e.value


# -- request checking ------------------------------------------------------------------------------


def test_good_request_builds_the_options():
    r = check('{"id": "a", "prompt": "x", "max_tokens": 5, "temperature": 0.5, "seed": 7, '
              '"suffix_draft": 3, "stop": ["\\n\\n", "END"], "stream": false}')
    assert (r.id, r.prompt, r.messages, r.stop, r.stream) == ("a", "x", None, ("\n\n", "END"), False)
    assert r.options == GenerateOptions(max_tokens=5, temperature=0.5, seed=7)
    assert r.spec.max_drafts == 3 and not r.spec.auto
    defaults = check('{"prompt": "x"}')
    assert defaults.id is None and defaults.options == DEFAULTS and defaults.spec == SPEC and defaults.stream
    assert check('{"prompt": "x", "suffix_draft": "auto:5"}').spec.auto
    assert check('{"prompt": "x", "stop": "END"}').stop == ("END",)


@pytest.mark.parametrize("line, code, words", [
    ('{"prompt": "x", "max_tokens": NaN}', PARSE_ERROR, "NaN"),
    ('{"prompt": "x", "temperature": -Infinity}', PARSE_ERROR, "Infinity"),
    ('{"prompt": "x", "temperature": 1e999}', PARSE_ERROR, "does not fit"),
    ('{"prompt": "x", "seed": 1' + "0" * 5000 + "}", PARSE_ERROR, "digits"),
    ('{"prompt": "x", "prompt": "y"}', PARSE_ERROR, "duplicate key 'prompt'"),
    ("[" * 100_000, PARSE_ERROR, "nested too deeply"),
    ('{"prompt": "x"', PARSE_ERROR, "not valid JSON"),
    ("[1, 2]", INVALID_REQUEST, "got array"),
    ('{"prompt": "x", "temprature": 1}', INVALID_REQUEST, "'temprature'"),
    ('{"prompt": 5}', INVALID_REQUEST, "'prompt' must be a string, got integer"),
    ('{"prompt": "x", "max_tokens": 5.0}', INVALID_REQUEST, "'max_tokens' must be an integer, got number"),
    ('{"prompt": "x", "max_tokens": true}', INVALID_REQUEST, "got boolean"),
    ('{"prompt": "x", "stream": "yes"}', INVALID_REQUEST, "'stream' must be a boolean"),
    ('{"prompt": "x", "stop": [1]}', INVALID_REQUEST, "'stop[0]' must be a string"),
    ('{"prompt": "x", "stop": [""]}', OUT_OF_RANGE, "stop[0]"),
    ('{"prompt": "x", "messages": []}', INVALID_REQUEST, "exactly one"),
    ('{"id": 3}', INVALID_REQUEST, "exactly one"),
    ('{"prompt": ""}', INVALID_REQUEST, "empty"),
    ('{"prompt": "\\ud800"}', INVALID_REQUEST, "lone surrogate"),
    ('{"messages": [{"role": "user"}]}', INVALID_REQUEST, "missing ['content']"),
    ('{"prompt": "x", "max_tokens": 0}', OUT_OF_RANGE, "max_tokens must be at least 1, got 0"),
    ('{"prompt": "x", "seed": 9223372036854775808}', OUT_OF_RANGE, "seed must be in"),
    ('{"prompt": "x", "temperature": -0.5}', OUT_OF_RANGE, "temperature must be >= 0"),
    ('{"prompt": "x", "suffix_draft": 8}', OUT_OF_RANGE, "suffix draft"),
    ('{"prompt": "x", "suffix_draft": 2.5}', INVALID_REQUEST, "'suffix_draft'"),
])
def test_bad_requests_get_a_code_and_a_message(line, code, words):
    e = error_of(line)
    assert e.code == code and words in e.message, e.message


def test_error_carries_the_id_only_when_it_is_valid():
    assert error_of('{"id": "r1", "prompt": 1}').request_id == "r1"
    assert error_of('{"id": 7, "prompt": "x", "max_tokens": 0}').request_id == 7
    assert error_of('{"id": {"a": 1}, "prompt": "x"}').request_id is None
    assert error_of('{"id": 18446744073709551616, "prompt": "x"}').request_id is None
    assert error_of(b'{"id": 1, "prompt": "\xff"}').code == INVALID_UTF8


# -- stop strings ----------------------------------------------------------------------------------


def test_stop_string_split_across_deltas_is_never_released():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == "hello "
    assert m.feed("en") == ""
    assert m.feed("d> more") == "" and m.stopped
    assert m.flush() == ""


def test_held_text_is_released_when_it_stops_matching():
    m = StopMatcher(["abc"])
    assert m.feed("xab") == "x"
    assert m.feed("d") == "abd"
    assert m.feed("ab") == "" and m.flush() == "ab"


def test_stop_matcher_random_splits():
    """Released text is always a prefix of the text cut at the first stop, and ends equal to it."""
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[: min(cuts)] if cuts else text
        m, released, i = StopMatcher(stops), "", 0
        while i < len(text):
            j = i + rng.randrange(1, 5)
            released += m.feed(text[i:j])
            assert expected.startswith(released), (text, stops, released)
            i = j
        released += m.flush()
        assert released == expected and m.stopped == bool(cuts)


# -- checkpoint ring -------------------------------------------------------------------------------


class FakeSnapshot:
    def __init__(self, length):
        self.length = length


def add(ring, tokens):
    return ring.add(tokens, FakeSnapshot(len(tokens)))


def test_longest_prefix_and_divergence():
    ring = CheckpointRing(8, 1000)
    add(ring, [1, 2, 3])
    add(ring, [1, 2, 3, 4, 5])
    add(ring, [1, 2, 9, 9])
    assert ring.longest_prefix([1, 2, 3, 4, 5, 6], max_length=5).tokens == (1, 2, 3, 4, 5)
    assert ring.longest_prefix([1, 2, 3, 4, 5, 6], max_length=4).tokens == (1, 2, 3)
    assert ring.longest_prefix([1, 2, 9, 9, 9], max_length=4).tokens == (1, 2, 9, 9)
    assert ring.longest_prefix([1, 2, 7], max_length=2) is None
    assert ring.longest_common_prefix([1, 2, 3, 4, 8]) == 4
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([1, 2]), np.array([3])) == 0


def test_ring_bounds_count_and_positions_least_recently_used_first():
    ring = CheckpointRing(3, 10)
    for n in (1, 2, 3):
        add(ring, list(range(n)))
    ring.longest_prefix([0, 5], max_length=1)  # touches [0]
    add(ring, [7, 7])  # count 4 > 3: the least recently used, [0, 1], goes
    assert sorted(c.tokens for c in ring) == [(0,), (0, 1, 2), (7, 7)]
    add(ring, [5] * 6)  # positions 1 + 3 + 2 + 6 > 10
    assert ring.positions <= 10 and len(ring) <= 3
    assert add(ring, [1] * 11) is None  # longer than the whole budget: not kept
    with pytest.raises(ValueError, match="cannot key"):
        ring.add([1, 2], FakeSnapshot(3))


def test_plan():
    assert plan(0, 1300, every=512) == [512, 1024, 1300]
    assert plan(600, 1300, every=512, divergence=700) == [700, 1024, 1300]
    assert plan(600, 1300, every=0, divergence=1300) == [1300]
    assert plan(5, 5, every=4) == []


# -- cross-request suffix cache --------------------------------------------------------------------


def test_propose_for_own_history_equals_propose():
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(300)]
    d = SuffixDrafter(min_match=3)
    for t in tokens:
        d.append(t)
        assert d.propose(4) == d.propose_for(d.history, 4)


def test_global_cache_drafts_stop_at_an_output_end_and_stay_bounded():
    cache = GlobalSuffixCache(20, min_match=3)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9])
    assert cache.propose_for([0, 1, 2, 3], 8).tokens == (4, 5)  # not into the next output
    assert cache.propose_for([3, 4, 5, 6, 7], 8).tokens == ()  # never across two outputs
    for n in range(10):
        cache.add([100 + n] * 5)
        assert cache.num_tokens <= 20
    assert cache.propose_for([0, 1, 2, 3], 8).tokens == ()  # the oldest were dropped


class CycleConfig:
    vocab_size = 16
    max_position_embeddings = 512


class CycleModel:
    """Greedy next token is (t + 1) % 10."""

    config = CycleConfig()
    state_kinds = []

    def __call__(self, tokens, states, *, last_only=False):
        logits = mx.where(mx.arange(16) == ((tokens + 1) % 10)[..., None], 10.0, 0.0)
        return logits[:, -1:] if last_only else logits


def run_cycle(fallback):
    stats = DecodeStats()
    out = []
    for step in generate(WindowEngine(CycleModel()), [0, 1, 2], options=GenerateOptions(max_tokens=12),
                         spec=SpecOptions(max_drafts=3, min_match=3), eos_ids=(), stats=stats,
                         drafter=request_drafter([0, 1, 2], max_drafts=3, min_match=3,
                                                 shared=[fallback] if fallback else ())):
        out += step.tokens
    return out, stats.summary()


def test_fallback_drafter_changes_drafts_only():
    cache = GlobalSuffixCache(100, min_match=3)
    cache.add([(3 + i) % 10 for i in range(12)])
    plain, plain_stats = run_cycle(None)
    fast, fast_stats = run_cycle(cache)
    assert plain == fast == [(3 + i) % 10 for i in range(12)]
    assert plain_stats["drafts_offered_global"] == 0
    assert fast_stats["drafts_kept_global"] > 0 and fast_stats["windows"] < plain_stats["windows"]


# -- session files ---------------------------------------------------------------------------------

SIGNATURE = {"identity": "model-a", "dtype": "float32", "layout": ["GDNState"] * 3 + ["KVState"]}


def engine_after(model, tokens):
    engine = WindowEngine(model)
    engine.prefill(tokens)
    return engine


def test_session_round_trip_restores_state_exactly(tiny_model, tmp_path):
    from strata_cli.serve.checkpoints import Checkpoint

    tokens = [random.Random(5).randrange(96) for _ in range(37)]
    engine = engine_after(tiny_model, tokens[:20])
    early = Checkpoint(tuple(tokens[:20]), engine.snapshot())
    engine.prefill(tokens[20:])
    late = Checkpoint(tuple(tokens), engine.snapshot())
    file = tmp_path / "s.session"
    save_session(file, [early, late, Checkpoint(late.tokens, late.snapshot)], **SIGNATURE)
    restored = load_session(file, **SIGNATURE, max_context=256, vocab_size=96)
    assert [c.tokens for c in restored] == [early.tokens, late.tokens, late.tokens]
    shared = [a for a in restored[1].snapshot.states[0] if isinstance(a, mx.array)]
    assert shared and all(a is b for a, b in zip(shared, restored[2].snapshot.states[0]))  # stored once
    fresh = WindowEngine(tiny_model)
    fresh.restore(restored[1].snapshot)
    for a, b in zip(engine.state_tensors(), fresh.state_tensors()):
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert mx.array_equal(engine.run([3], 37).logits, fresh.run([3], 37).logits).item()
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file is renamed, not left behind"


def test_session_refuses_corrupt_and_foreign_files(tiny_model, tmp_path):
    from strata_cli.serve.checkpoints import Checkpoint

    engine = engine_after(tiny_model, list(range(20)))
    file = tmp_path / "s.session"
    save_session(file, [Checkpoint(tuple(range(20)), engine.snapshot())], **SIGNATURE)
    good = file.read_bytes()

    def load(**changes):
        return load_session(file, **{**SIGNATURE, **changes}, max_context=256, vocab_size=96)

    with pytest.raises(SessionError, match="another model"):
        load(identity="model-b")
    with pytest.raises(SessionError, match="computed in float32"):
        load(dtype="bfloat16")
    with pytest.raises(SessionError, match="layer states"):
        load(layout=["KVState"] * 4)
    with pytest.raises(SessionError, match="the context holds 8"):
        load_session(file, **SIGNATURE, max_context=8, vocab_size=96)
    flipped = bytearray(good)
    flipped[-7] ^= 0x40  # a bit in the last tensor's data
    file.write_bytes(bytes(flipped))
    with pytest.raises(SessionError, match="checksum mismatch"):
        load()
    for broken in (good[: len(good) // 2], good[:5], b"", b"\x00" * 64):
        file.write_bytes(broken)
        with pytest.raises(SessionError, match="not a readable session file"):
            load()


# -- chat templates and the line reader ------------------------------------------------------------


def test_chat_template_renders_and_reports_errors(tmp_path):
    template = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<e>"}))
    chat = ChatTemplate.from_model_dir(tmp_path)
    assert chat.render([{"role": "user", "content": "hi"}]) == "<|user|>hi\n<|assistant|>"
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        chat.render([{"role": "bad", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_model_dir(tmp_path) is None


def test_line_reader_splits_limits_and_ends():
    r, w = os.pipe()
    reader = LineReader(r, max_line_bytes=1024).start()

    def feed():
        for chunk in (b'{"a": 1}\n\n{"b"', b": 2}\n" + b"x" * 5000, b"y" * 5000 + b"\nlast"):
            os.write(w, chunk)
        os.close(w)

    threading.Thread(target=feed).start()
    items = []
    while not items or items[-1] is not EOF:
        item = reader.get(5.0)
        assert item is not NOTHING
        items.append(item)
    os.close(r)
    assert items == [b'{"a": 1}', b"", b'{"b": 2}', OversizeLine(10000), b"last", EOF]
