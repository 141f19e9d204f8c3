"""CPU decode speed of installed models against the first one, in one process, rounds alternating.

Each model is opened in float32 and timed as `demo_shape_speed.py` times candidate shapes (`compare`:
a warm-up each, then every round decodes the same greedy tokens after the same prompt with every
model in turn, the first token, which carries the prefill, not timed), so a shared machine's load
falls on all alike; the figure is the median of each model's same-round ratios to the first's.

    python -m scripts.train.demo_model_speed strata_cli/assets/demo /tmp/candidate --rounds 9 --tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.train.demo_shape_speed import compare
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+", help="installed model folders; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a model decodes per round (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    runtimes = {str(m): open_model(LoadOptions(model=str(m), dtype="float32")) for m in args.models}
    rows = compare(runtimes, args.rounds, args.tokens)
    for name, row in rows.items():
        print(f"{name}: {row['median_ms']:.2f} ms/token, same-round ratio {row['round_ratio_to_first']:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "tokens": args.tokens, "models": rows}, indent=1))


if __name__ == "__main__":
    main()
