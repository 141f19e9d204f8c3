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

    python -m scripts.bench.measure_http --workload agent_transcript --runs 5 --max-tokens 128 \
        --out docs/runs/http_agent_cpu.json

With `--workload NAME` it measures instead what `auto` gains over serial on a bench workload
(strata_cli/assets/workloads/NAME.txt) over HTTP: the workload's prompt as a streamed
completion, greedy, unhealed as bench takes it (`heal: false`), `max_tokens` tokens, with
`suffix_draft` 0 and "auto" in alternation, on two `strata serve` processes: one with
`--suffix-cache 0` (drafts only from the prompt and the answer so far, as `strata bench`
drafts: the figure to compare with bench's) and one with the server's defaults (the
cross-request suffix cache holds the earlier answers to the same prompt, so `auto` there copies
a repeated answer: what an agent resending a context gains, not bench's figure). After one
warm-up request of each mode on each server, the modes take turns run by run. tokens/s is the
server's `stats.tokens_per_s` (generated tokens per second of decode windows: bench's measure,
prefill left out); "end to end" is completion tokens over the client's whole request time. The
texts of every run are compared: they must all be equal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

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

    def __init__(self, args: list[str] | None = None):
        args = SERIAL_COLD if args is None else args
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_cli.cli", "serve", "--port", "0", *args],
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


def workload_prompt(name: str) -> str:
    from strata_cli.bench.workloads import default_workloads_dir, parse_workload

    [prompt] = parse_workload(default_workloads_dir() / f"{name}.txt").prompts
    return prompt


def ask_workload(server, prompt: str, max_tokens: int, suffix_draft) -> dict:
    """One streamed, greedy, unhealed completion of `prompt`: the text, the client's times, the
    server's stats."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "heal": False,
                       "temperature": 0, "suffix_draft": suffix_draft, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    try:
        server.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = server.conn.getresponse()
    except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
        # The server closed the kept-alive connection while the other server ran (uvicorn's
        # keep-alive timeout is 5 s; a loaded machine takes longer): connect again.
        server.conn.close()
        server.conn = http.client.HTTPConnection("127.0.0.1", server.port)
        start = time.perf_counter()
        server.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = server.conn.getresponse()
    assert response.status == 200, response.read()
    pieces, first, usage, strata = [], None, None, None
    for raw in response:
        if not raw.startswith(b"data: {"):
            continue
        event = json.loads(raw[6:])
        assert "error" not in event, event
        if event["choices"] and event["choices"][0]["text"]:
            first = first or time.perf_counter()
            pieces.append(event["choices"][0]["text"])
        if event.get("usage"):
            usage, strata = event["usage"], event["strata"]
    total = time.perf_counter() - start
    stats = strata["stats"]
    keys = ("tokens_per_s", "steady_tokens_per_s", "decode_seconds", "windows", "tokens_per_window",
            "drafts_proposed", "drafts_offered", "drafts_declined", "drafts_kept", "drafts_offered_global",
            "drafts_kept_global", "acceptance", "window_ms_mean", "window_T_histogram", "ttft_ms")
    return {"suffix_draft": suffix_draft, "text": "".join(pieces), "completion_tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "finish_reason": strata["finish_reason"], "client_ttft_s": None if first is None else first - start,
            "client_total_s": total, "end_to_end_tokens_per_s": usage["completion_tokens"] / total,
            **{k: stats.get(k) for k in keys}}


def measure_workload(args) -> None:
    from scripts.bench.load_http import machine, tree

    prompt, at_start = workload_prompt(args.workload), machine()
    modes = (0, "auto")
    servers = {"suffix-cache 0": Http(["--suffix-cache", "0"]), "defaults": Http([])}
    runs: dict[str, dict[str, list[dict]]] = {s: {str(m): [] for m in modes} for s in servers}
    try:
        for server in servers.values():
            for mode in modes:
                ask_workload(server, prompt, args.max_tokens, mode)  # warm-up
        for _ in range(args.runs):
            for name, server in servers.items():
                for mode in modes:
                    runs[name][str(mode)].append(ask_workload(server, prompt, args.max_tokens, mode))
    finally:
        for server in servers.values():
            server.close()
    texts = {r["text"] for by_mode in runs.values() for rs in by_mode.values() for r in rs}
    summary = {}
    print(f"\nworkload {args.workload!r}, {args.max_tokens} max tokens, {args.runs} runs each, medians")
    print("| server | suffix_draft | tok/s (decode) | min-max | end to end tok/s | tokens | drafts kept/offered "
          "| of them from the suffix cache | tok/window | vs serial |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, by_mode in runs.items():
        serial = statistics.median(r["tokens_per_s"] for r in by_mode["0"])
        for mode, rs in by_mode.items():
            rate = [r["tokens_per_s"] for r in rs]
            row = {
                "tokens_per_s": statistics.median(rate), "min": min(rate), "max": max(rate),
                "end_to_end_tokens_per_s": statistics.median(r["end_to_end_tokens_per_s"] for r in rs),
                "completion_tokens": statistics.median(r["completion_tokens"] for r in rs),
                "drafts_kept": statistics.median(r["drafts_kept"] for r in rs),
                "drafts_offered": statistics.median(r["drafts_offered"] for r in rs),
                "drafts_kept_global": statistics.median(r["drafts_kept_global"] for r in rs),
                "drafts_offered_global": statistics.median(r["drafts_offered_global"] for r in rs),
                "tokens_per_window": statistics.median(r["tokens_per_window"] for r in rs),
                "vs_serial": statistics.median(rate) / serial,
            }
            summary.setdefault(name, {})[mode] = row
            print(f"| {name} | {mode} | {row['tokens_per_s']:.1f} | {row['min']:.1f}-{row['max']:.1f} "
                  f"| {row['end_to_end_tokens_per_s']:.1f} | {row['completion_tokens']:g} "
                  f"| {row['drafts_kept']:g}/{row['drafts_offered']:g} "
                  f"| {row['drafts_kept_global']:g}/{row['drafts_offered_global']:g} "
                  f"| {row['tokens_per_window']:.2f} | {row['vs_serial']:.2f}x |")
    print(f"outputs identical across every run, mode and server: {len(texts) == 1}")
    if args.out:
        record = {"command": "python -m scripts.bench.measure_http " + " ".join(sys.argv[1:]), "tree": tree(),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "machine": {**at_start, "load_average_at_end": machine()["load_average"]}, "workload": args.workload,
                  "max_tokens": args.max_tokens, "runs_each": args.runs, "outputs_identical": len(texts) == 1,
                  "summary": summary, "runs": runs}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workload", help="measure auto against serial on this bench workload instead")
    parser.add_argument("--out", type=Path, help="with --workload: write the runs as JSON here")
    args = parser.parse_args()
    if args.workload:
        measure_workload(args)
        return
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
