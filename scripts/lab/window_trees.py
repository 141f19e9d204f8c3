"""Source trees' window cost by T and serial decoding on the demo model, alternating in fresh
processes: what a change to the decode step buys on this machine.

Each round runs one process per tree (PYTHONPATH set to it), the trees taking turns: serial
decoding of `--tokens` greedy tokens after a 300-token prompt of the agent transcript
(`decode.generate`, the overlapped one-token steps), then forced-acceptance windows of T = 1, 2,
4, 8 (median of 25 after 5). Both wall and process CPU time are recorded: on a shared machine
the CPU time (both of MLX's threads) moves less with other processes' load than the wall time
does. Medians over rounds.

    git archive c952359 | tar -x -C /tmp/base
    python -m scripts.lab.window_trees /tmp/base . --rounds 5 --out /tmp/window_trees.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, statistics, time
from strata_cli.decode import generate
from strata_cli.options import EngineOptions, GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model

TOKENS, WINDOWS = {tokens}, (1, 2, 4, 8)
runtime = open_model(LoadOptions(), EngineOptions())
engine = runtime.engine
prompt = runtime.tokenizer.encode(open("strata_cli/assets/workloads/agent_transcript.txt").read())[:300]

def serial(n):
    engine.reset()
    engine.prefill(prompt[:-1])
    wall, cpu, k = time.perf_counter(), time.process_time(), 0
    for step in generate(engine, prompt, options=GenerateOptions(max_tokens=n), spec=SpecOptions(), eos_ids=(),
                         prefilled=len(prompt) - 1):
        k += len(step.tokens)
    return 1e3 * (time.perf_counter() - wall) / k, 1e3 * (time.process_time() - cpu) / k

def window(T, n=30, warmup=5):
    engine.reset()
    engine.prefill(prompt[:-1])
    walls, cpus = [], []
    for i in range(n):
        tokens = [(7 * i + j) % runtime.model.config.vocab_size for j in range(T)]
        wall, cpu = time.perf_counter(), time.process_time()
        engine.run(tokens, engine.length)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        engine.commit(T)
    return 1e3 * statistics.median(walls[warmup:]), 1e3 * statistics.median(cpus[warmup:])

serial(16)
out = {{"serial_ms_per_token": serial(TOKENS)}}
for T in WINDOWS:
    out[f"window_T{{T}}_ms"] = window(T)
print(json.dumps(out))
'''


def run_tree(tree: Path, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", CHILD.format(tokens=tokens)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="two or more source trees (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rounds = {str(tree): [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            result = run_tree(tree.resolve(), args.tokens)
            rounds[str(tree)].append(result)
            print(f"round {r + 1} {tree}: " + ", ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}" for k, v in result.items()),
                  flush=True)
    medians = {tree: {key: [round(statistics.median(run[key][i] for run in runs), 3) for i in (0, 1)]
                      for key in runs[0]} for tree, runs in rounds.items()}
    print("\nmedians, ms (wall / CPU):")
    for tree, values in medians.items():
        t1 = values["window_T1_ms"]
        print(f"{tree}: " + ", ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}" for k, v in values.items())
              + f"; T8/T1 {values['window_T8_ms'][0] / t1[0]:.2f} wall, {values['window_T8_ms'][1] / t1[1]:.2f} CPU")
    report = {"trees": [str(t) for t in args.trees], "rounds": rounds, "medians": medians, "load": os.getloadavg()}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
