"""Source trees against each other as a user runs them: `strata generate --json` processes of
each tree taking turns, on the CPU, for prefill, sampled decoding and streamed experts — issue 37's
"nothing slower than today anywhere" outside the greedy window that scripts/lab/window_trees.py
times.

Each round runs every case once per tree (PYTHONPATH set to the tree, the trees alternating and
their order swapped every round) and records the case's figure from the process's stats;
medians over rounds, and each case's outputs compared across trees (sampling draws the same
tokens under one seed only where the trees compute the same bits: a difference is reported,
not an error). Cases:

- prefill: a `--prompt-tokens`-token prompt (the bundled workloads, repeated), one token
  generated: `prefill_tokens_per_s`;
- sampled: the copy-edit workload at temperature 0.7, seed 1, serial, 3 drafts and `auto`:
  `steady_tokens_per_s`;
- streamed: the demo model converted by each tree's own `strata convert --stream`, at a quarter
  and half of the experts resident, greedy serial: `steady_tokens_per_s`.

    git archive d8d28df | tar -x -C /tmp/base
    python -m scripts.lab.cli_trees /tmp/base . --rounds 3 --out /tmp/cli_trees.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "strata_cli" / "assets"
WORKLOADS = ASSETS / "workloads"
DEMO_EXPERTS = json.loads((ASSETS / "demo" / "config.json").read_text())["num_experts"]  # per MoE layer


def long_prompt(words: int) -> str:
    """The bundled workloads joined and repeated to about `words` whitespace-separated words."""
    text = "\n\n".join(p.read_text() for p in sorted(WORKLOADS.glob("*.txt")))
    out = []
    while len(out) < words:
        out += text.split()
    return " ".join(out[:words])


def cases(args) -> list[tuple[str, list[str], str, str]]:
    """(name, generate arguments, stdin, the stats field timed) of every case; "{streamed}" stands
    for the tree's streamed conversion."""
    copy_edit = (WORKLOADS / "copy_edit.txt").read_text()
    out = [("prefill", ["--max-tokens", "1"], long_prompt(args.prompt_words), "prefill_tokens_per_s")]
    for draft in ("0", "3", "auto"):
        out.append((f"sampled draft {draft}", ["--max-tokens", str(args.tokens), "--temperature", "0.7", "--seed", "1",
                                               "--suffix-draft", draft], copy_edit, "steady_tokens_per_s"))
    for resident in (DEMO_EXPERTS // 4, DEMO_EXPERTS // 2):
        out.append((f"streamed {resident}/{DEMO_EXPERTS} experts", ["--max-tokens", str(args.tokens), "--suffix-draft",
                                                                    "0", "--resident-experts", str(resident),
                                                                    "--model", "{streamed}"],
                    copy_edit, "steady_tokens_per_s"))
    return out


def run_generate(tree: Path, argv: list[str], stdin: str, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), XDG_CACHE_HOME=str(cache))
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "generate", "-", "--json", *argv], input=stdin,
                          capture_output=True, text=True, cwd=tree, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{tree}: generate {' '.join(argv)} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def convert_streamed(tree: Path, work: Path) -> Path:
    """The demo model in the streamed layout, converted by `tree`'s own code."""
    dest = work / f"demo-stream-{abs(hash(str(tree)))}"
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-m", "strata_cli.cli", "convert", "demo", str(dest), "--stream"], check=True,
                   capture_output=True, cwd=tree, env=env, timeout=900)
    return dest


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (the first is the base)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens of the decoding cases")
    parser.add_argument("--prompt-words", type=int, default=1000, help="words of the prefill case's prompt")
    parser.add_argument("--only", default=None, help="run only the cases whose name starts with this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    trees = [t.absolute() for t in args.trees]  # not resolved: a link to a tree is a tree of its own
    work = Path(tempfile.mkdtemp(prefix="strata-cli-trees-"))
    todo = [c for c in cases(args) if args.only is None or c[0].startswith(args.only)]
    streamed = {str(t): convert_streamed(t, work) for t in trees} if any("{streamed}" in c[1] for c in todo) else {}
    figures: dict[str, dict[str, list[float]]] = {}
    outputs: dict[str, dict[str, list]] = {}
    for rnd in range(args.rounds):
        order = trees if rnd % 2 == 0 else trees[::-1]
        for name, case_argv, stdin, field in todo:
            for tree in order:
                a = [streamed[str(tree)].as_posix() if v == "{streamed}" else v for v in case_argv]
                record = run_generate(tree, a, stdin, work / f"cache-{trees.index(tree)}")
                figures.setdefault(name, {}).setdefault(str(tree), []).append(record["stats"][field])
                outputs.setdefault(name, {})[str(tree)] = record["token_ids"]
                print(f"round {rnd + 1} {name:28s} {tree.name or tree}: {record['stats'][field]:8.1f} ({field})",
                      flush=True)
    result = {"trees": [str(t) for t in trees], "rounds": args.rounds, "tokens": args.tokens, "cases": {}}
    for name, by_tree in figures.items():
        medians = {t: statistics.median(v) for t, v in by_tree.items()}
        base = medians[str(trees[0])]
        result["cases"][name] = {"runs": by_tree, "median": medians,
                                 "over_base": {t: m / base for t, m in medians.items()},
                                 "same_tokens": len({tuple(v) for v in outputs[name].values()}) == 1}
        print(f"{name:28s} " + "  ".join(f"{Path(t).name or t}: {m:.1f} ({m / base:.2f}x)" for t, m in medians.items())
              + ("" if result["cases"][name]["same_tokens"] else "  (tokens differ between trees)"), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
