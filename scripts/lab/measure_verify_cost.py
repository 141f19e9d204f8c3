"""What checking weights adds to opening a model (issue 17): medians of `load_checkpoint` and of
the sha256 verification inside it, in one run.

    python -m scripts.lab.measure_verify_cost --model demo --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

from strata_cli.integrity import verify_files
from strata_cli.model.loader import weight_files
from strata_cli.runtime import load_checkpoint, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    names = [str(f.relative_to(path)) for f in weight_files(path)]
    load, verify = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        load_checkpoint(path)
        load.append(time.perf_counter() - t)
        t = time.perf_counter()
        verify_files(path, names)
        verify.append(time.perf_counter() - t)
    lm, vm = statistics.median(load), statistics.median(verify)
    size = sum((path / n).stat().st_size for n in names)
    print(f"{path}: {size / 1e6:.1f} MB of weights; load_checkpoint median {lm * 1000:.1f} ms "
          f"(verification included), verification alone {vm * 1000:.1f} ms = {vm / lm:.0%} of the load; "
          f"without it ~{(lm - vm) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
