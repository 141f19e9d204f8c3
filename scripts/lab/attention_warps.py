"""The decode-window attention kernel with more warps a block (issue 37): at T = 1 the 80B shape's
window (16 query heads, 512 cells, D = 256) launches 16 blocks of 8 warps, each warp taking 2 of
the 16 32-cell chunks, and ncu at ba1cd33 timed it at 54 µs a layer for 0.5 MB of keys and values,
unmoved by loading ahead. WARPS is the process's (a row's bits depend on it, never on T), so
each setting is a candidate default: kernel_bench's attention timings (R = 1, 2, 4, 8; MLX's
sdpa beside them) at 512 and 4,096 cells, the settings alternating over `--rounds`, each record
checked row-invariant; a table of median ms per setting, cells and R.

    python -m scripts.lab.attention_warps --out attention_warps.json     # GPU, about a minute
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from metal_shaders import attention_window
from scripts.bench import kernel_bench as kb
from scripts.lab import mma_loop


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", default="8,16", help="warps a block, each round in this order (at most 16: "
                        "98 registers a thread at D = 256)")
    parser.add_argument("--cells", default="512,4096")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    settings = [int(w) for w in args.warps.split(",")]
    if any(not 1 <= w <= 16 for w in settings):
        parser.error("--warps takes 1..16")
    if not attention_window.usable(mx.bfloat16):
        raise SystemExit(f"attention_warps: the kernel does not run here ({attention_window.status()})")
    default, records = attention_window.WARPS, []
    try:
        for rnd in range(args.rounds):
            for warps in settings:
                attention_window.WARPS = warps
                for cells in (int(c) for c in args.cells.split(",")):
                    records += [{**r, "shape": f"{cells} cells", "setting": str(warps)} for r in kb.bench_attention(
                        "80b", 16, 2, 256, cells, use_kernel=True, repeats=args.repeats, inner=args.inner,
                        peak_gbs=4800.0)]
                print(f"round {rnd + 1}: {warps} warps done", flush=True)
    finally:
        attention_window.WARPS = default
    columns = [str(w) for w in settings]
    rows = mma_loop.table(records, columns)
    mma_loop.show(rows, [*columns, "mlx"])
    return mma_loop.write_report(args.out, warps=settings, rounds=args.rounds, table=rows, records=records)


if __name__ == "__main__":
    main()
