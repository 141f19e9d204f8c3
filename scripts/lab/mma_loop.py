"""rows_mma's tensor-core kernels under each setting of their K loop, at the 80B-A3B shapes, R = 1
and 8 (issue 37: the routed experts' down projection at 8 rows cost 0.104 ms against MLX's 0.059
on the H200).

A setting is WARPS/SPLIT/UNROLL: warps a block; warps summing one 16-column tile's K (SPLIT = WARPS,
the plain forms' 4/4: one tile a block, the warps' partial sums added in warp order; SPLIT = 1,
the routed forms' since this study's run at ba1cd33: each warp its own tile over all of K, no
shared memory, a quarter of the blocks); steps a warp loads before it multiplies any (when loads
are issued, never the sum). SPLIT sets the sum's order (a function of K and the setting), so each
setting is checked row-invariant in every record. At K = 512 (the down projections) 4/4/1 gave
each warp one step, and 80 picks made 10,240 blocks of 128 threads, each reading 4 KB: too few
bytes in flight. A study sets both kinds (rows_mma.LOOPS) to each setting in turn. Each setting
runs kernel_bench's routed-expert and plain-shape timings (MLX's own calls beside them as the
baseline) and `experts_glu`, the routed gate and up joined as the 80B runs them (a row's 10 picks
sharing its x; the FMA form beat every setting for the gate alone at ba1cd33), the settings
alternating over `--rounds`; a table gives each setting's median ms per shape and R.

    python -m scripts.lab.mma_loop --out mma_loop.json     # GPU, about 6 minutes
    python -m scripts.lab.mma_loop --ptxas                 # here, with nvcc: registers, spills, occupancy

`--ptxas` compiles every form (affine plain, GLU, column-mapped, routed and routed GLU at 4 bits in groups of 64,
dense and routed MXFP4; bfloat16 rows) under each setting for sm_90 with nvcc, and prints
ptxas's registers and spills a thread and the blocks and warps an SM can hold at that count
(65,536 registers, 64 warps and 32 blocks an SM; registers allotted a warp in units of 256):
what bounds the loads in flight before any GPU runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path

import mlx.core as mx

from metal_shaders import rows_matvec, rows_mma
from scripts.bench import kernel_bench as kb
from scripts.lab.kernel_emulate import nvcc_compile
from strata_cli.bench.runner import git_commit

EXPERTS = {"experts_down": (512, 2048), "experts_gate": (2048, 512)}  # K, N; 512 experts, top-10
SHAPES = {"shared_down": (512, 2048), "o_proj/in_proj": (2048, 2048), "lm_head": (2048, 151936)}
SETTINGS = "4/4/1,4/4/4,4/1/1,4/1/4,2/1/4,8/8/1"


def parse(setting: str) -> tuple[int, int, int]:
    """"WARPS/SPLIT/UNROLL" -> the three ints (ValueError unless positive, SPLIT 1 or WARPS)."""
    values = setting.split("/")
    if len(values) != 3 or not all(v.isdigit() and int(v) > 0 for v in values) or values[1] not in ("1", values[0]):
        raise ValueError(f"a setting is WARPS/SPLIT/UNROLL with SPLIT 1 or WARPS, got {setting!r}")
    warps, split, unroll = (int(v) for v in values)
    return warps, split, unroll


def apply(setting: str, kind: str | None = None) -> None:
    """rows_mma's K loop of `kind` ("plain", "routed"; None: both) set to `setting` (read at each
    call: the template values and the grid)."""
    loop = rows_mma.Loop(*parse(setting))
    for k in [kind] if kind else list(rows_mma.LOOPS):
        if k not in rows_mma.LOOPS:
            raise ValueError(f"rows_mma's loops are {', '.join(rows_mma.LOOPS)}; got {k!r}")
        rows_mma.LOOPS[k] = loop


def routed_glu_case(K: int = 2048, N: int = 512, *, E: int = 512, top_k: int = 10):
    """The 80B's routed gate and up (4-bit, groups of 64), 8 rows of x and each row's top_k picks:
    (ours, theirs, x8, picks), where ours(x, experts, tensor_cores=True, **options) is
    rows_gather_glu_qmatvec (a row's picks sharing its x; options such as `cols` passed on) and
    theirs(x, experts) MLX's two gather_qmm with the GLU between (mlx-lm's SwitchGLU)."""
    keys = mx.random.split(mx.random.key(5), 4)
    gate, up = (mx.quantize((mx.random.normal((E, N, K), key=keys[i]) * K**-0.5).astype(mx.bfloat16), 64, 4)
                for i in (0, 1))
    picks = mx.argsort(mx.random.uniform(shape=(8, E), key=keys[2]), axis=-1)[:, :top_k].astype(mx.uint32)
    x8 = mx.random.normal((8, K), key=keys[3]).astype(mx.bfloat16)
    mx.eval(gate, up, picks, x8)

    def ours(x, experts, tensor_cores=True, **options):
        return rows_matvec.rows_gather_glu_qmatvec(x, gate, up, experts.reshape(-1), group_size=64, bits=4,
                                                   tensor_cores=tensor_cores, **options)

    def theirs(x, experts):
        g, u = (mx.gather_qmm(x[:, None, None, :], *w, rhs_indices=experts, transpose=True, group_size=64, bits=4)
                for w in (gate, up))
        return g * mx.sigmoid(g) * u

    return ours, theirs, x8, picks


def bench_routed_glu(K: int = 2048, N: int = 512, *, E: int = 512, top_k: int = 10, repeats: int,
                     inner: int) -> list[dict]:
    """`routed_glu_case` at R = 1 and 8: the kernel under the current setting, its FMA form, and
    MLX's calls."""
    ours, theirs, x8, picks = routed_glu_case(K, N, E=E, top_k=top_k)
    alone = [ours(x8[r : r + 1], picks[r : r + 1]) for r in range(8)]
    records = []
    for R in (1, 8):
        x, experts = x8[:R], picks[:R]
        together = ours(x, experts)
        identical = all(mx.array_equal(together[r], alone[r][0]).item() for r in range(R))
        times = {name: kb._median_ms(lambda f=f: f(x, experts), repeats=repeats, inner=inner)
                 for name, f in (("kernel", ours), ("mlx", theirs), ("fma", partial(ours, tensor_cores=False)))}
        records.append({"shape": "experts_glu", "K": K, "N": N, "R": R, "picks": R * top_k,
                        "identical_to_1_row": identical, "ms": times})
    return records


def one_setting(setting: str, *, repeats: int, inner: int) -> list[dict]:
    apply(setting)
    records = []
    for name, (K, N) in EXPERTS.items():
        records += kb.bench_experts(name, 512, K, N, 10, use_kernel=True, repeats=repeats, inner=inner,
                                    peak_gbs=4800.0)
    records += bench_routed_glu(repeats=repeats, inner=inner)
    for name, (K, N) in SHAPES.items():
        records += kb.bench_shape(name, K, N, use_kernel=True, repeats=repeats, inner=inner, peak_gbs=4800.0, cols=())
    return [{**r, "setting": setting} for r in records if r["R"] in (1, 8) and "mlx" in r["ms"]]


def occupancy(registers: int, threads: int) -> dict:
    """Blocks and warps one sm_90 SM holds for a kernel of `registers` a thread and `threads` a
    block (registers and warps only; shared memory here is at most 2 KB a block)."""
    warps = threads // 32
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(65536 // (per_warp * warps), 64 // warps, 32)
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps}


def ptxas(settings: list[str], workdir: Path) -> list[dict]:
    """Each body under each setting, compiled for sm_90: registers, spills, occupancy."""
    bf16 = "const __nv_bfloat16*"
    affine = {"dims": "const int32_t*", "x": bf16, "w": "const uint32_t*", "scales": bf16, "biases": bf16}
    routed = {**affine, "idx": "const uint32_t*"}
    forms = {"QUANTIZED": affine, "GATHER_QUANTIZED": routed,
             "GATHER_QUANTIZED_GLU": {**routed, "w_up": "const uint32_t*", "scales_up": bf16, "biases_up": bf16},
             "QUANTIZED_GLU": {**affine, "w_up": "const uint32_t*", "scales_up": bf16, "biases_up": bf16},
             "QUANTIZED_MAPPED": {**affine, "col_map": "const uint32_t*"},
             "DENSE": {"dims": "const int32_t*", "x": bf16, "w": bf16},
             "DENSE_MAPPED": {"dims": "const int32_t*", "x": bf16, "w": bf16, "col_map": "const uint32_t*"},
             "GATHER_MXFP4": {**routed, "scales": "const uint8_t*", "biases": None}}
    rows = []
    for setting in settings:
        warps, split, unroll = parse(setting)
        for form, inputs in forms.items():
            args = [f"{t} {n}" for n, t in inputs.items() if t] + ["__nv_bfloat16* out"]
            consts = ("using T = __nv_bfloat16; using TS = __nv_bfloat16; using TI = uint32_t; "
                      "constexpr int BITS = 4; constexpr int GS = 64; constexpr int SHARE = 1; "
                      f"constexpr bool PICKS_X = false; constexpr int WARPS = {warps}; constexpr int SPLIT = {split}; "
                      f"constexpr int UNROLL = {unroll};")
            run, found = nvcc_compile(workdir / f"{form}_{setting.replace('/', '_')}.cu", rows_mma.header(), args,
                                      consts, getattr(rows_mma, form))
            if run.returncode or not found:
                raise SystemExit(f"mma_loop: {form} at {setting} does not compile:\n{run.stderr[-2000:]}")
            rows.append({"setting": setting, "form": form, **found, **occupancy(found["registers"], warps * 32)})
            print(f"{setting:7s} {form:22s} {found['registers']:4d} registers, spills {found['spill_stores']}/"
                  f"{found['spill_loads']} B, {rows[-1]['blocks_per_sm']:2d} blocks / {rows[-1]['warps_per_sm']:2d} "
                  "warps an SM", flush=True)
    return rows


def table(records: list[dict], settings: list[str]) -> list[dict]:
    """Per (shape, R): the median ms of each setting's kernel, of MLX's call and (where timed) of
    the FMA form, and whether every record kept each row its 1-row call's bits."""
    cells = defaultdict(list)
    for r in records:
        cells[r["shape"], r["R"], r["setting"]].append(r["ms"]["kernel"])
        for other in ("mlx", "fma"):
            if other in r["ms"]:
                cells[r["shape"], r["R"], other].append(r["ms"][other])
    rows = []
    for shape, R in dict.fromkeys((r["shape"], r["R"]) for r in records):
        row = {"shape": shape, "R": R}
        for key in [*settings, "fma", "mlx"]:
            if cells[shape, R, key]:
                row[key] = statistics.median(cells[shape, R, key])
        row["identical_to_1_row"] = all(r["identical_to_1_row"] for r in records if (r["shape"], r["R"]) == (shape, R))
        rows.append(row)
    return rows


def show(rows: list[dict], columns: list[str]) -> None:
    """`table`'s rows as text: shape, R, each column's ms, whether rows kept their 1-row bits."""
    print(f"{'shape':16s} {'R':>2s} " + " ".join(f"{c:>7s}" for c in columns) + " same")
    for row in rows:
        print(f"{row['shape']:16s} {row['R']:2d} " + " ".join(f"{row.get(c, float('nan')):7.4f}" for c in columns)
              + f" {row['identical_to_1_row']}")


def write_report(out: Path | None, **fields) -> dict:
    """A study's record: the tree, device and MLX version, then `fields`; written to `out` as JSON."""
    report = {"commit": git_commit(), "device": str(mx.default_device()), "mlx": mx.__version__, **fields}
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=SETTINGS,
                        help="WARPS/SPLIT/UNROLL settings, each round in this order (SPLIT is 1 or WARPS)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--ptxas", action="store_true", help="compile each setting with nvcc here (no GPU): registers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    for setting in settings:
        try:
            parse(setting)
        except ValueError as e:
            parser.error(str(e))
    if args.ptxas:
        with tempfile.TemporaryDirectory(prefix="strata-mma-loop-") as tmp:
            report = {"settings": settings, "ptxas": ptxas(settings, Path(tmp))}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        return report
    if not rows_mma.usable():
        raise SystemExit(f"mma_loop: the tensor-core kernels do not run here ({rows_mma.status()})")
    records = []
    default = dict(rows_mma.LOOPS)
    try:
        for rnd in range(args.rounds):
            for setting in settings:
                records += one_setting(setting, repeats=args.repeats, inner=args.inner)
                print(f"round {rnd + 1}: {setting} done", flush=True)
    finally:
        rows_mma.LOOPS.update(default)
    rows = table(records, settings)
    show(rows, [*settings, "fma", "mlx"])
    return write_report(args.out, settings=settings, rounds=args.rounds, table=rows, records=records)


if __name__ == "__main__":
    main()
