"""Row invariance of the decode-window kernels: see strata_cli/bench/row_probe.py.

    python scripts/row_probe.py --out row_probe.json     # on the GPU machine
    python scripts/row_probe.py --small                  # seconds, CPU: checks the script
"""

from strata_cli.bench.row_probe import main

if __name__ == "__main__":
    main()
