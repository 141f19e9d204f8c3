"""The routed experts' GLU on its FMA form (the 80B's default since 4c4c4d5) under each unroll of
its lane loop (issue 37). At K = 2,048 a lane takes two 128-bit chunks of each of its 4 weight
rows; unrolling by 2 issues all their loads first and costs 128 registers a thread (4 blocks an
SM), while 4 leaves the loop rolled at 64 (8 blocks). ncu at 6958ed6 (H100): 507 µs of a T = 8
window's 1,864, 42% of DRAM's peak, 23% of warps active. UNROLL is the process's and changes
when loads are issued, never the sum, so every setting must give the default's bits: each record
says so, and whether each row kept its 1-row bits. The settings alternate over `--rounds`; a
table gives each setting's median ms at R = 1 and 8 (MLX's two gather_qmm with the GLU beside).

    python -m scripts.lab.glu_unroll --out glu_unroll.json      # GPU, about a minute
    python -m scripts.lab.glu_unroll --ptxas                    # here, with nvcc: registers, occupancy
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


def ptxas(settings: list[int], workdir: Path) -> list[dict]:
    """The bfloat16 body at ROWS = 1 (one pick a block, as the 80B runs it) under each setting,
    compiled for sm_90: registers, machine instructions, spills, occupancy."""
    name, header, params, consts, body = next(w for w in kernel_emulate.cuda_wrappers() if w[0] == "gather_glu_r1_bf16")
    default = f"constexpr int UNROLL = {rows_matvec.GLU_UNROLL};"
    assert consts.count(default) == 1
    rows = []
    for unroll in settings:
        run, found = kernel_emulate.nvcc_compile(workdir / f"{name}_u{unroll}.cu", header, params,
                                                 consts.replace(default, f"constexpr int UNROLL = {unroll};"), body,
                                                 count=True)
        if run.returncode or not found:
            raise SystemExit(f"glu_unroll: UNROLL {unroll} does not compile:\n{run.stderr[-2000:]}")
        rows.append({"unroll": unroll, **found, **mma_loop.occupancy(found["registers"], rows_matvec.WARPS * 32)})
        print(f"UNROLL {unroll}: {found['registers']} registers, {found['instructions']} instructions, "
              f"spills {found['spill_stores']}/"
              f"{found['spill_loads']} B, {rows[-1]['blocks_per_sm']} blocks / {rows[-1]['warps_per_sm']} warps an SM",
              flush=True)
    return rows


def bench(settings: list[int], *, rounds: int, repeats: int, inner: int, K: int = 2048, N: int = 512, E: int = 512,
          top_k: int = 10) -> list[dict]:
    """Records of each setting at R = 1 and 8, alternating over `rounds`: ms of the FMA kernel and
    of MLX's calls, whether it kept each row's 1-row bits and the default setting's bits."""
    case, theirs, x8, picks = mma_loop.routed_glu_case(K, N, E=E, top_k=top_k)
    ours = partial(case, tensor_cores=False)
    expected = ours(x8, picks)  # the default setting's bits
    mx.eval(expected)
    default, records = rows_matvec.GLU_UNROLL, []
    try:
        for rnd in range(rounds):
            for unroll in settings:
                rows_matvec.GLU_UNROLL = unroll
                alone = [ours(x8[r : r + 1], picks[r : r + 1]) for r in range(8)]
                for R in (1, 8):
                    x, experts = x8[:R], picks[:R]
                    together = ours(x, experts)
                    records.append({
                        "shape": "experts_glu", "K": K, "N": N, "R": R, "picks": R * top_k, "setting": str(unroll),
                        "identical_to_1_row": all(mx.array_equal(together[r], alone[r][0]).item() for r in range(R)),
                        "identical_to_default": mx.array_equal(together, expected[:R]).item(),
                        "ms": {"kernel": kb._median_ms(lambda: ours(x, experts), repeats=repeats, inner=inner),
                               "mlx": kb._median_ms(lambda: theirs(x, experts), repeats=repeats, inner=inner)}})
                print(f"round {rnd + 1}: UNROLL {unroll} done", flush=True)
    finally:
        rows_matvec.GLU_UNROLL = default
    return records


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=SETTINGS, help="UNROLL values, each round in this order")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--ptxas", action="store_true", help="compile each setting with nvcc here (no GPU): registers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        settings = [int(u) for u in args.settings.split(",")]
    except ValueError:
        parser.error(f"--settings takes positive ints, got {args.settings!r}")
    if any(u < 1 for u in settings):
        parser.error(f"--settings takes positive ints, got {args.settings!r}")
    if args.ptxas:
        with tempfile.TemporaryDirectory(prefix="strata-glu-unroll-") as tmp:
            return mma_loop.write_report(args.out, settings=settings, ptxas=ptxas(settings, Path(tmp)))
    if mx.default_device() != mx.gpu:
        raise SystemExit("glu_unroll: times a GPU kernel; this machine runs MLX on its CPU")
    records = bench(settings, rounds=args.rounds, repeats=args.repeats, inner=args.inner)
    columns = [str(u) for u in settings]
    rows = mma_loop.table(records, columns)
    for row in rows:
        row["identical_to_default"] = all(r["identical_to_default"] for r in records if r["R"] == row["R"])
    mma_loop.show(rows, [*columns, "mlx"])
    same = all(r["identical_to_default"] for r in records)
    print("every setting gives the default's bits" if same else "A SETTING CHANGED THE BITS", flush=True)
    return mma_loop.write_report(args.out, settings=settings, rounds=args.rounds, table=rows, records=records)


if __name__ == "__main__":
    main()
