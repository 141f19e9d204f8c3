"""Drafts kept when sampling, against greedy, over several seeds (issue 14's first target).

One bench seed is one sample path; at temperature > 0 whether the text stays on a copy
varies a lot between seeds, so this runs each workload greedily once and sampled with seeds
0..N-1 (fixed --suffix-draft, EOS off, as `strata bench`), and prints drafts kept per 128
tokens and acceptance (kept / offered), pooled over the seeds.

    python -m scripts.lab.sampling_acceptance copy_edit agent_transcript --temperature 0.7 --seeds 5
"""

from __future__ import annotations

import argparse
import json

from strata_cli.bench import default_workloads_dir, load_workloads
from strata_cli.bench.runner import BenchOptions, Prefilled
from strata_cli.options import EngineOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    runtime = open_model(LoadOptions(), EngineOptions())
    spec = SpecOptions(max_drafts=args.drafts)
    for workload in load_workloads(default_workloads_dir(), args.workloads):
        prefilled = Prefilled(runtime.engine, runtime.tokenizer, workload.prompts)
        rows = {}
        for label, temperature, seeds in (("greedy", 0.0, [0]), (f"t={args.temperature}", args.temperature,
                                                                  range(args.seeds))):
            kept = offered = tokens = 0
            per_seed = []
            for seed in seeds:
                run = prefilled.run(spec, BenchOptions(max_tokens=args.max_tokens, seed=seed, temperature=temperature))
                kept += run.summary["drafts_kept"]
                offered += run.summary["drafts_offered"]
                tokens += run.tokens
                per_seed.append(run.summary["drafts_kept"])
            rows[label] = {"kept_per_128": 128 * kept / tokens, "acceptance": kept / offered if offered else 0.0,
                           "kept_by_seed": per_seed}
        greedy, sampled = rows["greedy"], rows[f"t={args.temperature}"]
        print(json.dumps({
            "workload": workload.name, **rows,
            "kept_ratio": sampled["kept_per_128"] / greedy["kept_per_128"],
            "acceptance_ratio": sampled["acceptance"] / greedy["acceptance"],
        }))


if __name__ == "__main__":
    main()
