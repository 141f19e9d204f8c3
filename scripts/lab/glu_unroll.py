"""The routed experts' GLU on its FMA form (the 80B's default since 4c4c4d5) under each unroll of
its lane loop and each count of output columns a warp (issue 37). At K = 2,048 a lane takes two
128-bit chunks of each of its weight rows (2 · COLS: gate and up); unrolling by 2 issued all
their loads first at 128 registers a thread, 4 (the default since 22ead51's loan) leaves the
loop rolled at 64. ncu at 97e7ee1 (H100): 98 / 445 µs of a T = 1 / T = 8 window, at one row
29% of DRAM's peak with 27% of warps active: 640 blocks of 4 warps (2 columns a warp, 64 blocks
a pick) are one thin wave. One column a warp doubles the blocks; four halves them and doubles
each lane's loads in flight. A setting is UNROLL or UNROLL/COLS (COLS: rows_matvec.GLU_COLS
where not given); neither moves a sum (the order is a function of K alone), so every setting
must give the default's bits: each record says so, and whether each row kept its 1-row bits.
The settings alternate over `--rounds`; a table gives each setting's median ms at R = 1 and 8
(MLX's two gather_qmm with the GLU beside).

    python -m scripts.lab.glu_unroll --out glu_unroll.json                # GPU, about a minute
    python -m scripts.lab.glu_unroll --settings 4/2,4/1,8/1,2/4 --out ...  # columns a warp too
    python -m scripts.lab.glu_unroll --ptxas                              # here, with nvcc: registers, occupancy
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from pathlib import Path

import mlx.core as mx

from metal_shaders import rows_matvec
from scripts.bench import kernel_bench as kb
from scripts.lab import kernel_emulate, mma_loop

SETTINGS = "2,4,1"


def parse(settings: str) -> list[tuple[str, int, int]]:
    """"U" or "U/C" items, comma-separated -> (label, UNROLL, columns a warp); ValueError if bad."""
    parsed = []
    for item in settings.split(","):
        unroll, _, cols = item.strip().partition("/")
        try:
            values = int(unroll), int(cols) if cols else rows_matvec.GLU_COLS
        except ValueError:
            raise ValueError(f"{item!r} is not UNROLL or UNROLL/COLS") from None
        if min(values) < 1 or values[1] & (values[1] - 1):
            raise ValueError(f"{item!r}: UNROLL is positive and COLS a power of two")
        parsed.append((item.strip(), *values))
    return parsed


def ptxas(settings: list[tuple[str, int, int]], workdir: Path) -> list[dict]:
    """The bfloat16 body at ROWS = 1 (one pick a block, as the 80B runs it) under each setting,
    compiled for sm_90: registers, machine instructions, spills, occupancy."""
    name, header, params, consts, body = next(w for w in kernel_emulate.cuda_wrappers() if w[0] == "gather_glu_r1_bf16")
    default_unroll = f"constexpr int UNROLL = {rows_matvec.GLU_UNROLL};"
    default_cols = f"constexpr int COLS = {2 * rows_matvec.GLU_COLS};"  # gate and up: two accumulators a column
    assert consts.count(default_unroll) == 1 and consts.count(default_cols) == 1
    rows = []
    for label, unroll, cols in settings:
        these = (consts.replace(default_unroll, f"constexpr int UNROLL = {unroll};")
                 .replace(default_cols, f"constexpr int COLS = {2 * cols};"))
        run, found = kernel_emulate.nvcc_compile(workdir / f"{name}_u{unroll}_c{cols}.cu", header, params, these, body,
                                                 count=True)
        if run.returncode or not found:
            raise SystemExit(f"glu_unroll: {label} does not compile:\n{run.stderr[-2000:]}")
        rows.append({"setting": label, "unroll": unroll, "cols": cols, **found,
                     **mma_loop.occupancy(found["registers"], rows_matvec.WARPS * 32)})
        print(f"{label}: {found['registers']} registers, {found['instructions']} instructions, "
              f"spills {found['spill_stores']}/"
              f"{found['spill_loads']} B, {rows[-1]['blocks_per_sm']} blocks / {rows[-1]['warps_per_sm']} warps an SM",
              flush=True)
    return rows


def bench(settings: list[tuple[str, int, int]], *, rounds: int, repeats: int, inner: int, K: int = 2048,
          N: int = 512, E: int = 512, top_k: int = 10) -> list[dict]:
    """Records of each setting at R = 1 and 8, alternating over `rounds`: ms of the FMA kernel and
    of MLX's calls, whether it kept each row's 1-row bits and the default setting's bits."""
    case, theirs, x8, picks = mma_loop.routed_glu_case(K, N, E=E, top_k=top_k)
    expected = case(x8, picks, tensor_cores=False)  # the default setting's bits
    mx.eval(expected)
    default, records = rows_matvec.GLU_UNROLL, []
    try:
        for rnd in range(rounds):
            for label, unroll, cols in settings:
                rows_matvec.GLU_UNROLL = unroll
                ours = partial(case, tensor_cores=False, cols=cols)
                alone = [ours(x8[r : r + 1], picks[r : r + 1]) for r in range(8)]
                for R in (1, 8):
                    x, experts = x8[:R], picks[:R]
                    together = ours(x, experts)
                    records.append({
                        "shape": "experts_glu", "K": K, "N": N, "R": R, "picks": R * top_k, "setting": label,
                        "identical_to_1_row": all(mx.array_equal(together[r], alone[r][0]).item() for r in range(R)),
                        "identical_to_default": mx.array_equal(together, expected[:R]).item(),
                        "ms": {"kernel": kb._median_ms(lambda: ours(x, experts), repeats=repeats, inner=inner),
                               "mlx": kb._median_ms(lambda: theirs(x, experts), repeats=repeats, inner=inner)}})
                print(f"round {rnd + 1}: {label} done", flush=True)
    finally:
        rows_matvec.GLU_UNROLL = default
    return records


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=SETTINGS,
                        help="UNROLL or UNROLL/COLS (output columns a warp) items, each round in this order")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--ptxas", action="store_true", help="compile each setting with nvcc here (no GPU): registers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        settings = parse(args.settings)
    except ValueError as e:
        parser.error(f"--settings: {e}")
    labels = [label for label, _, _ in settings]
    if args.ptxas:
        with tempfile.TemporaryDirectory(prefix="strata-glu-unroll-") as tmp:
            return mma_loop.write_report(args.out, settings=labels, ptxas=ptxas(settings, Path(tmp)))
    if mx.default_device() != mx.gpu:
        raise SystemExit("glu_unroll: times a GPU kernel; this machine runs MLX on its CPU")
    records = bench(settings, rounds=args.rounds, repeats=args.repeats, inner=args.inner)
    rows = mma_loop.table(records, labels)
    for row in rows:
        row["identical_to_default"] = all(r["identical_to_default"] for r in records if r["R"] == row["R"])
    mma_loop.show(rows, [*labels, "mlx"])
    same = all(r["identical_to_default"] for r in records)
    print("every setting gives the default's bits" if same else "A SETTING CHANGED THE BITS", flush=True)
    return mma_loop.write_report(args.out, settings=labels, rounds=args.rounds, table=rows, records=records)


if __name__ == "__main__":
    main()
