"""Processor state across serve-stdio's checkpoints and session files: a conversation restored
from a session continues exactly as an uninterrupted one, and as a cold server's, with
penalties and phrase bans on (processor state is a function of the checkpoint's tokens,
processors.py)."""

import io
import json

import pytest

from strata_cli.engine.window import WindowEngine
from strata_cli.healing import HealTable
from strata_cli.options import EngineOptions, GenerateOptions, ServeOptions, SpecOptions
from strata_cli.serve.protocol import FrameWriter
from strata_cli.serve.server import Server
from strata_cli.serve.session import load_session, save_session

VOCAB = 16
SIGNATURE = dict(identity="tiny", dtype="float32", layout=["x"])
FIELDS = dict(repetition_penalty=1.3, repetition_context=6, presence_penalty=0.4, frequency_penalty=0.3,
              ban_phrases=["ab", "c"], max_tokens=24)


class LetterTokenizer:
    """One letter per id: 'a' is 0 ... 'p' is 15."""

    eos_ids = frozenset()
    max_token_bytes = 1  # one ASCII letter a token

    def encode(self, text):
        return [(ord(c) - 97) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)

    def heal_table(self):  # no letter goes on past another: prompts are never healed
        return HealTable([bytes([97 + i]) for i in range(VOCAB)])

    def phrase_sequences(self, phrases):
        return [tuple(self.encode(p)) for p in phrases]


@pytest.fixture(scope="module")
def loop_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=VOCAB), seed=0)


def make_server(model, *, entries=8):
    out = io.BytesIO()
    server = Server(
        WindowEngine(model, EngineOptions()), LetterTokenizer(), chat=None,
        options=ServeOptions(checkpoint_every=8, prefix_cache_entries=entries), defaults=GenerateOptions(),
        spec=SpecOptions(max_drafts=7, min_match=3), frames=FrameWriter(out),
    )
    return server, out


def ask(server, out, **request):
    start = out.tell()
    server.handle(json.dumps(request).encode())
    out.seek(start)
    return [json.loads(line) for line in out.read().splitlines()][-1]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_restored_conversation_continues_as_an_uninterrupted_one(loop_model, tmp_path, temperature):
    first_prompt = "ghijklmghijklmghij"
    live, out = make_server(loop_model)
    first = ask(live, out, id=1, prompt=first_prompt, temperature=temperature, seed=3, **FIELDS)
    assert "ab" not in first["text"] and "c" not in first["text"]
    file = tmp_path / "s.session"
    save_session(file, live.checkpoints(), **SIGNATURE)

    follow_up = first_prompt + first["text"] + "ghijk"
    uninterrupted = ask(live, out, id=2, prompt=follow_up, temperature=temperature, seed=4, **FIELDS)
    restored, out_r = make_server(loop_model)
    restored.adopt(load_session(file, **SIGNATURE, max_context=restored.engine.max_context, vocab_size=VOCAB))
    again = ask(restored, out_r, id=2, prompt=follow_up, temperature=temperature, seed=4, **FIELDS)
    cold, out_c = make_server(loop_model, entries=0)
    fresh = ask(cold, out_c, id=2, prompt=follow_up, temperature=temperature, seed=4, **FIELDS)
    assert again["usage"]["cached_tokens"] >= len(first_prompt)  # the session's checkpoints were used
    assert again["token_ids"] == uninterrupted["token_ids"] == fresh["token_ids"]
    assert "ab" not in again["text"] and "c" not in again["text"]


def test_request_fields_build_the_options():
    from strata_cli.serve.protocol import (
        INVALID_REQUEST,
        OUT_OF_RANGE,
        RequestError,
        check_request,
    )

    request = check_request(
        {"prompt": "x", "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "ban_phrases": ["no"],
         **{k: v for k, v in FIELDS.items() if k != "ban_phrases"}},
        defaults=GenerateOptions(), spec=SpecOptions(),
    )
    o = request.options
    assert (o.top_k, o.top_p, o.min_p, o.repetition_penalty, o.repetition_context, o.presence_penalty,
            o.frequency_penalty, o.ban_phrases) == (5, 0.9, 0.05, 1.3, 6, 0.4, 0.3, ("no",))
    for bad, code, message in (
        ({"top_p": 0.9}, OUT_OF_RANGE, "top_p 0.9 only applies when sampling: set temperature above 0"),
        ({"ban_phrases": "no"}, INVALID_REQUEST, "'ban_phrases' must be a list"),
        ({"ban_phrases": [""]}, OUT_OF_RANGE, "empty"),
        ({"top_k": 1.5}, INVALID_REQUEST, "'top_k' must be an integer"),
        ({"frequency_penalty": 5}, OUT_OF_RANGE, "frequency_penalty must be in"),
    ):
        with pytest.raises(RequestError, match=message) as e:
            check_request({"prompt": "x", **bad}, defaults=GenerateOptions(), spec=SpecOptions())
        assert e.value.code == code


def test_cli_checks_sampling_flags_before_opening_a_model(tmp_path):
    from click.testing import CliRunner

    from strata_cli.cli import cli

    result = CliRunner().invoke(cli, ["generate", "--top-p", "0.9", "hi"])
    assert result.exit_code == 2 and "--top-p 0.9 only applies when sampling: set --temperature above 0" in result.output
    empty = tmp_path / "ban.txt"
    empty.write_text("\n\n")
    result = CliRunner().invoke(cli, ["serve-stdio", "--ban-phrases", str(empty)])
    assert result.exit_code == 2 and "no phrases" in result.output
    result = CliRunner().invoke(cli, ["bench", "--temperature", "0.7", "--modes", "serial,mlx-lm"])
    assert result.exit_code == 2 and "decode greedily" in result.output
