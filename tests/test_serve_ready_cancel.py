"""serve-stdio's client gaps (issue 32, item 8): the ready frame on stdout, cancelling one request
with a cancel line (in flight, waiting, unknown), OpenAI-style content-part arrays in `messages`,
and docs/serve.md's `stats` table against the keys a real reply carries."""

import io
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_serve_server import VOCAB, LetterTokenizer

from strata_cli import __version__
from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions, GenerateOptions, ServeOptions, SpecOptions
from strata_cli.runtime import embedded_model_path
from strata_cli.serve.chat import ChatTemplate
from strata_cli.serve.io import EOF, NOTHING, ReadAhead, SignalFlag
from strata_cli.serve.protocol import INVALID_REQUEST, FrameWriter, RequestError, check_request
from strata_cli.serve.server import Server, serve_lines
from strata_cli.telemetry import FIELDS

SERVE = [sys.executable, "-m", "strata_cli.cli", "serve-stdio"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serve.md"
LOOP = "abcabcabcabcabcabcabcabc"  # the loop model repeats it: long greedy answers


@pytest.fixture(scope="module")
def loop_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(vocab_size=VOCAB), seed=0)


class ScriptedReader:
    """A `LineReader` stand-in: each line becomes readable once `get` has been called `after` times
    (the server calls it once per poll while a request runs), then EOF."""

    def __init__(self, script):
        self.script = list(script)  # (line: bytes | dict, after: int)
        self.calls = 0

    def get(self, timeout):
        self.calls += 1
        if not self.script:
            return EOF
        line, after = self.script[0]
        if self.calls < after:
            return NOTHING
        self.script.pop(0)
        return line if isinstance(line, bytes) else json.dumps(line).encode()


def run_script(model, script, *, chat=None, max_tokens=16):
    """serve_lines over a scripted stdin; every frame it wrote."""
    out = io.BytesIO()
    lines = ReadAhead(ScriptedReader(script))
    server = Server(WindowEngine(model, EngineOptions()), LetterTokenizer(), chat=chat,
                    options=ServeOptions(checkpoint_every=8), defaults=GenerateOptions(max_tokens=max_tokens),
                    spec=SpecOptions(max_drafts=7, min_match=3), frames=FrameWriter(out), lines=lines)
    assert serve_lines(server, lines, SignalFlag()) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def server_process():
    """serve-stdio on the demo model, killed after a minute so that a missing frame fails the test
    instead of hanging it."""
    proc = subprocess.Popen(SERVE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    return proc


def finals(frames):
    return [f for f in frames if f.get("done") or "error" in f or "cancel" in f]


# -- the ready frame -----------------------------------------------------------------------------


def test_the_first_frame_is_ready_and_comes_before_any_request():
    proc = server_process()
    try:
        ready = json.loads(proc.stdout.readline())  # no request sent yet
        proc.stdin.write(b'{"id": 1, "prompt": "def add(a, b):", "max_tokens": 2, "stream": false}\n')
        proc.stdin.close()
        rest = [json.loads(line) for line in proc.stdout.read().splitlines()]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert set(ready) == {"ready", "protocol", "version", "model", "identity", "dtype", "max_context", "chat_template"}
    assert ready["ready"] is True and ready["protocol"] == 1 and ready["version"] == __version__
    assert Path(ready["model"]) == embedded_model_path() and re.fullmatch(r"[0-9a-f]{64}", ready["identity"])
    assert ready["dtype"] == "float32" and ready["max_context"] > 0 and ready["chat_template"] is False
    assert "id" not in ready  # a client dispatching by id passes over it
    assert [f["id"] for f in rest] == [1] and rest[0]["done"]


# -- cancel lines ---------------------------------------------------------------------------------


def test_a_cancel_line_stops_the_request_in_flight_and_the_server_goes_on(loop_model):
    script = [({"id": "a", "prompt": LOOP, "max_tokens": 500}, 0), ({"cancel": "a"}, 12),
              ({"id": "b", "prompt": LOOP, "max_tokens": 8}, 0)]
    frames = run_script(loop_model, script)
    a, ack, b = finals(frames)
    assert a["id"] == "a" and a["finish_reason"] == "cancelled"
    assert 0 < a["usage"]["completion_tokens"] < 500 and len(a["token_ids"]) == a["usage"]["completion_tokens"]
    assert "".join(f["delta"] for f in frames if f.get("id") == "a" and "delta" in f) == a["text"]
    assert ack == {"cancel": "a", "found": True}
    cold = run_script(loop_model, [({"id": "b", "prompt": LOOP, "max_tokens": 8}, 0)])
    assert b["finish_reason"] == "length" and b["token_ids"] == finals(cold)[0]["token_ids"]


def test_a_waiting_request_is_cancelled_without_running(loop_model):
    script = [({"id": 1, "prompt": LOOP, "max_tokens": 6}, 0), ({"id": 2, "prompt": LOOP}, 0),
              ({"id": "2", "prompt": "abcd", "max_tokens": 3}, 0), ({"id": 2, "prompt": "abab"}, 0),
              ({"cancel": 2}, 0), ({"cancel": "nobody"}, 0), ({"id": 2, "prompt": "abc", "max_tokens": 3}, 0)]
    ends = finals(run_script(loop_model, script))
    assert [f.get("id", f.get("cancel")) for f in ends] == [1, 2, "2", 2, 2, "nobody", 2]  # every line, in order
    first, two, string_two, two_again, ack, unknown, later = ends
    assert first["finish_reason"] == "length" and string_two["finish_reason"] == "length"  # "2" is not 2
    for f in (two, two_again):  # both requests with id 2 sent before the cancel line
        assert f["done"] and f["finish_reason"] == "cancelled" and f["text"] == "" and f["token_ids"] == []
        assert f["usage"] == {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        assert f["stats"]["notes"] == ["cancelled before it started"] and f["stats"].keys() == first["stats"].keys()
    assert ack == {"cancel": 2, "found": True} and unknown == {"cancel": "nobody", "found": False}
    assert later["finish_reason"] == "length"  # sent after the cancel line: untouched


def test_a_cancel_crossing_the_reply_is_a_no_op(loop_model):
    script = [({"id": 1, "prompt": "abcd", "max_tokens": 3}, 0), ({"cancel": 1}, 10**6)]  # after the reply
    done, ack = finals(run_script(loop_model, script))
    assert done["finish_reason"] == "length" and ack == {"cancel": 1, "found": False}


@pytest.mark.parametrize("line, message", [
    ({"cancel": None}, "null"),
    ({"cancel": [1]}, "'cancel' must be"),
    ({"cancel": True}, "'cancel' must be"),
    ({"cancel": 1, "prompt": "abc"}, "the one field 'cancel'"),
    (b'{"cancel": 1}' + b" " * 5000, "at most 4096 bytes"),
])
def test_a_malformed_cancel_line_gets_an_error_and_cancels_nothing(loop_model, line, message):
    script = [({"id": 1, "prompt": "abcd", "max_tokens": 3}, 0), (line, 0)]
    done, error = finals(run_script(loop_model, script))
    assert done["finish_reason"] == "length"
    assert error["id"] is None and error["error"]["code"] == INVALID_REQUEST and message in error["error"]["message"]


def test_a_cancel_stops_a_chat_template_still_rendering(loop_model):
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {})
    script = [({"id": "chat", "messages": [{"role": "user", "content": "abc"}]}, 0), ({"cancel": "chat"}, 3)]
    started = time.monotonic()
    reply, ack = finals(run_script(loop_model, script, chat=slow))
    assert reply["done"] and reply["finish_reason"] == "cancelled" and reply["stats"]["notes"] == [
        "cancelled before it started"]
    assert ack["found"] and time.monotonic() - started < 1.5  # well inside the template's 2 s budget


def test_serve_stdio_cancels_one_request_through_stdin():
    proc = server_process()
    try:
        assert json.loads(proc.stdout.readline())["ready"]
        proc.stdin.write(json.dumps({"id": "long", "prompt": "import os", "max_tokens": 4000}).encode() + b"\n")
        proc.stdin.flush()
        assert "delta" in json.loads(proc.stdout.readline())  # it is generating
        proc.stdin.write(b'{"cancel": "long"}\n{"id": "next", "prompt": "def add(a, b):", "max_tokens": 3}\n')
        proc.stdin.close()
        frames = [json.loads(line) for line in proc.stdout.read().splitlines()]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    long, ack, after = finals(frames)
    assert long["id"] == "long" and long["finish_reason"] == "cancelled"
    assert 0 < long["usage"]["completion_tokens"] < 4000
    assert ack == {"cancel": "long", "found": True}
    assert after["id"] == "next" and after["finish_reason"] == "length"


# -- content parts ----------------------------------------------------------------------------------


def check(messages):
    return check_request({"messages": messages}, defaults=GenerateOptions(), spec=SpecOptions())


def test_text_content_parts_are_joined_in_order():
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": ""}, {"type": "text", "text": "c"}]
    request = check([{"role": "system", "content": "x"}, {"role": "user", "content": parts}])
    assert request.messages == [{"role": "system", "content": "x"}, {"role": "user", "content": "abc"}]
    assert check([{"role": "user", "content": []}]).messages == [{"role": "user", "content": ""}]


@pytest.mark.parametrize("content, message", [
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "messages[0].content[1] is 'image_url': only \"text\" content parts are supported"),
    ([{"type": "input_audio", "input_audio": {}}], "is 'input_audio'"),
    ([{"text": "a"}], "without a string 'type'"),
    (["a"], "messages[0].content[0] must be a content part object, got string"),
    ([{"type": "text"}], "missing ['text']"),
    ([{"type": "text", "text": "a", "cache_control": {}}], "unknown ['cache_control']"),
    ([{"type": "text", "text": 5}], "'messages[0].content[0].text' must be a string"),
    (5, "must be a string or a list of text parts"),
    (None, "must be a string or a list of text parts, got null"),
])
def test_other_content_parts_are_refused_by_name(content, message):
    with pytest.raises(RequestError) as error:
        check([{"role": "user", "content": content}])
    assert error.value.code == INVALID_REQUEST and message in error.value.message


def test_a_content_part_request_renders_like_its_string(loop_model):
    chat = ChatTemplate("{% for m in messages %}{{ m.role[0] }}{{ m.content }}{% endfor %}", {})
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "abd"}]
    script = [({"id": 1, "messages": [{"role": "user", "content": "abcabd"}], "max_tokens": 6}, 0),
              ({"id": 2, "messages": [{"role": "user", "content": parts}], "max_tokens": 6}, 0)]
    one, two = finals(run_script(loop_model, script, chat=chat))
    assert one["done"] and one["token_ids"] == two["token_ids"]
    assert two["usage"]["cached_tokens"] == two["usage"]["prompt_tokens"] - 1  # the same prompt, reused whole


# -- the stats table --------------------------------------------------------------------------------


def documented_stats():
    """docs/serve.md's `stats` table: [(key, unit, meaning)] in its order."""
    text = DOCS.read_text()
    table = text.split("| `stats` key | unit | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.strip().splitlines()[1:]]
    return [(key.strip("| `"), unit, meaning.rstrip(" |")) for key, unit, meaning in rows]


def test_the_documented_stats_are_the_keys_a_reply_carries(loop_model):
    documented = documented_stats()
    keys = [key for key, _, _ in documented]
    only_sometimes = {key for key, _, meaning in documented if meaning.startswith("only ")}
    assert only_sometimes == {"controller", "approximate", "pipeline"}
    script = [({"id": 1, "prompt": LOOP, "suffix_draft": 3}, 0), ({"id": 2, "prompt": LOOP, "suffix_draft": "auto"}, 0)]
    plain, auto = (f["stats"] for f in finals(run_script(loop_model, script)))
    assert list(plain) == [k for k in keys if k not in only_sometimes]
    assert list(auto) == [k for k in keys if k not in ("approximate", "pipeline")]
    assert set(keys) == {*FIELDS, "experts", "ttft_ms", "notes"}  # telemetry's figures, all of them
    for key, unit, meaning in documented:
        assert meaning, key
        if key in FIELDS:  # the unit telemetry gives it, as JSON carries it (shares as fractions)
            expected = {"%": "fraction"}.get(FIELDS[key][1], FIELDS[key][1])
            assert unit == expected or (not expected and unit in ("count", "integer", "object", "boolean", "list")), key
