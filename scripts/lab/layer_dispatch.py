"""Windows handed to the device in pieces against windows evaluated whole (strata_cli/model/dispatch.py):
forced-acceptance windows of T = 1 and 8 rows on the 8-layer 80B-A3B-patterned checkpoint of
scripts/bench/step_ops.py (small dims, 4-bit), each setting of `--pieces` in turn, rounds alternating,
medians of each round's windows.

On a GPU it measures what decoding runs. On the CPU it takes the MLX path (the numpy host path,
the CPU's default, evaluates as it builds and never dispatches), where MLX's stream thread
computes a piece while Python builds the next: a check that the overlap happens at all.

    python -m scripts.lab.layer_dispatch --out layer_dispatch.json        # CPU: ~1 minute
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench import compare_mlx_lm as compare
from scripts.bench.step_ops import SHAPE
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.model.dispatch import LayerDispatch
from strata_cli.model.layers import CpuShortCalls
from strata_cli.runtime import load_checkpoint


def window_ms(engine: WindowEngine, start, T: int, n: int, rng) -> float:
    """Median ms of `n` windows of T rows from `start` (two untimed first)."""
    engine.restore(start)
    times = []
    for _ in range(n + 2):
        tokens = rng.integers(0, SHAPE["vocab_size"], T).tolist()
        t0 = time.perf_counter()
        engine.run(tokens, engine.length)
        engine.commit(T)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, nargs="+", default=[0, 4, 8], help="settings to compare (0: whole)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 8], help="row counts T")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20, help="windows a round and setting")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/strata-step-ops"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    path = args.dir / f"L{args.layers}"
    if not (path / "config.json").is_file():
        compare.build_checkpoint(path, layers=args.layers, tiny=False, bits=4, seed=0, shape=SHAPE)
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu:  # the MLX path, where windows build a lazy graph as on a GPU
        CpuShortCalls.mode, LayerDispatch.mode = "never", "always"
    engine = WindowEngine(load_checkpoint(path, dtype="float32" if on_cpu else "bfloat16"))
    rng = np.random.default_rng(0)
    engine.prefill(rng.integers(0, SHAPE["vocab_size"], 64).tolist())
    start = engine.snapshot()
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = args.pieces if r % 2 == 0 else list(reversed(args.pieces))
        for pieces in order:
            LayerDispatch.pieces = pieces
            for T in args.windows:
                runs.setdefault(f"pieces={pieces} T={T}", []).append(window_ms(engine, start, T, args.repeats, rng))
    report = {"tree": git_commit(), "device": str(mx.default_device()), "machine": platform.platform(),
              "mlx": mx.__version__, "path": "mlx (CPU)" if on_cpu else "native", "layers": args.layers,
              "rounds": args.rounds, "repeats": args.repeats, "window_ms": runs,
              "median_ms": {k: round(statistics.median(v), 3) for k, v in runs.items()}}
    for key, ms in report["median_ms"].items():
        print(f"{key:16s} {ms:8.3f} ms  (rounds: {', '.join(f'{x:.3f}' for x in runs[key])})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
