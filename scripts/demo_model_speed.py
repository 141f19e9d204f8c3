"""CPU decode speed of installed models against the first one, in one process, rounds alternating.

Each round decodes the same greedy tokens after the same prompt with every model in turn, so a
shared machine's load falls on all alike; the figure is the median over rounds of each model's
ms/token divided by the first model's in that round (the first round is warm-up, left out).

    python scripts/demo_model_speed.py strata_cli/assets/demo /tmp/candidate --rounds 9 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.runtime import load_checkpoint

PROMPT = list(range(5, 200, 3))  # 65 token ids every model's vocabulary holds


def ms_per_token(engine: WindowEngine, tokens: int) -> float:
    start = time.perf_counter()
    n = sum(len(step.tokens) for step in generate(engine, PROMPT, options=GenerateOptions(max_tokens=tokens),
                                                  spec=SpecOptions(), eos_ids=()))
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+", help="installed model folders; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=9, help="rounds, the first one warm-up (default 9)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a model decodes per round (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first is warm-up)")
    engines = [WindowEngine(load_checkpoint(m, dtype="float32")) for m in args.models]
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(args.rounds):
        for engine, series in zip(engines, times):
            series.append(ms_per_token(engine, args.tokens))
    figures = []
    for model, series in zip(args.models, times):
        ratios = [t / b for t, b in zip(series[1:], times[0][1:])]
        figures.append({"model": str(model), "median_ms_per_token": round(statistics.median(series[1:]), 3),
                        "same_round_ratio": round(statistics.median(ratios), 3), "ms_per_token": series})
        print(f"{model}: {figures[-1]['median_ms_per_token']:.2f} ms/token, "
              f"same-round ratio {figures[-1]['same_round_ratio']:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "tokens": args.tokens, "models": figures}, indent=1))


if __name__ == "__main__":
    main()
