"""Median tokens/s and draft acceptance of `strata generate`, serial against --suffix-draft N.

Runs the real CLI (one process per run, as a user would), on each prompt file, in alternation so
that machine noise hits both modes alike; the first run of each pair is a warm-up and is dropped.

    python -m scripts.bench.measure_generate examples/prompts/*.txt --runs 5 --drafts 0 3 auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def suffix_draft(value: str) -> str:
    """A --suffix-draft value, checked as `strata generate` checks it (N, auto, auto:N)."""
    from strata_cli.options import ConfigError, parse_suffix_draft

    try:
        parse_suffix_draft(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def one_run(prompt: Path, drafts: str, max_tokens: int, model: str | None) -> dict:
    cmd = [sys.executable, "-m", "strata_cli.cli", "generate", "-", "--json", "--max-tokens", str(max_tokens),
           "--suffix-draft", str(drafts)]
    if model:
        cmd += ["--model", model]
    proc = subprocess.run(cmd, input=prompt.read_text(), capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--drafts", type=suffix_draft, nargs="+", default=["0", "3"],
                        help="--suffix-draft values to compare, the first the reference (default 0 3; auto, auto:N too)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    print(f"| prompt | --suffix-draft | tokens/s (median of {args.runs}) | min..max | acceptance | tokens/window |")
    print("|---|---|---|---|---|---|")
    for prompt in args.prompts:
        results: dict[str, list[dict]] = {d: [] for d in args.drafts}
        for d in args.drafts:  # warm-up: page cache, imports
            one_run(prompt, d, args.max_tokens, args.model)
        for _ in range(args.runs):
            for d in args.drafts:
                results[d].append(one_run(prompt, d, args.max_tokens, args.model))
        token_ids = {d: rs[0]["token_ids"] for d, rs in results.items()}
        same = all(ids == token_ids[args.drafts[0]] for ids in token_ids.values())
        for d, rs in results.items():
            tps = [r["stats"]["tokens_per_s"] for r in rs]
            s = rs[0]["stats"]
            print(f"| {prompt.name} | {d} | {statistics.median(tps):.1f} | {min(tps):.1f}..{max(tps):.1f} | "
                  f"{s['drafts_kept']}/{s['drafts_offered']} ({s['acceptance']:.0%}) | {s['tokens_per_window']:.2f} |")
        print(f"| {prompt.name} | identical output across modes: {same} | | | | |")


if __name__ == "__main__":
    main()
