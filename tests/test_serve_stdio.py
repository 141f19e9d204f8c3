"""`strata serve-stdio` through a real subprocess: a scripted conversation, prefix reuse and
sessions against cold runs, the cross-request suffix cache, signals, the stdout guard, and a
fuzz run of hostile lines."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from strata_cli.runtime import embedded_model_path

SERVE = [sys.executable, "-m", "strata_cli.cli", "serve-stdio"]
TIMEOUT = 180

# ~150 tokens of code: with --checkpoint-every 64 the prompts cross two aligned checkpoints.
LONG = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(10))
EVERY = ["--checkpoint-every", "64"]

# id -> request; run cold (no prefix cache) once, then compared against every other mode.
REQUESTS = {
    "short": {"prompt": "def fibonacci(n):", "max_tokens": 8},
    "short-again": {"prompt": "def fibonacci(n):", "max_tokens": 8},
    "long-a": {"prompt": LONG + "def g(a, b):", "max_tokens": 6},
    "long-b": {"prompt": LONG + "class Foo:", "max_tokens": 6},
    "long-c": {"prompt": LONG + "class Foo(Bar):", "max_tokens": 6, "suffix_draft": 3},
    "long-d": {"prompt": LONG + "import os", "max_tokens": 6},
    "short-fork": {"prompt": "def fibonacci(n, memo):", "max_tokens": 8},
    "drafted": {"prompt": "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", "max_tokens": 10, "suffix_draft": 3},
}


def env():
    return {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_RAISE_ERRORS": ""}


def lines_of(requests):
    return b"".join(json.dumps({"id": rid, **body}).encode() + b"\n" for rid, body in requests.items())


def serve(stdin: bytes, *args, cwd=None):
    """Run the server over `stdin`; every stdout line must be a JSON object, the first the ready
    frame (returned are the frames after it)."""
    proc = subprocess.run([*SERVE, *args], input=stdin, capture_output=True, timeout=TIMEOUT, env=env(), cwd=cwd)
    frames = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
    assert all(isinstance(f, dict) for f in frames)
    assert not frames or frames[0].get("ready") is True, frames[:1]
    assert not any(f.get("ready") for f in frames[1:])
    return proc.returncode, frames[1:], proc.stderr.decode("utf-8", "replace")


def finals(frames):
    """Terminal frames (done or error), in order."""
    return [f for f in frames if f.get("done") or "error" in f]


def by_id(frames):
    return {f["id"]: f for f in finals(frames)}


@pytest.fixture(scope="module")
def cold():
    """Every request of REQUESTS answered with no prefix reuse: the reference token ids."""
    rc, frames, err = serve(lines_of(REQUESTS), "--prefix-cache", "0")
    assert rc == 0, err
    done = by_id(frames)
    assert all(done[rid]["usage"]["cached_tokens"] == 0 for rid in REQUESTS)
    return {rid: done[rid]["token_ids"] for rid in REQUESTS}


def chat_model(tmp_path) -> Path:
    """The demo model with a chat template added."""
    src, dst = embedded_model_path(), tmp_path / "chat-model"
    if dst.is_dir():
        return dst
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_scripted_conversation(tmp_path):
    """Streams, stop strings, chat messages, errors in between, and EOF with requests queued."""
    first = {"id": 1, "prompt": "def parse(line):", "max_tokens": 12}
    rc, frames, err = serve(lines_of({1: first}), "--model", str(chat_model(tmp_path)))
    assert rc == 0, err
    text1 = frames[-1]["text"]
    # A stop string that spans two streamed deltas, so streaming must hold its first part back.
    pieces = [f["delta"] for f in frames if "delta" in f]
    k = next(i for i in range(1, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[k][-1] + pieces[k + 1][:2]
    script = [
        first,
        {"id": 2, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
        # The rendered template as a prompt: `messages` are never healed, so neither is this one.
        {"id": 3, "prompt": "<|user|>\nhello\n<|assistant|>\n", "max_tokens": 5, "stream": False, "heal": False},
        "garbage",
        {"id": 4, "prompt": "def parse(line):", "max_tokens": 12, "stop": [stop, "\u0000never"]},
        {"id": 5, "prompt": "def parse(line):" + text1 + "\n", "max_tokens": 4, "temperature": 0.7, "seed": 11},
        {"id": 6, "prompt": "def parse(line):" + text1 + "\n", "max_tokens": 4, "temperature": 0.7, "seed": 11},
    ]
    stdin = b"".join((s if isinstance(s, str) else json.dumps(s)).encode() + b"\n" for s in script)
    rc, frames, err = serve(stdin, "--model", str(chat_model(tmp_path)), "-v")
    assert rc == 0, err
    ends = finals(frames)
    assert [f["id"] for f in ends] == [1, 2, 3, None, 4, 5, 6]  # answered in order, EOF waited for all
    for f in ends:
        if f.get("done"):
            deltas = "".join(d["delta"] for d in frames if d.get("id") == f["id"] and "delta" in d)
            assert deltas == ("" if f["id"] == 3 else f["text"])  # stream: false sends no deltas
    done = {f["id"]: f for f in ends}
    assert done[1]["text"] == text1 and done[1]["finish_reason"] == "length"
    assert done[2]["token_ids"] == done[3]["token_ids"]  # the template rendered as expected
    assert ends[3]["error"]["code"] == "parse_error"
    assert done[4]["text"] == text1[: text1.index(stop)] and done[4]["finish_reason"] == "stop"
    assert not any(stop in d.get("delta", "") for d in frames if d.get("id") == 4)
    assert done[5]["token_ids"] == done[6]["token_ids"]  # same seed, same sample
    assert done[5]["usage"]["cached_tokens"] > 0 and done[6]["usage"]["cached_tokens"] == done[6]["usage"]["prompt_tokens"] - 1
    assert set(done[1]["usage"]) == {"prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens"}
    assert done[1]["stats"]["ttft_ms"] > 0 and "tokens_per_s" in done[1]["stats"]
    assert "request 1" in err  # -v logs every request on stderr


def test_prefix_reuse_matches_cold(cold):
    rc, frames, err = serve(lines_of(REQUESTS), *EVERY)
    assert rc == 0, err
    done = by_id(frames)
    assert {rid: done[rid]["token_ids"] for rid in REQUESTS} == cold
    cached = {rid: done[rid]["usage"]["cached_tokens"] for rid in REQUESTS}
    assert cached["short"] == 0
    assert cached["short-again"] == done["short-again"]["usage"]["prompt_tokens"] - 1  # whole prompt reused
    assert cached["long-b"] >= 64 and cached["long-b"] % 64 == 0  # an aligned prefill checkpoint of long-a
    assert cached["long-c"] > cached["long-b"]  # long-b's prompt checkpoint
    assert cached["long-d"] > cached["long-b"]  # the divergence point long-b planted (where it left long-a)
    assert 0 < cached["short-fork"] < done["short-fork"]["usage"]["prompt_tokens"] - 1
    # A continuation resumes from the end-of-generation checkpoint, and matches a cold run of it.
    # The healed one ends in " re" instead of the reply's last token, which healing backs up over
    # (some token extends " re", whatever the model wrote): its prompt then stops one token
    # before that checkpoint, so it reuses less (the prompt's checkpoint) and still matches cold.
    follow = {"prompt": REQUESTS["short"]["prompt"] + done["short"]["text"], "max_tokens": 6, "heal": False}
    tokenizer = Tokenizer.from_file(str(embedded_model_path() / "tokenizer.json"))
    reply_less_last = tokenizer.decode(cold["short"][:-1])
    healed = {"prompt": REQUESTS["short"]["prompt"] + reply_less_last + " re", "max_tokens": 6, "heal": True}
    both = {"warm": REQUESTS["short"], "follow": follow, "warm-again": REQUESTS["short"], "healed": healed}
    rc, warm_frames, err = serve(lines_of(both))
    rc_cold, cold_frames, _ = serve(lines_of({"follow": follow, "healed": healed}), "--prefix-cache", "0")
    assert rc == rc_cold == 0, err
    warm = by_id(warm_frames)
    for rid in ("follow", "healed"):
        assert warm[rid]["token_ids"] == by_id(cold_frames)[rid]["token_ids"], rid
    assert warm["follow"]["usage"]["cached_tokens"] > len(cold["short"])
    assert warm["healed"]["stats"]["healed_tokens"] >= 1
    assert 0 < warm["healed"]["usage"]["cached_tokens"] < warm["follow"]["usage"]["cached_tokens"]


def test_session_resumes_and_matches_cold(cold, tmp_path):
    session = tmp_path / "chat.session"
    rc, frames, err = serve(lines_of({"long-a": REQUESTS["long-a"]}), "--session", str(session), *EVERY)
    assert rc == 0 and session.is_file(), err
    rc, frames, err = serve(lines_of({"long-b": REQUESTS["long-b"], "long-a": REQUESTS["long-a"]}),
                            "--session", str(session), *EVERY)
    assert rc == 0, err
    done = by_id(frames)
    assert done["long-b"]["token_ids"] == cold["long-b"] and done["long-a"]["token_ids"] == cold["long-a"]
    assert done["long-b"]["usage"]["cached_tokens"] >= 64  # from the session's checkpoints
    assert "restored" in err

    flipped = bytearray(session.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    session.write_bytes(bytes(flipped))
    rc, frames, err = serve(lines_of({"x": REQUESTS["short"]}), "--session", str(session))
    assert rc == 1 and frames == [] and "checksum mismatch" in err and "did not start" in err

    other = chat_model(tmp_path)  # same weights, another config.json: another model
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    session2 = tmp_path / "other.session"
    assert serve(lines_of({"a": REQUESTS["short"]}), "--session", str(session2))[0] == 0
    rc, frames, err = serve(lines_of({"b": REQUESTS["short"]}), "--session", str(session2), "--model", str(other))
    assert rc == 1 and frames == [] and "another model" in err


def test_suffix_cache_drafts_from_earlier_outputs(cold):
    repeat = {"a": REQUESTS["short"], "b": REQUESTS["short"]}
    args = ["--suffix-cache", "4096", "--suffix-draft", "3", "--prefix-cache", "0"]
    rc, frames, err = serve(lines_of(repeat), *args)
    assert rc == 0, err
    done = by_id(frames)
    assert done["a"]["token_ids"] == done["b"]["token_ids"] == cold["short"]
    assert done["a"]["stats"]["drafts_offered_global"] == 0
    assert done["b"]["stats"]["drafts_kept_global"] > 0


def wait_for(stream, predicate, deadline):
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            return None
        if predicate(line):
            return line
    return None


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_cancels_the_request_in_flight(signum, status, tmp_path):
    session = tmp_path / "s.session"
    proc = subprocess.Popen([*SERVE, "--session", str(session)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env())
    try:
        proc.stdin.write(json.dumps({"id": "long", "prompt": "import os", "max_tokens": 4000}).encode() + b"\n")
        proc.stdin.flush()
        assert wait_for(proc.stdout, lambda line: b'"delta"' in line, time.monotonic() + 60)
        proc.send_signal(signum)
        rest = proc.stdout.read().decode().splitlines()
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    frames = [json.loads(line) for line in rest]
    assert frames[-1]["done"] and frames[-1]["finish_reason"] == "cancelled"
    assert 0 < frames[-1]["usage"]["completion_tokens"] < 4000
    assert rc == status
    assert session.is_file()  # saved on the way out


def test_signal_while_idle_exits_without_frames():
    proc = subprocess.Popen(SERVE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    try:
        ready = wait_for(proc.stdout, lambda line: True, time.monotonic() + 60)
        proc.send_signal(signal.SIGTERM)
        out = proc.stdout.read()  # stdin stays open: a signal, not EOF, ends it
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert json.loads(ready)["ready"] is True
    assert proc.returncode == 143 and out == b""  # nothing after the ready frame


def test_stray_prints_never_reach_stdout():
    """Python prints and raw writes to fd 1 during a request land on stderr."""
    code = (
        "import os, sys\n"
        "import strata_cli.tokenizer as t\n"
        "encode = t.Tokenizer.encode\n"
        "def noisy(self, text):\n"
        "    print('STRAY-PRINT'); os.write(1, b'STRAY-FD\\n')\n"
        "    return encode(self, text)\n"
        "t.Tokenizer.encode = noisy\n"
        "from strata_cli.cli import main\n"
        "sys.argv = ['strata', 'serve-stdio']\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], input=lines_of({"q": REQUESTS["short"]}),
                          capture_output=True, timeout=TIMEOUT, env=env())
    assert proc.returncode == 0
    frames = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert frames[-1]["id"] == "q" and frames[-1]["done"]
    assert b"STRAY-PRINT" in proc.stderr and b"STRAY-FD" in proc.stderr


# -- fuzz ------------------------------------------------------------------------------------------


def hostile_lines(rng):
    """`rng`: a random.Random. (line, expected error code or None for no reply) for >= 1,000 malformed or hostile lines."""
    good = {"prompt": "x", "max_tokens": 2}
    cases = []

    def add(line, code):
        cases.append((line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass"), code))

    wrong_types = {
        "prompt": [1, 1.5, True, [], {}, ["x"]],
        "max_tokens": ["5", 5.0, True, [], {}, None],
        "temperature": ["0", True, [], {}],
        "seed": [1.5, "1", False, [1]],
        "suffix_draft": [1.5, True, [], {}, "seven", None],
        "stop": [5, [1], [None], {}, True, ["a"] * 17],
        "stream": ["yes", 1, None, []],
        "messages": ["hi", [], [1], [{"role": 1, "content": "x"}], [{"role": "user"}], {"a": 1},
                     [{"role": "user", "content": "x", "extra": 1}]],
        "id": [{}, [], 1.5, True, "x" * 300, 2**64],
    }
    for field, values in wrong_types.items():
        for value in values:
            body = {**good, field: value}
            if field == "messages":
                body.pop("prompt")
            code = "invalid_request"
            if field == "suffix_draft" and value in ("seven",):
                code = "out_of_range"
            if field == "stop" and value == [None]:
                code = "invalid_request"
            add(json.dumps(body), code)
    out_of_range = [("max_tokens", 0), ("max_tokens", -5), ("seed", -1), ("seed", 2**63), ("seed", 10**4000),
                    ("temperature", -0.1), ("suffix_draft", 8), ("suffix_draft", -1), ("suffix_draft", "auto:0"),
                    ("stop", ["x" * 257]), ("stop", [""])]
    for field, value in out_of_range:
        add(json.dumps({**good, field: value}), "out_of_range")
    for token in ("NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" + "0" * 5000):
        for field in ("max_tokens", "temperature", "seed", "id"):
            add('{"prompt": "x", "%s": %s}' % (field, token), "parse_error")
    add('{"prompt": "x", "seed": 1, "seed": 2}', "parse_error")
    add('{"prompt": "\\ud800"}', "invalid_request")
    add('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "invalid_request")
    add('{"prompt": "x", "foo": 1, "bar": 2}', "invalid_request")
    add('{"messages": [{"role": "user", "content": "y"}], "max_tokens": 2}', "no_chat_template")
    add('{"id": "big", "prompt": "%s", "max_tokens": 2}' % ("word " * 6000), "prompt_too_long")
    for value in ("[]", '"str"', "1", "null", "true", "[1, 2]"):
        add(value, "invalid_request")
    add("[" * 100_000, "parse_error")
    add('{"a":' * 50_000, "parse_error")
    add('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "parse_error")
    add('{"prompt": ' + "[" * 500 + "]" * 500 + "}", "invalid_request")
    add('{"prompt": null}', "invalid_request")
    add(b'\xef\xbb\xbf{"prompt": "x"}', "parse_error")  # a byte-order mark is not JSON
    add(b'{"prompt": "a\x00b"}', "parse_error")
    add(b'{"id": 1, "prompt": "\xff\xfe"}', "invalid_utf8")
    add(b"x" * (10 * 1024 * 1024), "line_too_long")
    add(b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}', "line_too_long")
    add(b"\xff" * (10 * 1024 * 1024 + 1), "line_too_long")
    for blank in ("", "   ", "\t", "\r"):
        add(blank, None)
    base = json.dumps({"id": "t", "prompt": "def f(x):", "max_tokens": 3, "stop": ["a"]})
    while len(cases) < 1100:
        kind = rng.randrange(4)
        if kind == 0:  # truncated JSON
            add(base[: rng.randrange(1, len(base) - 1)], "parse_error")
        elif kind == 1:  # random bytes, some invalid UTF-8
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b"")
            if raw.strip():
                add(raw, None)  # the code depends on the bytes; any error will do
        elif kind == 2:  # random printable junk
            add("".join(rng.choice('{}[]":,0123456789abcnul tre-.eE\\') for _ in range(rng.randrange(1, 60))), None)
        else:  # a valid request with one unknown field
            add(json.dumps({"prompt": "x", f"f{rng.randrange(10**6)}": rng.random()}), "invalid_request")
    return cases


def test_fuzz_hostile_lines_never_kill_the_server(cold):
    rng = random.Random(1234)
    cases = hostile_lines(rng)
    good_ids = list(REQUESTS)
    stdin, expected = bytearray(), []
    for i, (line, code) in enumerate(cases):
        stdin += line + b"\n"
        if line.strip():
            expected.append(("error", code))
        if i % 90 == 45:  # interleave every good request
            rid = good_ids[(i // 90) % len(good_ids)]
            stdin += json.dumps({"id": rid, **REQUESTS[rid]}).encode() + b"\n"
            expected.append(("done", rid))
    assert len(cases) >= 1000 and sum(kind == "done" for kind, _ in expected) >= len(good_ids)
    rc, frames, err = serve(bytes(stdin))
    assert rc == 0, err[-2000:]
    ends = finals(frames)
    assert len(ends) == len(expected)
    for frame, (kind, what) in zip(ends, expected):
        if kind == "done":
            assert frame.get("done") and frame["id"] == what and frame["token_ids"] == cold[what], frame
        else:
            assert "error" in frame, frame
            assert set(frame["error"]) == {"code", "message"} and frame["error"]["message"]
            if what is not None:
                assert frame["error"]["code"] == what, frame
    assert "internal_error" not in {f["error"]["code"] for f in ends if "error" in f}
