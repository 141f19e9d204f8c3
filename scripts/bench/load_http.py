"""Load test of `strata serve`: N requests from C concurrent clients on loopback, a mix of
completions and chat, streamed and not; latency, time to first token, throughput and errors.

    python -m scripts.bench.load_http --requests 200 --clients 8 --out docs/runs/http_load_cpu.json
    python -m scripts.bench.load_http --base-url http://127.0.0.1:8080/v1   # a server already running

Without `--base-url` it starts `strata serve --port 0` on 127.0.0.1 (the demo model by default,
with a minimal chat template added in a temporary directory, as tests/test_serve_http.py does,
since the demo checkpoint has none) with `--max-queue` (default 4, so that 8 clients overflow
it and the bounded queue's 503 path is exercised) and the server's other defaults (`auto`
drafts, prefix and suffix caches), and stops it with SIGTERM at the end.

Every client is a thread with its own `openai.OpenAI` (no retries). Request i is, in turn, a
completion, a streamed completion, a chat completion and a streamed chat completion, of one of
a few short prompts, greedy, with max_tokens 16, 32 or 48. A 503 is counted and the client
waits its Retry-After (at most 5 s) before its next request; it is not retried. Bounded: at
most `--requests` requests, none started after `--time-limit` seconds, each with a
`--request-timeout`.

Reported: latency (send to the answer's end) and, for streamed requests, time to first token
(send to the first text) as the client sees them, queue wait included, p50 and p95; the
server's own `stats.ttft_ms` (taking the request to its first token, no queue wait); throughput
(answered requests and completion tokens per second of the run's wall time); answers by status;
what /metrics moved during the run; /health afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

KINDS = ("completion", "completion-stream", "chat", "chat-stream")
PROMPTS = (
    "def fibonacci(n):",
    "import json\n\n\ndef load(path):",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
    "def parse_line(line: str) -> dict:\n    \"\"\"Parse one 'key = value' line.\"\"\"",
)
MAX_TOKENS = (16, 32, 48)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
METRICS_MOVED = ("strata_completion_tokens_total", "strata_prompt_tokens_total", "strata_prefix_cache_hits_total",
                 "strata_prefix_cache_misses_total", "strata_drafts_offered_total", "strata_drafts_kept_total",
                 "strata_suffix_cache_drafts_offered_total", "strata_suffix_cache_drafts_kept_total",
                 "strata_windows_total", "strata_requests_client_gone_total")
START_SECONDS = 120


def tree() -> str:
    """`git rev-parse --short HEAD`, plus '+dirty' when the work tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average": load}


def demo_with_chat_template(root: Path) -> Path:
    """The embedded demo model with a minimal chat template (the demo checkpoint has none)."""
    from strata_cli.runtime import embedded_model_path

    src, dst = embedded_model_path(), root / "demo-chat"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


class Server:
    """A `strata serve --port 0` subprocess on 127.0.0.1; its base URL from its log line."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_cli.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + START_SECONDS
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("strata serve exited: " + "".join(self.log))
            self.log.append(line)
            if "listening on http://" in line:
                self.base_url = line.split("listening on ", 1)[1].split()[0]
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("strata serve did not start in time")
        self.model = line.split("(model ", 1)[1].split(",", 1)[0].strip("'\"")
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()  # keep stderr drained

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def get(base_url: str, path: str, api_key: str) -> bytes:
    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(root + path, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.read()


def metrics(base_url: str, api_key: str) -> dict[str, float]:
    """The unlabelled samples and the labelled sums of /metrics, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(get(base_url, "/metrics", api_key).decode()):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
            if s.labels:
                key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                samples[key] = s.value
    return samples


@dataclass
class Result:
    index: int
    kind: str
    prompt: int
    max_tokens: int
    status: int | str  # the HTTP status, or "connection" / "timeout" / "other"
    latency_s: float
    ttft_s: float | None = None  # streamed only: send to the first text
    server_ttft_ms: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    started_s: float = 0.0  # since the run began


@dataclass
class Plan:
    total: int
    deadline: float
    counter: itertools.count = field(default_factory=itertools.count)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self) -> int | None:
        with self.lock:
            i = next(self.counter)
        return i if i < self.total and time.monotonic() < self.deadline else None


def ask(client: openai.OpenAI, model: str, i: int, t0: float) -> tuple[Result, float]:
    """Request i of the mix; returns its result and the seconds to wait before the next one."""
    kind, prompt, max_tokens = KINDS[i % len(KINDS)], (i // len(KINDS)) % len(PROMPTS), MAX_TOKENS[i % len(MAX_TOKENS)]
    result = Result(i, kind, prompt, max_tokens, status=0, latency_s=0.0)
    text = PROMPTS[prompt]
    wait = 0.0
    start = time.perf_counter()
    result.started_s = start - t0
    try:
        if kind == "completion":
            reply = client.completions.create(model=model, prompt=text, max_tokens=max_tokens)
            result.completion_tokens, result.finish_reason = reply.usage.completion_tokens, reply.choices[0].finish_reason
            result.server_ttft_ms = (reply.model_extra or {}).get("strata", {}).get("stats", {}).get("ttft_ms")
        elif kind == "chat":
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                   max_tokens=max_tokens)
            result.completion_tokens, result.finish_reason = reply.usage.completion_tokens, reply.choices[0].finish_reason
            result.server_ttft_ms = (reply.model_extra or {}).get("strata", {}).get("stats", {}).get("ttft_ms")
        else:
            common = {"model": model, "max_tokens": max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}}
            if kind == "completion-stream":
                chunks = client.completions.create(prompt=text, **common)
            else:
                chunks = client.chat.completions.create(messages=[{"role": "user", "content": text}], **common)
            for chunk in chunks:
                if chunk.choices:
                    choice = chunk.choices[0]
                    piece = choice.text if kind == "completion-stream" else choice.delta.content
                    if piece and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.finish_reason = choice.finish_reason or result.finish_reason
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
                    result.server_ttft_ms = (chunk.model_extra or {}).get("strata", {}).get("stats", {}).get("ttft_ms")
        result.status = 200
    except openai.APIStatusError as e:
        result.status, result.error = e.status_code, str(e)[:200]
        if e.status_code == 503:
            try:
                wait = min(float(e.response.headers.get("retry-after", "1")), 5.0)
            except ValueError:
                wait = 1.0
    except openai.APITimeoutError as e:
        result.status, result.error = "timeout", str(e)[:200]
    except openai.APIConnectionError as e:
        result.status, result.error = "connection", str(e)[:200]
    except Exception as e:  # noqa: BLE001 - a broken stream, a bad body: counted, the load goes on
        result.status, result.error = "other", f"{type(e).__name__}: {e}"[:200]
    result.latency_s = time.perf_counter() - start
    return result, wait


def client_loop(base_url: str, api_key: str, model: str, plan: Plan, timeout: float, t0: float,
                out: list[Result]) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    try:
        while (i := plan.next()) is not None:
            result, wait = ask(client, model, i, t0)
            out.append(result)
            if wait:
                time.sleep(min(wait, max(0.0, plan.deadline - time.monotonic())))
    finally:
        client.close()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def spread(values: list[float], scale: float = 1.0) -> dict:
    return {"n": len(values), "p50": _r(percentile(values, 50), scale), "p95": _r(percentile(values, 95), scale),
            "max": _r(max(values) if values else None, scale)}


def _r(value: float | None, scale: float) -> float | None:
    return None if value is None else round(value * scale, 2)


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.status == 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests_sent": len(results),
        "answered_200": len(ok),
        "by_status": dict(sorted(statuses.items())),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(ok) / wall_s, 2),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 1),
        "latency_ms": spread([r.latency_s for r in ok], 1000),
        "latency_ms_by_kind": {k: spread([r.latency_s for r in ok if r.kind == k], 1000) for k in KINDS},
        "ttft_ms_streamed": spread([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        "server_ttft_ms": spread([r.server_ttft_ms for r in ok if r.server_ttft_ms is not None]),
        "latency_ms_503": spread([r.latency_s for r in results if r.status == 503], 1000),
        "finish_reasons": {f: sum(r.finish_reason == f for r in ok) for f in sorted({str(r.finish_reason) for r in ok})},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an already running server's http://HOST:PORT/v1 (default: start one)")
    parser.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY", "unused"))
    parser.add_argument("--model", default="demo", help="the model a started server opens (default: demo, "
                        "with a chat template added)")
    parser.add_argument("--max-queue", type=int, default=4, help="a started server's --max-queue (default 4)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for a started server")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=150.0, help="no request starts after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--out", type=Path, help="write the JSON here (e.g. docs/runs/http_load_cpu.json)")
    args = parser.parse_args()
    if not 1 <= args.clients <= 64 or not 1 <= args.requests <= 10_000:
        parser.error("--clients must be 1..64 and --requests 1..10000")

    server, tmp = None, None
    try:
        if args.base_url:
            base_url = args.base_url.rstrip("/")
            if not base_url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
                parser.error("--base-url must be on loopback")
            model = openai.OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0).models.list().data[0].id
        else:
            tmp = tempfile.TemporaryDirectory(prefix="strata-load-")
            path = str(demo_with_chat_template(Path(tmp.name))) if args.model == "demo" else args.model
            server = Server("--model", path, "--max-queue", str(args.max_queue), *args.server_arg)
            base_url, model = server.base_url, server.model
        print(f"load: {args.requests} requests from {args.clients} clients on {base_url} (model {model!r})",
              file=sys.stderr)
        before, at_start = metrics(base_url, args.api_key), machine()
        results: list[Result] = []
        t0 = time.perf_counter()
        plan = Plan(args.requests, time.monotonic() + args.time_limit)
        threads = [threading.Thread(target=client_loop, args=(base_url, args.api_key, model, plan,
                                                              args.request_timeout, t0, results), daemon=True)
                   for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.time_limit + args.request_timeout + 30)
        wall_s = time.perf_counter() - t0
        after = metrics(base_url, args.api_key)
        health = json.loads(get(base_url, "/health", args.api_key))
        results.sort(key=lambda r: r.index)
        summary = summarize(results, wall_s)
        summary["metrics_moved"] = {k: after.get(k, 0) - before.get(k, 0) for k in METRICS_MOVED}
        summary["health_after"] = health
        record = {
            "command": "python -m scripts.bench.load_http " + " ".join(sys.argv[1:]),
            "tree": tree(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {**at_start, "load_average_at_end": machine()["load_average"]},
            "versions": {"openai": openai.__version__},
            "config": {"base_url": base_url if args.base_url else "started", "model": model,
                       "max_queue": None if args.base_url else args.max_queue, "server_args": args.server_arg,
                       "requests": args.requests, "clients": args.clients, "time_limit_s": args.time_limit,
                       "mix": {"kinds": KINDS, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}},
            "summary": summary,
            "requests": [asdict(r) for r in results],
        }
        if server is not None:
            record["server_exit"] = server.stop()
            record["server_log_tail"] = server.log[-5:]
            server = None
        print(json.dumps(summary, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {args.out}", file=sys.stderr)
        bad = {s for s in summary["by_status"] if s not in ("200", "503")}
        return 1 if bad or health.get("status") != "ok" else 0
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
