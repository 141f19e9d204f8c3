"""Issue 17: bounded work per request in serve-stdio. A checkpoint's chat template cannot run
forever or build huge values, a huge prompt is refused before it is tokenized, a background read
error of one request is not raised in the next, and `"stop": null` is refused."""

import time
from concurrent.futures import Future

import pytest
from stream_checkpoints import build_pair
from test_serve_server import VOCAB, LetterTokenizer, ask, make_server

from strata_cli.experts.store import ExpertReadError
from strata_cli.options import StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.serve.chat import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def loop_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=VOCAB), seed=0)


@pytest.mark.parametrize("source, why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
    ("{{ 'x' * 2000000000 }}", "would build a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "would build a value"),
    ("{{ 'x'.center(2000000000) }}", "would build a value"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output passed"),
])
def test_a_hostile_template_is_stopped_within_its_budget(source, why):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=why) as error:
        ChatTemplate(source, {}).render(MESSAGES, seconds=0.3, max_chars=1 << 20)
    assert error.value.code == "template_error"
    assert time.monotonic() - started < 3


def test_a_template_stops_when_the_server_is_told_to():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    calls = []
    with pytest.raises(ChatTemplateError, match="stopping"):
        ChatTemplate(source, {}).render(MESSAGES, seconds=60, cancelled=lambda: calls.append(1) or len(calls) > 3)


def test_an_ordinary_template_renders_as_before():
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert ChatTemplate(source, {}).render(MESSAGES) == "<user>abc>"


def test_the_server_answers_template_error_and_keeps_serving(loop_model):
    server, out = make_server(loop_model)
    server.chat = ChatTemplate("{{ 'x' * 2000000000 }}", {})
    assert ask(server, out, id=1, messages=MESSAGES)["error"]["code"] == "template_error"
    assert ask(server, out, id=2, prompt="abcabc", max_tokens=2)["done"]


class CountingTokenizer(LetterTokenizer):
    def __init__(self):
        self.encoded = []

    def encode(self, text):
        self.encoded.append(len(text))
        return super().encode(text)


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(loop_model):
    server, out = make_server(loop_model)
    server.tokenizer = CountingTokenizer()
    huge = "ab" * (4 << 20)
    reply = ask(server, out, id=1, prompt=huge)
    assert reply["error"]["code"] == "prompt_too_long" and server.tokenizer.encoded == []
    assert ask(server, out, id=2, prompt="abcabc", max_tokens=2)["done"]


def test_stop_null_is_refused_like_any_null(loop_model):
    server, out = make_server(loop_model)
    reply = ask(server, out, id=1, prompt="abc", stop=None)
    assert reply["error"]["code"] == "invalid_request" and "'stop'" in reply["error"]["message"]
    assert ask(server, out, id=2, prompt="abc", max_tokens=2)["done"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("bounded"), vocab_size=VOCAB)[1]


def test_a_prefetch_error_of_one_request_is_not_raised_in_the_next(streamed):
    model = load_checkpoint(streamed, stream=StreamOptions(resident_experts=4))
    server, out = make_server(model)
    assert ask(server, out, id=1, prompt="abcabc", max_tokens=3)["done"]
    cache = model.expert_cache
    failed = Future()  # a prefetch of request 1 still in flight when it ended, failing afterwards
    failed.set_running_or_notify_cancel()  # at the disk: a read-ahead still queued would be cancelled
    cache._blocks[1].inflight[9] = failed
    cache._drop_prefetches(1, cache._blocks[1])
    failed.set_exception(ExpertReadError("layer_001.bin: read of expert 9 failed (Input/output error)"))
    reply = ask(server, out, id=2, prompt="abcabc", max_tokens=3)
    assert reply.get("done"), reply
    cache.close()
