"""Cost a bench run's windows on a fixed window-cost curve: a noise-free view of the modes' ratios.

On a shared machine wall-clock ratios of medians move by more than the bars they test. This
reads `strata bench --out` JSON, costs every run's windows (its `window_T_histogram`) on a fixed
curve of milliseconds per T, and prints each auto mode against serial and the best fixed N. It
models window compute only (the loop's own work is left out): a check of the choices auto made,
not a measurement.

    python -m scripts.bench.bench_modelled docs/runs/bench_cpu_auto_issue16.json
    python -m scripts.bench.bench_modelled bench.json --curve-ms 4.4,4.9,5.3,5.7,6.2,6.6,7.0,7.5
"""

from __future__ import annotations

import argparse
import json
import statistics

QUIET_CPU_MS = "10.8,15.5,18.7,23.9,28.1,35.3,41.3,43.5"  # docs/benchmarks.md, quiet CPU, T = 1..8


def modelled_rates(workload: dict, curve_ms: list[float]) -> dict[str, float]:
    """Median modelled tokens/s per mode."""
    rates = {}
    for mode in workload["modes"]:
        runs = [r for r in mode["runs"] if "window_T_histogram" in r.get("stats", {})]
        if runs:
            rates[mode["mode"]] = statistics.median(
                1000 * r["tokens"] / sum(curve_ms[int(T) - 1] * n for T, n in r["stats"]["window_T_histogram"].items())
                for r in runs)
    return rates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json")
    parser.add_argument("--curve-ms", default=QUIET_CPU_MS, help="window ms for T = 1, 2, ... (default: quiet CPU)")
    args = parser.parse_args(argv)
    curve = [float(x) for x in args.curve_ms.split(",")]
    data = json.load(open(args.bench_json))
    print("| workload | mode | auto / serial (modelled) | auto / best fixed (modelled) |")
    print("|---|---|---|---|")
    for workload in data["workloads"]:
        rates = modelled_rates(workload, curve)
        fixed = [m for m in rates if m.isdigit()]
        best = max(fixed, key=rates.get) if fixed else None
        for mode in (m for m in rates if m.startswith("auto")):
            vs_serial = f"{rates[mode] / rates['serial']:.3f}" if "serial" in rates else "-"
            vs_best = f"{rates[mode] / rates[best]:.3f} ({best})" if best else "-"
            print(f"| {workload['name']} | {mode} | {vs_serial} | {vs_best} |")


if __name__ == "__main__":
    main()
