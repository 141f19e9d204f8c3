"""Serial decode speed right after a prefill, with the CPU prompt path in numpy's BLAS and in MLX's:
OpenBLAS threads that spin after the last product would slow the first steps (docs/benchmarks.md,
"CPU prefill through numpy's BLAS"). Demo model, float32, a 599-token prompt, then `--steps` greedy
one-token steps, the two modes alternating for `--rounds` rounds; medians of ms per step.

    python -m scripts.lab.decode_after_prefill             # 15 rounds of 24 steps, about a minute
"""

import argparse
import statistics
import time

import mlx.core as mx

from strata_cli.engine.window import WindowEngine
from strata_cli.model.host_blas import HostBlas
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = open_model(LoadOptions(model="demo", dtype="float32")).model
    ids = mx.random.randint(0, model.config.vocab_size, (600,), key=mx.random.key(0)).tolist()
    ms = {"numpy": [], "mlx": []}
    for _ in range(args.rounds):
        for mode in ms:
            HostBlas.mode = mode
            engine = WindowEngine(model)
            engine.prefill(ids[:-1])
            token, start = ids[-1], time.perf_counter()
            for _ in range(args.steps):
                out = engine.run([token], engine.length)
                engine.commit(1)
                token = int(out.logits[0].argmax().item())
            ms[mode].append((time.perf_counter() - start) / args.steps * 1e3)
    for mode, runs in ms.items():
        print(f"prompt BLAS {mode}: first {args.steps} steps after prefill, median {statistics.median(runs):.2f} ms/step "
              f"({', '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
