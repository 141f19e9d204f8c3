"""Prefill tok/s of strata and mlx-lm on the same weights: see strata_cli/bench/prefill.py.

    python scripts/prefill_bench.py                          # demo model, 3,000 tokens (CPU)
    python scripts/prefill_bench.py --synthetic 80b          # 8-layer 80B-A3B shape, 4-bit, 4,096 tokens (GPU)
"""

from strata_cli.bench.prefill import main

if __name__ == "__main__":
    main()
