"""MLX primitives per decode window (run + commit of T rows) on the 2026 hybrids, as a CUDA device
with strata's kernels would run them: scripts/bench/step_ops.py's GPU-shaped count (stand-ins
for strata's kernels and MLX's fast ops, RowSplit as on a GPU), plus the Mamba-2 window kernels,
on a checkpoint with the real model's layer pattern and head counts but small widths (built with
mlx-lm's own class, 4-bit; the op structure is the real model's, the weights a few MB).

A window whose ops grow with T pays ~10 µs of host dispatch per op on the H200 (docs/benchmarks.md):
the count by primitive for T = 1 and 8 says which part loops per row. mlx-lm's forward of T
tokens is counted alike for reference.

    python -m scripts.bench.hybrid_ops --family qwen3_5_moe,nemotron_h --out /tmp/hybrid_ops.json  # CPU, minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np

from metal_shaders import mamba2_window
from scripts.bench import compare_mlx_lm as compare
from scripts.bench.step_ops import WARMUP, StandIns, Steps, gpu_shaped, mlx_lm_steps, strata_steps
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.runtime import load_checkpoint

# Small widths (multiples of 64, so the kernels and 4-bit groups take them); the real models'
# layer patterns, head counts, head dims, state sizes and top-k stay.
NARROW = {
    "qwen3_5_moe": dict(hidden_size=256, vocab_size=1024, num_experts=16, moe_intermediate_size=128,
                        shared_expert_intermediate_size=128),
    "nemotron_h": dict(hidden_size=256, vocab_size=1024, n_routed_experts=16, moe_intermediate_size=128,
                       moe_shared_expert_intermediate_size=128, intermediate_size=128),
}


def narrow_config(family: str, layers: int) -> dict:
    config = compare.family_config(family, layers=layers, tiny=False)
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **NARROW[family]}
    else:
        config.update(NARROW[family])
    return config


def count(run, stand_ins: StandIns) -> dict:
    steps = Steps(stand_ins, count=True)
    run(steps)
    counts = [c for c in steps.counts[WARMUP:] if c.total]
    typical = sorted(counts, key=lambda c: c.total)[len(counts) // 2]
    return {"ops": statistics.median(c.total for c in counts), "views": typical.views,
            "by_primitive": dict(typical.by_primitive.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_5_moe,nemotron_h")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--windows", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=8, help="windows per T (the first 3 are warm-up)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/strata-hybrid-ops"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"commit": git_commit(), "dtype": args.dtype, "layers": args.layers, "families": {}}
    for family in args.family.split(","):
        config = narrow_config(family, args.layers)
        path = args.dir / f"{family}-L{args.layers}"
        if not (path / "config.json").is_file():
            compare.build_mlx_lm_checkpoint(path, config, bits=4, seed=0, dtype=mx.bfloat16, tokenizer=True)
        vocab = config.get("text_config", config)["vocab_size"]
        prompt = np.random.default_rng(0).integers(0, vocab, 32).tolist()
        model = load_checkpoint(path, dtype=args.dtype)
        engine = WindowEngine(model)
        peer = None if args.no_mlx_lm else MlxLmPeer.load(path, dtype=getattr(mx, args.dtype)).model
        stand_ins = StandIns()
        rows = []
        with ExitStack() as stack:
            stack.enter_context(gpu_shaped(stand_ins))
            stack.enter_context(mock.patch.object(mamba2_window, "usable", lambda dtype=None: True))
            stack.enter_context(mock.patch.object(mamba2_window, "gpu_kernel", stand_ins.kernel))
            for T in (int(t) for t in args.windows.split(",")):
                sides = [("strata", lambda s, T=T: strata_steps(engine, prompt, T, args.steps, s))]
                if peer is not None:
                    sides.append(("mlx-lm", lambda s, T=T: mlx_lm_steps(peer, prompt, T, args.steps, s, vocab=vocab)))
                for name, run in sides:
                    row = {"engine": name, "T": T, **count(run, stand_ins)}
                    rows.append(row)
                    top = ", ".join(f"{k} {v}" for k, v in list(row["by_primitive"].items())[:8])
                    print(f"{family} {name:7s} T={T}: {row['ops']:5.0f} ops ({top})", flush=True)
        report["families"][family] = {"config": config, "results": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
