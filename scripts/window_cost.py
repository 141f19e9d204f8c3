"""Window cost against T on a Qwen3-Next-80B-A3B-shaped model: see strata_cli/bench/window_cost.py.

    python scripts/window_cost.py --out window_cost.json    # the GPU run (MLX CUDA or Metal)
    python scripts/window_cost.py --tiny                     # a seconds-long CPU check
"""

from strata_cli.bench.window_cost import main

if __name__ == "__main__":
    main()
