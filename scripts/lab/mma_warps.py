"""rows_mma's tensor-core kernels with their K loop split over 1, 2, 4 (the default) or 8 warps a
block, at the 80B-A3B shapes, R = 1 and 8 (issue 37: the routed experts' down projection at 8 rows
cost 0.104 ms against MLX's 0.059 on the H200).

A block's WARPS warps take every WARPS-th step of K and add their partial sums in warp order, so
WARPS changes the sum's order (a function of K and WARPS alone: each setting is row-invariant,
which every record checks) and the block count: at K = 512 (the down projections) each of 4
warps does one step, and 80 picks make 10,240 blocks of 128 threads. Each setting runs
kernel_bench's routed-expert and plain-shape timings (MLX's own calls beside them as the
baseline), the settings alternating over `--rounds`; a table gives each setting's median ms per
shape and R.

    python -m scripts.lab.mma_warps --out mma_warps.json     # GPU, a few minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from metal_shaders import rows_mma
from scripts.bench import kernel_bench as kb

EXPERTS = {"experts_down": (512, 2048), "experts_gate": (2048, 512)}  # K, N; 512 experts, top-10
SHAPES = {"shared_down": (512, 2048), "o_proj/in_proj": (2048, 2048), "q_proj": (2048, 4096),
          "lm_head": (2048, 151936)}


def one_setting(warps: int, *, repeats: int, inner: int) -> list[dict]:
    rows_mma.WARPS = warps  # read at each call: the template value and the grid
    records = []
    for name, (K, N) in EXPERTS.items():
        records += kb.bench_experts(name, 512, K, N, 10, use_kernel=True, repeats=repeats, inner=inner,
                                    peak_gbs=4800.0)
    for name, (K, N) in SHAPES.items():
        records += kb.bench_shape(name, K, N, use_kernel=True, repeats=repeats, inner=inner, peak_gbs=4800.0, cols=())
    return [{**r, "warps": warps} for r in records if r["R"] in (1, 8) and "mlx" in r["ms"]]


def table(records: list[dict], settings: list[int]) -> list[dict]:
    cells = defaultdict(list)
    for r in records:
        cells[r["shape"], r["R"], r["warps"]].append(r["ms"]["kernel"])
        cells[r["shape"], r["R"], "mlx"].append(r["ms"]["mlx"])
        cells[r["shape"], r["R"], "fma"].append(r["ms"].get("fma", float("nan")))
    rows = []
    for shape, R in dict.fromkeys((r["shape"], r["R"]) for r in records):
        row = {"shape": shape, "R": R}
        for key in [*settings, "fma", "mlx"]:
            row[str(key)] = statistics.median(cells[shape, R, key])
        row["identical_to_1_row"] = all(r["identical_to_1_row"] for r in records if (r["shape"], r["R"]) == (shape, R))
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", default="4,1,2,8", help="settings, each round in this order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not rows_mma.usable():
        raise SystemExit(f"mma_warps: the tensor-core kernels do not run here ({rows_mma.status()})")
    settings = [int(w) for w in args.warps.split(",")]
    records = []
    for rnd in range(args.rounds):
        for warps in settings:
            records += one_setting(warps, repeats=args.repeats, inner=args.inner)
            print(f"round {rnd + 1}: WARPS {warps} done", flush=True)
    rows = table(records, settings)
    head = f"{'shape':16s} {'R':>2s} " + " ".join(f"{'w' + str(s):>7s}" for s in settings) + f" {'fma':>7s} {'mlx':>7s} same"
    print(head)
    for row in rows:
        print(f"{row['shape']:16s} {row['R']:2d} " + " ".join(f"{row[str(s)]:7.4f}" for s in [*settings, 'fma', 'mlx'])
              + f" {row['identical_to_1_row']}")
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "settings": settings, "rounds": args.rounds,
              "table": rows, "records": records}
    try:
        from strata_cli.bench.runner import git_commit
        report["commit"] = git_commit()
    except Exception:
        pass
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
