"""`strata serve` through a real subprocess on loopback, driven by the official `openai` client:
completions and chat, streamed and not, usage, stop strings, seeds, greedy text equal to
`strata generate`'s, OpenAI error objects (the server serving on after them), /metrics as
Prometheus text, a client gone mid-stream, the queue bound, concurrent clients, the API key,
SIGTERM's drain, and --session (saved at exit, restored at start, a corrupt file refused)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata_cli.options import GenerateOptions, ServeOptions, SpecOptions
from strata_cli.runtime import embedded_model_path
from strata_cli.serve.http import END, Job, Worker

STRATA = [sys.executable, "-m", "strata_cli.cli"]
START_SECONDS = 120
REQUEST_SECONDS = 60
CONTEXT = 512  # --max-context: a prompt past it is refused
PROMPT = "def fibonacci(n):"
LONG = 400  # tokens of a request meant to be cut short (about 6 s on a 2-core CPU)


def env(cache: Path) -> dict:
    """The developer's shell sets no option; the cost curve `auto` measures is cached per module."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    return {**clean, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(cache), "STRATA_HOME": str(cache / "home")}


def chat_model(root: Path) -> Path:
    """The demo model with a chat template added (the demo checkpoint has none)."""
    src, dst = embedded_model_path(), root / "chat-model"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


class Served:
    """A `strata serve --port 0` subprocess and its address (read from its log line)."""

    def __init__(self, cache: Path, *args: str):
        self.proc = subprocess.Popen([*STRATA, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env(cache), text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError(f"strata serve exited: {''.join(self.log)}")
            self.log.append(line)
            if "listening on http://" in line:
                self.base = line.split("listening on ", 1)[1].split()[0]  # http://127.0.0.1:PORT/v1
                break
        else:
            raise AssertionError("strata serve did not start in time")
        self.port = int(self.base.rsplit(":", 1)[1].split("/")[0])
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             timeout=REQUEST_SECONDS, **kwargs)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def open_stream(self, body: dict) -> socket.socket:
        """Start a streamed completion on a raw socket and read up to its first event."""
        payload = json.dumps({**body, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=REQUEST_SECONDS)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        return sock

    def health(self) -> dict:
        return json.loads(self.get("/health")[2])

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name and labels (`name{k=v,...}`)."""
        status, headers, body = self.get("/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=REQUEST_SECONDS)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def served(cache):
    """One server for the module: a chat template, a small context, room for one waiting request."""
    server = Served(cache, "--model", str(chat_model(cache)), "--max-context", str(CONTEXT), "--max-queue", "1")
    yield server
    assert server.stop() == 0, "".join(server.log)


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def generated(cache: Path, prompt: str, *args: str) -> dict:
    """`strata generate --json`'s record for one prompt."""
    proc = subprocess.run([*STRATA, "generate", "--json", *args, prompt], capture_output=True, text=True, check=False,
                          env=env(cache), timeout=START_SECONDS)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_greedy_text_equals_generate_and_streams_concatenate(served, client, cache):
    """The server drafts with `auto` and a suffix cache by default; greedy text is still generate's."""
    reference = generated(cache, PROMPT, "-n", "24")
    done = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=24)
    assert done.choices[0].text == reference["text"]
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 24 == len(reference["token_ids"])
    assert done.usage.prompt_tokens + done.usage.completion_tokens == done.usage.total_tokens
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=24, stream=True, model="chat-model",
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt: its checkpoint


def test_chat_completions_streamed_and_not(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "hello"}]
    done = client.chat.completions.create(model="chat-model", messages=messages, max_tokens=10)
    message = done.choices[0].message
    assert message.role == "assistant" and message.content
    assert done.object == "chat.completion" and done.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model="chat-model", messages=messages, max_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    assert client.chat.completions.create(model="chat-model", messages=[messages[0], *parts],
                                          max_tokens=10).choices[0].message.content == message.content


def test_stop_strings_and_seeds(client):
    text = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=24).choices[0].text
    stop = text[8:11]
    cut = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=24, stop=[stop, "\u0000never"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text

    def sampled(seed, **extra):
        return client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=16, temperature=0.9,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 40, **extra})

    first = sampled(7).choices[0].text
    assert sampled(7).choices[0].text == first
    assert sampled(7, suffix_draft=0).choices[0].text == first  # drafts never change sampled text either


def test_errors_are_openai_error_objects_and_the_server_goes_on(served, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="chat-model", prompt=PROMPT, temperature="hot")
    assert bad.value.code == "invalid_request" and "'temperature' must be a number" in bad.value.message
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="chat-model", prompt="x = 1\n" * CONTEXT, max_tokens=4)
    assert long.value.code == "context_length_exceeded" and f"holds {CONTEXT}" in long.value.message
    for body, code in [({"n": 2}, "out_of_range"), ({"logprobs": 3}, "unsupported_field"),
                       ({"max_tokens": 0}, "out_of_range"), ({"top_p": 0.5}, "out_of_range"),
                       ({"stream_options": {"include_usage": True}}, "invalid_request"),
                       ({"min_match": 2}, "out_of_range"), ({"prompt": [1, 2, 3]}, "invalid_request")]:
        status, _, reply = served.post("/v1/completions", {"prompt": PROMPT, **body})
        assert status == 400 and reply["error"]["code"] == code, (body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}
    status, _, reply = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "user": "me",
                                                       "frobnicate": {"x": 1}, "logprobs": None})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3  # unknown fields are ignored
    status, _, body = served.get("/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    [model] = client.models.list().data
    assert model.id == "chat-model" and served.health()["status"] == "ok"
    assert client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_metrics_parse_and_move(served, client):
    before = served.metrics()
    client.completions.create(model="chat-model", prompt="import os\n", max_tokens=6)
    client.completions.create(model="chat-model", prompt="import os\n", max_tokens=6)  # its prefix is held
    after = served.metrics()

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    assert moved("strata_http_requests_total{endpoint=/v1/completions,status=200}") == 2
    assert moved("strata_completion_tokens_total") == 12
    assert moved("strata_time_to_first_token_seconds_count") == 2
    assert moved("strata_window_seconds_count") >= 4
    assert moved("strata_prefix_cache_hits_total") >= 1
    assert moved("strata_windows_total") >= 6
    assert after["strata_queued_requests"] == 0
    for name in ("strata_drafts_offered_total", "strata_drafts_kept_total", "strata_expert_cache_hits_total",
                 "strata_expert_cache_misses_total", "strata_suffix_cache_drafts_offered_total"):
        assert name in after


def test_a_client_gone_mid_stream_frees_the_engine(served, client):
    before = served.metrics()
    sock = served.open_stream({"prompt": PROMPT, "max_tokens": LONG, "suffix_draft": 0})
    sock.close()
    start = time.monotonic()
    done = client.completions.create(model="chat-model", prompt="import sys\n", max_tokens=4)
    assert done.usage.completion_tokens == 4 and time.monotonic() - start < 3  # the long one took ~6 s
    after = served.metrics()
    assert after["strata_requests_client_gone_total"] - before.get("strata_requests_client_gone_total", 0) == 1
    gone = "strata_requests_finished_total{finish_reason=cancelled}"
    assert after[gone] - before.get(gone, 0) == 1


def test_the_queue_is_bounded(served, client):
    running = served.open_stream({"prompt": PROMPT, "max_tokens": LONG, "suffix_draft": 0})
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(
        reply=client.completions.create(model="chat-model", prompt="import re\n", max_tokens=4)))
    thread.start()
    deadline = time.monotonic() + 10
    while served.health()["queued"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, headers, reply = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 503 and reply["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
    running.close()
    thread.join(REQUEST_SECONDS)
    assert waiting["reply"].usage.completion_tokens == 4


def test_concurrent_clients_get_their_own_answers(cache):
    """4 clients × 3 requests at once, completions and chat, streamed and not, through a queue
    that holds them all: each answer is the one its prompt gets alone, and the server stays
    healthy. A server of its own: the module's queue holds one request."""
    root = cache / "concurrent"
    root.mkdir()
    server = Served(cache, "--model", str(chat_model(root)), "--max-queue", "4", "--max-tokens", "12")
    try:
        client = server.client()
        prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "The quick brown fox"]

        def answer(kind: str, prompt: str, stream: bool) -> str:
            if kind == "chat":
                reply = client.chat.completions.create(model="chat-model", messages=[{"role": "user", "content": prompt}],
                                                       stream=stream)
                return "".join(c.choices[0].delta.content or "" for c in reply) if stream \
                    else reply.choices[0].message.content
            reply = client.completions.create(model="chat-model", prompt=prompt, stream=stream)
            return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

        alone = {(kind, p): answer(kind, p, stream=False) for kind in ("completion", "chat") for p in prompts}
        assert len(set(alone.values())) > 1  # the prompts' answers differ, so a mix-up would show
        start = threading.Barrier(4, timeout=REQUEST_SECONDS)
        got: list[tuple[tuple[str, str], str]] = []
        failures: list[BaseException] = []

        def one_client(t: int) -> None:
            try:
                start.wait()
                for j in range(3):
                    kind, prompt = ("completion", "chat")[(t + j) % 2], prompts[(t + 2 * j) % len(prompts)]
                    got.append(((kind, prompt), answer(kind, prompt, stream=(t + j) % 3 != 0)))
            except BaseException as e:  # noqa: BLE001 - reported below, on the test's thread
                failures.append(e)

        threads = [threading.Thread(target=one_client, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_SECONDS)
        assert not failures and not any(t.is_alive() for t in threads), failures
        assert len(got) == 12
        for key, text in got:
            assert text == alone[key], key
        health = server.health()
        assert health["status"] == "ok" and health["queued"] == 0 and health["running"] is False
        samples = server.metrics()
        assert not [k for k, v in samples.items() if k.startswith("strata_http_requests_total{") and v
                    and not k.endswith("status=200}")]  # not one error, 503 included
        assert samples["strata_queued_requests"] == 0 and samples["strata_running_requests"] == 0
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)


def test_a_client_with_its_answer_sees_the_worker_free():
    """The done frame reaches the client only after the worker has let the job go, so /health
    polled right after an answer never says a request is running (the worker lingers here)."""
    runtime = SimpleNamespace(engine=None, tokenizer=None, spec_for=lambda spec: spec)
    worker = Worker(runtime, chat=None, serve_options=ServeOptions(), defaults=GenerateOptions(),
                    spec=SpecOptions(), max_queue=1)
    done = {"done": True, "finish_reason": "length", "stats": {},
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}}

    def handle(line: bytes) -> None:
        worker._deliver({"delta": "x"})
        worker._deliver(done)
        time.sleep(0.3)  # what remains of `Server.handle` after its done frame

    worker.server.handle = handle

    async def client() -> list:
        job = Job(b"{}", stream=True, min_match=None, deadline=None)
        thread = threading.Thread(target=worker._answer, args=(job,))
        thread.start()
        seen = []
        while (frame := await job.frames.get()) is not END:
            seen.append((frame, worker.current is None))
        await asyncio.to_thread(thread.join)
        return seen

    seen = asyncio.run(client())
    assert [f for f, _ in seen] == [{"delta": "x"}, done]
    assert seen[-1][1], "the done frame came while the worker still held the job"


def test_api_key_and_sigterm_drain(cache):
    """A second server: with a key nothing under /v1 answers without it; SIGTERM answers the
    request running and the one waiting, then exits 0."""
    server = Served(cache, "--api-key", "sekret", "--suffix-draft", "0", "--max-tokens", "8")
    try:
        assert server.get("/v1/models")[0] == 401 and server.get("/metrics")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        keyed = server.client(api_key="sekret")
        assert keyed.models.list().data[0].id == "demo" and server.health()["status"] == "ok"
        replies: list = []

        def ask(prompt, max_tokens):
            replies.append(keyed.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens))

        threads = [threading.Thread(target=ask, args=(PROMPT, 60)), threading.Thread(target=ask, args=("import os", 8))]
        for t in threads:
            t.start()
            time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(REQUEST_SECONDS)
        assert sorted(r.usage.completion_tokens for r in replies) == [8, 60]
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)


def refused(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """`strata serve` that must not start: its exit status and output."""
    return subprocess.run([*STRATA, "serve", "--port", "0", *args], capture_output=True, text=True, check=False,
                          env=env(cache), timeout=START_SECONDS)


def test_a_session_is_saved_at_exit_and_restored_at_start(cache, tmp_path):
    """--session: the first server saves its checkpoints (0600) on SIGTERM; a second one restores
    them, so the same prompt's reply counts cached tokens at once; a corrupt file refuses start."""
    session = tmp_path / "agent.session"
    first = Served(cache, "--session", str(session), "--max-tokens", "8")
    try:
        done = first.client().completions.create(model="demo", prompt=PROMPT)
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens_details.cached_tokens == 0
        assert first.stop() == 0, "".join(first.log)
    finally:
        first.stop(signal.SIGKILL)
    assert session.is_file() and session.stat().st_mode & 0o777 == 0o600, "".join(first.log)
    assert any("saved" in line for line in first.log), "".join(first.log)

    second = Served(cache, "--session", str(session), "--max-tokens", "8")
    try:
        assert any("restored" in line for line in second.log), "".join(second.log)
        again = second.client().completions.create(model="demo", prompt=PROMPT)
        assert again.choices[0].text == done.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # from the session's checkpoints
        assert second.stop() == 0, "".join(second.log)
    finally:
        second.stop(signal.SIGKILL)

    flipped = bytearray(session.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    session.write_bytes(bytes(flipped))
    proc = refused(cache, "--session", str(session))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert len(lines) == 1 and str(session) in lines[0] and "strata serve did not start" in lines[0], proc.stderr


def test_a_forged_session_refuses_start_with_one_line(cache, tmp_path):
    forged = tmp_path / "forged.session"
    forged.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      not a session")
    proc = refused(cache, "--session", str(forged))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert len(lines) == 1 and str(forged) in lines[0] and "strata serve did not start" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    missing = tmp_path / "nowhere" / "s.session"
    proc = refused(cache, "--session", str(missing))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: session {missing}: directory {missing.parent} does not exist"], proc.stderr


def test_without_the_serve_extra_it_says_what_to_install():
    code = "import sys; sys.modules['starlette'] = None; from strata_cli.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "serve"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr == "Error: strata serve needs the 'serve' extra (starlette is missing): " \
                          "pip install 'strata-cli[serve]'\n"
