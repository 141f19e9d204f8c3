"""strata against mlx-lm on an 80B-A3B-shaped 4-bit checkpoint: see strata_cli/bench/compare.py.

    python scripts/compare_mlx_lm.py --out compare.json     # the GPU run
    python scripts/compare_mlx_lm.py --tiny                  # seconds, CPU: checks the script
"""

from strata_cli.bench.compare import main

if __name__ == "__main__":
    main()
