"""Time to first token of `strata serve-stdio` for a repeated long prefix: cold against reused.

Two servers run side by side: one with the prefix cache off (every request prefills the whole
prompt: cold), one with it on (reused). Each request is the same ~N-token prefix plus a suffix
that differs per request, so only the prefix can be reused. Both servers first answer the same
warm-up requests (one-time costs, and in the reused server the checkpoints a repeated prefix
leaves: aligned prefill points, then the divergence point); then requests alternate between
the servers so that machine noise hits both alike.

    python -m scripts.bench.measure_serve_ttft --prefix-tokens 2000 --runs 5

Reports the server's own `stats.ttft_ms` (request read -> first token) and the client's time from
writing the line to the first frame, median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from strata_cli.runtime import embedded_model_path
from strata_cli.tokenizer import Tokenizer


def prefix_text(num_tokens: int, model: Path) -> str:
    """About `num_tokens` tokens of Python source from the standard library."""
    import inspect
    import textwrap

    source = "".join(inspect.getsource(m) for m in (textwrap, argparse))
    tokenizer = Tokenizer(model)
    return tokenizer.decode(tokenizer.encode(source)[:num_tokens])


class Server:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata_cli.cli", "serve-stdio", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        ready = json.loads(self.proc.stdout.readline())  # the first frame, once the model is open
        assert ready.get("ready") is True, ready

    def ask(self, request: dict) -> tuple[dict, float]:
        """Send one request; return its final frame and the seconds to its first frame."""
        start = time.perf_counter()
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        first = None
        while True:
            frame = json.loads(self.proc.stdout.readline())
            first = first if first is not None else time.perf_counter() - start
            if frame.get("done") or "error" in frame:
                if "error" in frame:
                    raise RuntimeError(frame["error"])
                return frame, first

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    prefix = prefix_text(args.prefix_tokens, embedded_model_path())
    cold, warm = Server("--prefix-cache", "0"), Server()
    requests = [
        {"id": i, "prompt": f"{prefix}\n# request {i}\ndef handler_{i}(event):", "max_tokens": args.max_tokens}
        for i in range(args.warmups + args.runs)
    ]
    results: dict[str, list[tuple[dict, float]]] = {"cold": [], "reused": []}
    try:
        for i, request in enumerate(requests):
            a, b = cold.ask(request), warm.ask(request)
            assert a[0]["token_ids"] == b[0]["token_ids"], f"request {i}: reused output differs from cold"
            if i >= args.warmups:
                results["cold"].append(a)
                results["reused"].append(b)
            else:
                print(f"warm-up {i}: reused {b[0]['usage']['cached_tokens']} of {b[0]['usage']['prompt_tokens']}"
                      f" prompt tokens, ttft {b[0]['stats']['ttft_ms']:.1f} ms (cold {a[0]['stats']['ttft_ms']:.1f} ms)")
    finally:
        cold.close()
        warm.close()

    print(f"\n| mode | prompt tokens | reused | server ttft ms (median of {args.runs}) | min..max | "
          f"client first frame ms (median) |")
    print("|---|---|---|---|---|---|")
    for mode, rs in results.items():
        ttft = [r["stats"]["ttft_ms"] for r, _ in rs]
        client = [1000 * t for _, t in rs]
        usage = rs[0][0]["usage"]
        print(f"| {mode} | {usage['prompt_tokens']} | {usage['cached_tokens']} | {statistics.median(ttft):.1f} | "
              f"{min(ttft):.1f}..{max(ttft):.1f} | {statistics.median(client):.1f} |")
    speedup = statistics.median(r["stats"]["ttft_ms"] for r, _ in results["cold"]) / statistics.median(
        r["stats"]["ttft_ms"] for r, _ in results["reused"])
    print(f"\nspeed-up of the median: {speedup:.1f}x; outputs identical: True")


if __name__ == "__main__":
    main()
