"""The matrix × rows kernels against MLX's matmuls at the 80B-A3B shapes: see strata_cli/bench/kernel_bench.py.

    python scripts/kernel_bench.py --out kernel_bench.json   # the GPU run, about a minute
    python scripts/kernel_bench.py --small                    # seconds, CPU: checks the script
"""

from strata_cli.bench.kernel_bench import main

if __name__ == "__main__":
    main()
