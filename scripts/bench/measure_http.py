"""The HTTP path's overhead: time to first token and tokens/s of one prompt through `strata
serve` (streamed over HTTP), `strata serve-stdio` (streamed frames) and `strata generate`'s path
(`TextRequest.stream` in this process, what `_generate` in cli.py runs), on the demo model.

    python -m scripts.bench.measure_http --runs 10 --max-tokens 64

Every path decodes serially (no drafts) and cold (no prefix reuse, no suffix cache), so each
run repeats the same work and only the path around it differs. After one warm-up request per
path, the paths take turns run by run, so machine noise hits them alike. Time to first token is
the client's: from sending the request (or calling `stream`) to the first text; tokens/s is the
completion's tokens after the first over the time after the first text. "transport" is the
client's time to first token less the server's own (`stats.ttft_ms`, from the worker taking the
request to its first token): what the path itself costs, apart from the decode it waits for
(0 for generate, which has none).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time

from strata_cli.options import EngineOptions, GenerateOptions, LoadOptions, SpecOptions
from strata_cli.request import TextRequest
from strata_cli.runtime import open_model

SERIAL_COLD = ["--suffix-draft", "0", "--prefix-cache", "0", "--suffix-cache", "0"]
PROMPTS = {
    "short": "def fibonacci(n):",
    "long": "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(24)) + "class Parser:",
}


class Generate:
    name = "generate (in process)"

    def __init__(self):
        self.runtime = open_model(LoadOptions(model="demo"), EngineOptions())

    def ask(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        request = TextRequest(self.runtime.tokenizer, prompt, GenerateOptions(max_tokens=max_tokens, seed=0))
        first = None
        for _ in request.stream(self.runtime.engine, spec=SpecOptions()):
            first = first or time.perf_counter()
        request.close()
        return first - start, time.perf_counter() - first, len(request.token_ids), 0.0

    def close(self):
        pass


class Stdio:
    name = "serve-stdio"

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_cli.cli", "serve-stdio", *SERIAL_COLD],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert json.loads(self.proc.stdout.readline()).get("ready") is True

    def ask(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode() + b"\n")
        self.proc.stdin.flush()
        first = None
        while True:
            frame = json.loads(self.proc.stdout.readline())
            if frame.get("delta") and first is None:
                first = time.perf_counter()
            if frame.get("done"):
                served = frame["stats"]["ttft_ms"] / 1000
                return first - start, time.perf_counter() - first, len(frame["token_ids"]), first - start - served

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


class Http:
    name = "serve (HTTP, streamed)"

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_cli.cli", "serve", "--port", "0", *SERIAL_COLD],
                                     stderr=subprocess.PIPE, text=True)
        line = ""
        while "listening on" not in line:
            line = self.proc.stderr.readline()
            assert line, "strata serve exited"
        self.port = int(line.split("listening on http://", 1)[1].split("/")[0].rsplit(":", 1)[1])
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port)  # kept alive, as clients do

    def ask(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}})
        start = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        first, tokens, served = None, 0, 0.0
        for raw in response:
            if not raw.startswith(b"data: {"):
                continue
            event = json.loads(raw[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                served = event["strata"]["stats"]["ttft_ms"] / 1000
        return first - start, time.perf_counter() - first, tokens, first - start - served

    def close(self):
        self.conn.close()
        self.proc.terminate()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    paths = [Generate(), Stdio(), Http()]
    try:
        for name, prompt in PROMPTS.items():
            results: dict[str, list[tuple[float, float, int, float]]] = {p.name: [] for p in paths}
            for p in paths:
                p.ask(prompt, args.max_tokens)  # warm-up
            for _ in range(args.runs):
                for p in paths:
                    results[p.name].append(p.ask(prompt, args.max_tokens))
            print(f"\nprompt {name!r} ({len(prompt)} chars), {args.max_tokens} tokens, {args.runs} runs, medians")
            print("| path | TTFT ms | (min-max) | transport ms | tok/s |\n|---|---|---|---|---|")
            for p in paths:
                ttft = [1000 * r[0] for r in results[p.name]]
                rate = [(r[2] - 1) / r[1] for r in results[p.name]]
                transport = [1000 * r[3] for r in results[p.name]]
                print(f"| {p.name} | {statistics.median(ttft):.1f} | {min(ttft):.1f}-{max(ttft):.1f} "
                      f"| {statistics.median(transport):.2f} | {statistics.median(rate):.1f} |")
    finally:
        for p in paths:
            p.close()


if __name__ == "__main__":
    main()
