"""Seeded hostile-line fuzz of `strata serve-stdio` (issue 17).

Feeds one server N lines (default 10,000): broken JSON and UTF-8, wrong types, nulls in every
field, deep nesting, huge numbers, oversize lines, hostile chat messages, cancel lines of every
shape (none naming a good request), interleaved with good greedy requests. Checks that the server
exits 0, that stdout is JSON objects only with the ready frame first, that every non-blank line
gets exactly one final frame (done, error, or a cancel line's answer) in order, and that every
good request answers token-identical to the same request in a clean server.

    python -m scripts.lab.fuzz_serve_stdio --lines 10000 --seed 17
    python -m scripts.lab.fuzz_serve_stdio --lines 300 --seed 1 --model demo  # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

GOOD = [
    {"prompt": "def fibonacci(n):", "max_tokens": 4, "stream": False},
    {"prompt": "x = 1\ny = 2\nx = 1\n", "max_tokens": 4, "suffix_draft": 3, "stream": False},
    {"prompt": "class Foo:", "max_tokens": 3, "stop": ["\n\n"]},
]
FIELDS = ("id", "prompt", "messages", "max_tokens", "temperature", "seed", "suffix_draft", "stop", "stream")
VALUES = [None, True, False, 0, -1, 1.5, 2**63, -(2**70), 1e308, "", "x", "auto", "auto:99", [], {}, [None],
          ["a"] * 40, "\ud800", "\x00", {"role": "user"}, [{"role": "user", "content": 5}], "NaN"]


CANCEL_TARGETS = ["nobody", 7, None, True, 1.5, [], {}, "a" * 300, 2**64, "\ud800"]


def hostile_line(rng: random.Random, max_bytes: int) -> bytes:
    kind = rng.randrange(13)
    if kind == 12:  # cancel lines: unknown ids, bad ids, extra fields, padding past the limit
        line = json.dumps({"cancel": rng.choice(CANCEL_TARGETS), **rng.choice([{}, {}, {"prompt": "a"}])})
        return (line + " " * rng.choice([0, 0, 5000])).encode("utf-8", "surrogatepass")
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" ")
    if kind == 1:
        depth = rng.choice([10, 1000, 100_000, max_bytes // 2])
        return b"[" * depth + b"]" * rng.choice([0, depth])
    if kind == 2:
        depth = rng.choice([100, 50_000])
        return b'{"prompt":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    if kind == 3:
        body = {k: rng.choice(VALUES) for k in rng.sample(FIELDS, rng.randrange(1, 5))}
        body["max_tokens"] = rng.choice([1, 2, 0, -1, "3", 2.0, None])  # a valid one stays short
        return json.dumps(body).encode()
    if kind == 4:
        return json.dumps({"prompt": "ab", "stop": None}).encode()
    if kind == 5:
        return b'{"prompt": "' + b"\xff\xfe" * rng.randrange(1, 50) + b'"}'
    if kind == 6:
        return b"x" * (max_bytes + rng.randrange(1, 1000))  # an oversize line
    if kind == 7:
        return json.dumps({"prompt": "ab " * rng.randrange(1, 500), "max_tokens": 1}).encode()
    if kind == 8:
        return json.dumps({"messages": [{"role": "user", "content": "{{ 'x' * 2000000000 }}"}]}).encode()
    if kind == 9:
        return rng.choice([b"", b"   ", b"\t", b"null", b"[]", b"1", b'"s"', b"{", b"}", b"{}", b"\r"])
    if kind == 10:
        return json.dumps({"prompt": "a", "max_tokens": rng.choice([0, -5, "3", 2.0, True])}).encode()
    return json.dumps({"id": rng.choice([None, "a" * 300, 2**64, [1], 1.5]), "prompt": "a"}).encode()


def make_lines(n: int, seed: int, max_bytes: int) -> tuple[list[bytes], dict[str, dict]]:
    """`n` lines, about one in ten a good request (its id "good-<i>-<k>" names which GOOD)."""
    rng = random.Random(seed)
    lines, good = [], {}
    for i in range(n):
        if rng.random() < 0.1:
            k = rng.randrange(len(GOOD))
            rid = f"good-{i}-{k}"
            good[rid] = GOOD[k]
            lines.append(json.dumps({"id": rid, **GOOD[k]}).encode())
        else:
            lines.append(hostile_line(rng, max_bytes))
    return lines, good


def serve(lines: list[bytes], model: str, max_line_bytes: int, timeout: float) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_RAISE_ERRORS": ""}
    command = [sys.executable, "-m", "strata_cli.cli", "serve-stdio", "--model", model,
               "--max-line-bytes", str(max_line_bytes), "--max-tokens", "2"]
    proc = subprocess.run(command, input=b"\n".join(lines) + b"\n", capture_output=True, timeout=timeout, env=env)
    frames = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]  # raises on a bad frame
    return proc.returncode, frames, proc.stderr.decode("utf-8", "replace")


def check(lines: list[bytes], good: dict[str, dict], *, model: str = "demo", max_line_bytes: int = 65536,
          timeout: float = 1800) -> dict:
    """Run the fuzz and check it; returns counts. Raises AssertionError naming what broke."""
    started = time.perf_counter()
    reference = {}
    rc, frames, err = serve([json.dumps({"id": k, **body}).encode() for k, body in enumerate(GOOD)], model,
                            max_line_bytes, timeout)
    assert rc == 0, err[-2000:]
    for f in frames:
        if f.get("done"):
            reference[f["id"]] = f["token_ids"]
    rc, frames, err = serve(lines, model, max_line_bytes, timeout)
    assert rc == 0, f"exit {rc}: {err[-2000:]}"
    assert all(isinstance(f, dict) for f in frames), "a frame that is not a JSON object"
    assert frames and frames[0].get("ready") is True, f"the first frame is not the ready frame: {frames[:1]}"
    finals = [f for f in frames[1:] if f.get("done") or "error" in f or "cancel" in f]
    expected = sum(1 for line in lines if line.strip())
    assert len(finals) == expected, f"{len(finals)} final frames for {expected} non-blank lines"
    answered = 0
    for f in finals:
        rid = f.get("id")
        if isinstance(rid, str) and rid in good:
            assert f.get("done"), f"good request {rid} failed: {f}"
            k = int(rid.rsplit("-", 1)[1])
            assert f["token_ids"] == reference[k], f"{rid}: {f['token_ids']} != {reference[k]}"
            answered += 1
    assert answered == len(good), f"{answered} of {len(good)} good requests answered"
    errors = sum(1 for f in finals if "error" in f)
    return {"lines": len(lines), "bytes": sum(map(len, lines)), "good": answered, "errors": errors,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-line-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    lines, good = make_lines(args.lines, args.seed, args.max_line_bytes)
    print(json.dumps(check(lines, good, model=args.model, max_line_bytes=args.max_line_bytes)))


if __name__ == "__main__":
    main()
