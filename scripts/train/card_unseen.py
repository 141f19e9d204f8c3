"""The model card's HumanEval and copy-with-rename figures on problems the card does not use.

Choosing among demo-model candidates by the card's 40 problems selects for those 40; the next 40
of the same shuffle say whether a gain holds on problems nobody chose by.

    python -m scripts.train.card_unseen OLD_MODEL NEW_MODEL --first 40 --count 40
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.train.model_card import copy_with_rename, humaneval_parse_rate, humaneval_problems
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--first", type=int, default=40, help="position in the shuffle to start at (default 40)")
    parser.add_argument("--count", type=int, default=40, help="problems (default 40)")
    args = parser.parse_args()
    problems = humaneval_problems(args.first, args.count)
    for model in args.models:
        runtime = open_model(LoadOptions(model=str(model), dtype="float32"))
        figures = {"model": str(model), "problems": f"{args.first}-{args.first + len(problems) - 1}",
                   "humaneval_healed": humaneval_parse_rate(runtime.engine, runtime.tokenizer, problems, heal=True),
                   "copy_with_rename": copy_with_rename(runtime.engine, runtime.tokenizer, problems)}
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
