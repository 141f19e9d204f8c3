"""The decode-window attention kernel's warps a block and cells a split (issue 37): at T = 1 the
80B shape's window (16 query heads, 512 cells, D = 256) launches 16 blocks of 8 warps, each warp
taking 2 of the 16 32-cell chunks, and ncu at ba1cd33 timed it at 54 µs a layer for 0.5 MB of
keys and values, unmoved by loading ahead; at 4,096 cells and 8 rows MLX's sdpa took half its
time (H100 at 1c3c6e6), which views past SPLIT_CELLS may answer with splits and a combine.
WARPS and SPLIT_CELLS are the process's (a row's bits depend on them, never on T), so each pair
is a candidate default: kernel_bench's attention timings (R = 1, 2, 4, 8; MLX's sdpa beside
them) at each `--cells`, the settings (`WARPS/SPLIT`, "off": one kernel at any length)
alternating over `--rounds`, each record checked row-invariant; a table of median ms per
setting, cells and R.

    python -m scripts.lab.attention_warps --out attention_warps.json     # GPU, about a minute
    python -m scripts.lab.attention_warps --warps 8 --split-cells off,1024,512,256 --cells 512,4096,16384
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from metal_shaders import attention_window
from scripts.bench import kernel_bench as kb
from scripts.lab import mma_loop

OFF = 0  # SPLIT_CELLS: one kernel at every length


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", default="8,16", help="warps a block, each round in this order (at most 16: "
                        "98 registers a thread at D = 256)")
    parser.add_argument("--split-cells", default=str(attention_window.SPLIT_CELLS or "off"),
                        help="cells a split (multiples of 32; off: one kernel at any length), each round in this order")
    parser.add_argument("--cells", default="512,4096")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warps = [int(w) for w in args.warps.split(",")]
    if any(not 1 <= w <= 16 for w in warps):
        parser.error("--warps takes 1..16")
    splits = [OFF if c == "off" else int(c) if c.isdigit() and int(c) else -1 for c in args.split_cells.split(",")]
    if any(c < 0 or c % 32 for c in splits):
        parser.error(f"--split-cells takes multiples of 32 and off, got {args.split_cells!r}")
    settings = [(w, c) for w in warps for c in splits]
    label = {(w, c): f"{w}/{'off' if c == OFF else c}" for w, c in settings}
    if not attention_window.usable(mx.bfloat16):
        raise SystemExit(f"attention_warps: the kernel does not run here ({attention_window.status()})")
    default, records = (attention_window.WARPS, attention_window.SPLIT_CELLS), []
    try:
        for rnd in range(args.rounds):
            for setting in settings:
                attention_window.WARPS, attention_window.SPLIT_CELLS = setting
                for cells in (int(c) for c in args.cells.split(",")):
                    records += [{**r, "shape": f"{cells} cells", "setting": label[setting]} for r in kb.bench_attention(
                        "80b", 16, 2, 256, cells, use_kernel=True, repeats=args.repeats, inner=args.inner,
                        peak_gbs=4800.0)]
                print(f"round {rnd + 1}: {label[setting]} done", flush=True)
    finally:
        attention_window.WARPS, attention_window.SPLIT_CELLS = default
    columns = [label[s] for s in settings]
    rows = mma_loop.table(records, columns)
    mma_loop.show(rows, [*columns, "mlx"])
    return mma_loop.write_report(args.out, warps=warps, split_cells=["off" if c == OFF else c for c in splits],
                                 rounds=args.rounds, table=rows, records=records)


if __name__ == "__main__":
    main()
