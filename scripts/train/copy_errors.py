"""Where the demo model's copies go wrong: copy with rename (the model card's prompts), scored
teacher-forced: the body is given, and each of its tokens that is not the model's top choice is
an error, with its margin (the top choice's logit minus the right token's).

The card's figure (median share before the first wrong character, greedy) jumps between
candidates as a problem's single error moves; the errors counted here move less, and say which
kind of mistake is left (a look-alike phrase copied from the wrong place, or the model's own
guess put over the text).

    python -m scripts.train.copy_errors MODEL [MODEL ...] --first 0 --count 40
    python -m scripts.train.copy_errors MODEL --source held-out  # stdlib functions it never saw
    python -m scripts.train.copy_errors MODEL --source training  # ... and ones it trained on
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from scripts.train.model_card import copy_prompt, humaneval_problems
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def copy_errors(engine, tokenizer, source: str, name: str) -> dict:
    """Teacher-forced errors over the body of `name`'s copy (`scored`: the text scored, the
    signature's newline and the body): count, margins, and the right and the predicted tokens."""
    import mlx.core as mx

    prompt, body = copy_prompt(source, name)
    ids = tokenizer.encode(prompt + body)
    start = len(tokenizer.encode(prompt.rstrip("\n")))  # the body's first token is not split off a prompt token
    engine.reset()
    logits = np.array(engine.run(ids[:-1], 0).logits.astype(mx.float32))[start - 1 :]
    engine.commit(1)
    targets = np.array(ids[start:])
    predicted = logits.argmax(-1)
    wrong = np.flatnonzero(predicted != targets)
    return {"tokens": len(targets), "scored": tokenizer.decode(targets.tolist()), "errors": len(wrong),
            "margins": [round(float(logits[i, predicted[i]] - logits[i, targets[i]]), 2) for i in wrong],
            "wrong": [[tokenizer.decode([int(targets[i])]), tokenizer.decode([int(predicted[i])])] for i in wrong]}


def stdlib_functions(files: list[Path], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(source, name) of up to `count` documented functions of 150-1,200 characters, one from each
    of the first files of a shuffle that have one: `demo_corpus.functions`, as the copy documents
    take them (dedented, methods too)."""
    from scripts.train.demo_corpus import function_name, functions, has_docstring, read_text

    rng = random.Random(seed)
    files = sorted(files)
    rng.shuffle(files)
    chosen = []
    for f in files:
        found = [fn for fn in functions(read_text(f) or "")
                 if fn.startswith("def ") and 150 < len(fn) < 1200 and has_docstring(fn)]
        if found:
            fn = rng.choice(found)
            chosen.append((fn, function_name(fn)))
        if len(chosen) == count:
            break
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--first", type=int, default=0, help="position in the card's shuffle (default 0: the card's problems)")
    parser.add_argument("--count", type=int, default=40, help="problems (default 40)")
    parser.add_argument("--source", choices=("humaneval", "held-out", "training"), default="humaneval",
                        help="the card's HumanEval functions (default), or documented functions of the "
                             "stdlib files held out from training, or of those trained on")
    parser.add_argument("--details", action="store_true", help="also print each problem's errors")
    args = parser.parse_args()
    if args.source == "humaneval":
        cases = [(p["task_id"], p["prompt"] + p["canonical_solution"], p["entry_point"])
                 for p in humaneval_problems(args.first, args.count)]
    else:
        from scripts.train.demo_corpus import stdlib_split

        train_files, held_out = stdlib_split()
        functions = stdlib_functions(held_out if args.source == "held-out" else train_files, args.count)
        cases = [(name, source, name) for source, name in functions]
    for model in args.models:
        runtime = open_model(LoadOptions(model=str(model), dtype="float32"))
        rows = [{"task": task, **copy_errors(runtime.engine, runtime.tokenizer, source, name)}
                for task, source, name in cases]
        if args.details:
            for row in rows:
                print(json.dumps({k: v for k, v in row.items() if k != "scored"}))
        errors = np.array([r["errors"] for r in rows])
        where = f"{args.first}-{args.first + len(rows) - 1}" if args.source == "humaneval" else args.source
        print(json.dumps({"model": str(model), "problems": where, "copies": len(rows),
                          "errors": int(errors.sum()), "tokens": sum(r["tokens"] for r in rows),
                          "without_error": int((errors == 0).sum()), "at_most_one": int((errors <= 1).sum())}),
              flush=True)


if __name__ == "__main__":
    main()
