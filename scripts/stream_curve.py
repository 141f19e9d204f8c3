"""Tokens/s against expert-cache size on a streamed checkpoint: see strata_cli/bench/stream_curve.py.

    python scripts/stream_curve.py --tiny                      # CPU, ~1 minute
    python scripts/stream_curve.py --preset gpu --dir /tmp/strata-stream --json-out gpu.json
    python scripts/stream_curve.py --model strata_cli/assets/demo --prompt-file examples/workloads/copy_edit.txt
"""

from strata_cli.bench.stream_curve import main

if __name__ == "__main__":
    main()
