"""The matrix × rows kernels against MLX's own matmuls, at the 80B-A3B shapes, one row count at a time.

For each weight shape (K = 2048 into N = 2048, 4096, 512 and the 151,936-column lm_head; 4-bit,
group size 64, bfloat16 rows) and R = 1, 2, 4, 8 rows this times, in one run:

- `kernel`: `rows_qmatvec` on the R rows (the path strata's windows take on CUDA: at bfloat16
  rows_mma's tensor-core form where its probe passed);
- `fma`: `rows_qmatvec(tensor_cores=False)`, rows_matvec's own FMA form (with the kernels only);
- `mlx`: `mx.quantized_matmul` on the same R rows in one call (MLX's qmv at R = 1: mlx-lm's path);
- `split`: `mx.quantized_matmul` once per row (strata's fallback where the kernel cannot run);

and for the routed experts (512 experts of 512 × 2048 and 2048 × 512, top-10 picks per row,
random routing) `rows_gather_qmatvec` against MLX's unsorted `gather_qmm` on the same picks;
and the GDN decode window (Qwen3-Next-80B's heads: Hk 16, Hv 32, Dk = Dv = 128, conv kernel 4):
`gdn_prepare` + `gdn_scan` (metal_shaders/gdn_window.py) against the MLX ops the layer runs
without them (its references: conv, silu, l2norms, gating, the per-row scan); its "GB/s" counts
the recurrent state read and written; the Mamba-2 decode window (Nemotron-3-Nano-30B-A3B's
heads: H 64, P 64, G 8, N 128, conv kernel 4): `mamba2_prepare` + `mamba2_scan`
(metal_shaders/mamba2_window.py) against the layer's MLX ops (its references), "GB/s" as for
GDN (`kernel_over_mlx` < 1 is where the kernels pay); and a decode window's attention (80B heads: Hq 16, Hkv 2,
D 256; 512 and 16,384 cached cells): `attention_window` (metal_shaders/attention_window.py)
against MLX's sdpa in one causal call (`mlx`, mlx-lm's path) and once per row (`split`, strata's
path without the kernel); its "GB/s" counts the keys and values read. Each the median of
`--repeats` samples after a warm-up, a sample being `--inner` back-to-back calls under one
`mx.eval`, divided by `--inner` (so launch latency overlaps as it does in a decode step). It also checks that each row of the R-row call equals that row's 1-row call bit
for bit, and the largest difference from the float32 reference; and writes the weight bytes
read per second (and the share of `--peak-gbs`, 4,800 GB/s for an H200's HBM3e).

On the CPU the kernels do not run: `kernel` is the reference path callers take there, and the
shapes shrink (`--small`, implied) so the run takes seconds; it checks the script, not speed.

    python -m scripts.bench.kernel_bench --out kernel_bench.json  # the GPU run, about a minute
    python -m scripts.bench.kernel_bench --small                  # seconds, CPU: checks the script

`--mxfp4` times only GPT-OSS-20B's MXFP4 routed experts (K 2880 into the fused gate_up's 5,760
columns and down's 2,880; 32 experts, top-4 random picks per row, bfloat16 rows): every setting
of `rows_gather_mxfp4matvec` (`decode` f16 / lut / bits, `cols` 2 / 4 / 8, `share` 1 / 2 / 4 / 8,
`order` picks / columns; one changed at a time from the default; then rows_mma's tensor-core form at `share` 1 and 8) against MLX's `gather_qmm(mode="mxfp4")` at R = 1, 2, 4, 8, each R-row call checked bit for bit
against its rows' 1-row calls and against the default setting; its last table sums gate_up and
down per setting and R (the layer's expert time), which decides the default.

    python -m scripts.bench.kernel_bench --mxfp4 --out kernel_bench_mxfp4.json  # GPU, under 2 minutes

`--dense` times only GPT-OSS-20B's bfloat16 linears (stacked q/k/v, o_proj, the router and the
201,088-column head, 1.16 GB a step): `rows_matvec` against MLX's own matmul (mlx-lm's gemv at
one row). strata's one-row window on GPT-OSS is 9% slower than mlx-lm's step while its op count
is lower (docs/families.md); the head is the largest read of a step, so this says whether the
dense kernel is the gap.

    python -m scripts.bench.kernel_bench --dense --out kernel_bench_dense.json  # GPU, about a minute

`--butterfly-tail` gives the matrix kernels the tail they had before their reduce-scatter (the same
bits; every value summed by its own xor butterfly): two processes, with and without it, alternating
on one machine, time the change.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from metal_shaders import attention_window, gdn_window, mamba2_window
from metal_shaders import rows_matvec as kernels

ROWS = (1, 2, 4, 8)
SHAPES = {"q_proj": (2048, 4096), "o_proj/in_proj": (2048, 2048), "shared_expert": (2048, 512),
          "lm_head": (2048, 151936)}  # name: (K, N)
SMALL_SHAPES = {"a": (256, 512), "b": (256, 256), "c": (256, 64), "lm_head": (256, 1000)}
# GPT-OSS-20B's dense linears, bfloat16 as published: q, k and v stacked (64 + 2 × 8 heads of 64),
# the output projection, the router and the 201,088-column head (1.16 GB read a step).
GPT_OSS_DENSE = {"gpt_oss_qkv": (2880, 5120), "gpt_oss_o_proj": (4096, 2880), "gpt_oss_router": (2880, 32),
                 "gpt_oss_lm_head": (2880, 201088)}
SMALL_GPT_OSS_DENSE = {"gpt_oss_qkv": (256, 320), "gpt_oss_lm_head": (256, 2000)}
BITS, GROUP_SIZE = 4, 64


def _median_ms(fn, *, repeats: int, inner: int) -> float:
    mx.eval([fn() for _ in range(inner)])
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        samples.append((time.perf_counter() - start) / inner)
    return 1000 * statistics.median(samples)


def bench_shape(name: str, K: int, N: int, *, use_kernel: bool, repeats: int, inner: int, peak_gbs: float,
                cols: tuple[int, ...], seed: int = 0, dense: bool = False) -> list[dict]:
    """One weight shape, 4-bit (or bfloat16 with `dense`): a record per row count (and per extra
    columns-per-warp setting)."""
    w = (mx.random.normal((N, K), key=mx.random.key(seed)) * K**-0.5).astype(mx.bfloat16)
    x8 = mx.random.normal((max(ROWS), K), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    if dense:
        mx.eval(w, x8)
        weight_bytes = w.nbytes

        def ours(x, c=kernels.COLS, tensor_cores=True):
            if use_kernel:
                return kernels.rows_matvec(x, w, cols=c, tensor_cores=tensor_cores)
            return kernels.reference_matvec(x, w)

        def theirs(x):
            return x @ w.T  # MLX's own matmul (gemv at one row): mlx-lm's path

        expected = kernels.reference_matvec(x8.astype(mx.float32), w)
    else:
        qw, qs, qb = mx.quantize(w, GROUP_SIZE, BITS)
        del w
        mx.eval(qw, qs, qb, x8)
        weight_bytes = qw.nbytes + qs.nbytes + qb.nbytes

        def ours(x, c=kernels.COLS, tensor_cores=True):
            if use_kernel:
                return kernels.rows_qmatvec(x, qw, qs, qb, group_size=GROUP_SIZE, bits=BITS, cols=c,
                                            tensor_cores=tensor_cores)
            return kernels.reference_qmatvec(x, qw, qs, qb, group_size=GROUP_SIZE, bits=BITS)

        def theirs(x):
            return mx.quantized_matmul(x, qw, qs, qb, transpose=True, group_size=GROUP_SIZE, bits=BITS)

        expected = kernels.reference_qmatvec(x8.astype(mx.float32), qw, qs, qb, group_size=GROUP_SIZE, bits=BITS)
    alone = [ours(x8[i : i + 1]) for i in range(max(ROWS))]
    mx.eval(alone, expected)
    records = []
    for R in ROWS:
        x = x8[:R]
        together = ours(x)
        mlx_out = theirs(x)
        mx.eval(together, mlx_out)
        identical = all(mx.array_equal(together[i : i + 1], alone[i]).item() for i in range(R))
        diff = mx.abs(together.astype(mx.float32) - expected[:R]).max().item()
        mlx_diff = mx.abs(mlx_out.astype(mx.float32) - expected[:R]).max().item()
        times = {"kernel": _median_ms(lambda x=x: ours(x), repeats=repeats, inner=inner),
                 "mlx": _median_ms(lambda x=x: theirs(x), repeats=repeats, inner=inner),
                 "split": _median_ms(lambda x=x, R=R: [theirs(x[i : i + 1]) for i in range(R)],
                                     repeats=repeats, inner=inner)}
        if use_kernel:  # rows_matvec's own FMA form, where `kernel` is rows_mma's
            times["fma"] = _median_ms(lambda x=x: ours(x, tensor_cores=False), repeats=repeats, inner=inner)
        gbs = weight_bytes / (times["kernel"] / 1000) / 1e9
        records.append({"shape": name, "K": K, "N": N, "R": R, "cols": kernels.COLS,
                        "identical_to_1_row": identical, "max_abs_diff": diff, "mlx_max_abs_diff": mlx_diff,
                        "ms": times, "kernel_over_mlx": times["kernel"] / times["mlx"],
                        "weight_gbs": gbs, "of_peak": gbs / peak_gbs})
        for c in cols if use_kernel and R in (1, max(ROWS)) else ():
            ms = _median_ms(lambda x=x, c=c: ours(x, c, False), repeats=repeats, inner=inner)
            out = ours(x, c, False)
            same = mx.array_equal(out, ours(x, kernels.COLS, False)).item()
            records.append({"shape": name, "K": K, "N": N, "R": R, "cols": c, "ms": {"kernel": ms},
                            "identical_to_default_cols": same, "weight_gbs": weight_bytes / (ms / 1000) / 1e9})
    return records


def bench_experts(name: str, E: int, K: int, N: int, top_k: int, *, use_kernel: bool, repeats: int, inner: int,
                  peak_gbs: float, cols: tuple[int, ...] = (), seed: int = 0) -> list[dict]:
    """Routed experts: R rows × top_k picks each through E stacked (N, K) experts, against MLX's
    unsorted `gather_qmm` (what strata runs without the kernel, and mlx-lm below 64 picks). At
    R = 8 the kernel is also timed with up to 8 picks of an expert in a block (`share` 8; the
    same bits) and the FMA form with the extra `cols` settings (each checked to give its
    default's bits)."""
    w = (mx.random.normal((E, N, K), key=mx.random.key(seed)) * K**-0.5).astype(mx.bfloat16)
    qw, qs, qb = mx.quantize(w, GROUP_SIZE, BITS)
    del w
    R8 = max(ROWS)
    picks = mx.argsort(mx.random.uniform(shape=(R8, E), key=mx.random.key(seed + 2)), axis=-1)[:, :top_k]
    flat8 = picks.astype(mx.uint32).reshape(-1)
    x8 = mx.random.normal((R8 * top_k, K), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    mx.eval(qw, qs, qb, flat8, x8)
    per_expert = (qw.nbytes + qs.nbytes + qb.nbytes) / E

    def ours(x, experts, **setting):
        if use_kernel:
            return kernels.rows_gather_qmatvec(x, qw, qs, qb, experts, group_size=GROUP_SIZE, bits=BITS, **setting)
        return kernels.reference_gather_qmatvec(x, qw, qs, qb, experts, group_size=GROUP_SIZE, bits=BITS)

    def theirs(x, experts):
        return mx.gather_qmm(x[:, None, :], qw, qs, qb, rhs_indices=experts, transpose=True,
                             group_size=GROUP_SIZE, bits=BITS)

    alone = [ours(x8[i * top_k : (i + 1) * top_k], flat8[i * top_k : (i + 1) * top_k]) for i in range(R8)]
    expected = kernels.reference_gather_qmatvec(x8.astype(mx.float32), qw, qs, qb, flat8, group_size=GROUP_SIZE,
                                                bits=BITS)
    mx.eval(alone, expected)
    records = []
    for R in ROWS:
        M = R * top_k
        x, flat = x8[:M], flat8[:M]
        together = ours(x, flat)
        mx.eval(together)
        identical = all(mx.array_equal(together[i * top_k : (i + 1) * top_k], alone[i]).item() for i in range(R))
        diff = mx.abs(together.astype(mx.float32) - expected[:M]).max().item()
        times = {"kernel": _median_ms(lambda x=x, f=flat: ours(x, f), repeats=repeats, inner=inner),
                 "mlx": _median_ms(lambda x=x, f=flat: theirs(x, f), repeats=repeats, inner=inner)}
        if use_kernel:
            times["fma"] = _median_ms(lambda x=x, f=flat: ours(x, f, tensor_cores=False), repeats=repeats, inner=inner)
        unique = len(set(flat.tolist()))
        gbs = unique * per_expert / (times["kernel"] / 1000) / 1e9
        records.append({"shape": name, "K": K, "N": N, "R": R, "cols": kernels.COLS, "picks": M,
                        "unique_experts": unique, "identical_to_1_row": identical, "max_abs_diff": diff,
                        "ms": times, "kernel_over_mlx": times["kernel"] / times["mlx"],
                        "weight_gbs": gbs, "of_peak": gbs / peak_gbs})
    settings = [{"share": 8}, *({"cols": c, "tensor_cores": False} for c in cols)] if use_kernel else []
    fma = ours(x8, flat8, tensor_cores=False) if use_kernel else together
    for setting in settings:
        other = ours(x8, flat8, **setting)
        ms = _median_ms(lambda: ours(x8, flat8, **setting), repeats=repeats, inner=inner)
        records.append({"shape": name + ("/share8" if "share" in setting else ""), "K": K, "N": N, "R": R8,
                        "cols": setting.get("cols", kernels.COLS), "picks": R8 * top_k, "ms": {"kernel": ms},
                        "weight_gbs": unique * per_expert / (ms / 1000) / 1e9,
                        "identical_to_default_cols": mx.array_equal(other, fma if "cols" in setting else together).item()})
    return records


# GPT-OSS-20B's routed experts (32 experts, top-4, MXFP4: group 32, e8m0 scales): name: (K, N),
# gate and up fused as one (2 · 2880)-column matrix, as the model runs them.
GPT_OSS_EXPERTS = {"gate_up": (2880, 5760), "down": (2880, 2880)}
SMALL_GPT_OSS_EXPERTS = {"gate_up": (128, 96), "down": (64, 128)}


def mxfp4_variants() -> list[dict]:
    """The MXFP4 kernel's settings timed by `--mxfp4`, the default first, then one setting
    changed at a time: each other decode form, 2 and 8 columns, `share` 2, 4, 8, the other grid
    order."""
    default = {"decode": "f16", "cols": kernels.COLS, "share": 1, "order": "picks", "tensor_cores": False}
    others = [{**default, "decode": d} for d in kernels.MXFP4_DECODES if d != default["decode"]]
    others += [{**default, "cols": c} for c in (2, 8)] + [{**default, "share": s} for s in (2, 4, 8)]
    others += [{**default, "order": o} for o in kernels.MXFP4_ORDERS if o != default["order"]]
    mma = [{**default, "tensor_cores": True}, {**default, "tensor_cores": True, "share": 8}]
    return [default, *others, *mma]


def variant_name(setting: dict) -> str:
    if setting.get("tensor_cores"):
        return f"mma/share{setting['share']}/{setting['order']}"
    return f"{setting['decode']}/cols{setting['cols']}/share{setting['share']}/{setting['order']}"


def bench_mxfp4(name: str, E: int, K: int, N: int, top_k: int, *, use_kernel: bool, repeats: int, inner: int,
                peak_gbs: float, seed: int = 0) -> list[dict]:
    """GPT-OSS's MXFP4 routed experts: R rows x top_k random picks each through E stacked (N, K)
    experts, every setting of `mxfp4_variants` against MLX's unsorted `gather_qmm(mode="mxfp4")`
    on the same picks (mlx-lm's call: its gather_qmv below 8 picks, a tiled GEMM from 8).
    Per setting and R: whether each row's picks equal that row's 1-row call of the same setting
    bit for bit, whether the call equals the default setting's bits, and the largest
    difference from the float32 reference."""
    w = (mx.random.normal((E, N, K), key=mx.random.key(seed)) * K**-0.5).astype(mx.bfloat16)
    qw, qs = mx.quantize(w, 32, 4, mode="mxfp4")
    del w
    R8 = max(ROWS)
    picks = mx.argsort(mx.random.uniform(shape=(R8, E), key=mx.random.key(seed + 2)), axis=-1)[:, :top_k]
    flat8 = picks.astype(mx.uint32).reshape(-1)
    x8 = mx.random.normal((R8 * top_k, K), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    mx.eval(qw, qs, flat8, x8)
    per_expert = (qw.nbytes + qs.nbytes) / E

    def ours(x, experts, setting):
        if use_kernel:
            return kernels.rows_gather_mxfp4matvec(x, qw, qs, experts, **setting)
        return kernels.reference_gather_mxfp4matvec(x, qw, qs, experts)

    def theirs(x, experts):
        return mx.gather_qmm(x[:, None, :], qw, qs, None, rhs_indices=experts, transpose=True, group_size=32,
                             bits=4, mode="mxfp4")

    expected = kernels.reference_gather_mxfp4matvec(x8.astype(mx.float32), qw, qs, flat8)
    mx.eval(expected)
    records, defaults, mlx_ms = [], {}, {}
    for setting in mxfp4_variants():
        alone = [ours(x8[i * top_k : (i + 1) * top_k], flat8[i * top_k : (i + 1) * top_k], setting)
                 for i in range(R8)]
        mx.eval(alone)
        for R in ROWS:
            M = R * top_k
            x, flat = x8[:M], flat8[:M]
            together = ours(x, flat, setting)
            mx.eval(together)
            defaults.setdefault((R, setting["tensor_cores"]), together)
            identical = all(mx.array_equal(together[i * top_k : (i + 1) * top_k], alone[i]).item() for i in range(R))
            times = {"kernel": _median_ms(lambda x=x, f=flat: ours(x, f, setting), repeats=repeats, inner=inner)}
            record = {"shape": name, "K": K, "N": N, "R": R, "cols": setting["cols"], "variant": variant_name(setting),
                      "picks": M, "unique_experts": len(set(flat.tolist())), "identical_to_1_row": identical,
                      "identical_to_default_cols": mx.array_equal(together, defaults[R, setting["tensor_cores"]]).item(),
                      "max_abs_diff": mx.abs(together.astype(mx.float32) - expected[:M]).max().item()}
            if R not in mlx_ms:  # MLX once per R
                mlx_out = theirs(x, flat)
                mx.eval(mlx_out)
                mlx_ms[R] = _median_ms(lambda x=x, f=flat: theirs(x, f), repeats=repeats, inner=inner)
                record["mlx_max_abs_diff"] = mx.abs(mlx_out.astype(mx.float32).reshape(M, N) - expected[:M]).max().item()
            times["mlx"] = mlx_ms[R]
            gbs = record["unique_experts"] * per_expert / (times["kernel"] / 1000) / 1e9
            record.update(ms=times, kernel_over_mlx=times["kernel"] / times["mlx"], weight_gbs=gbs, of_peak=gbs / peak_gbs)
            records.append(record)
    return records


def mxfp4_summary(records: list[dict]) -> list[dict]:
    """Per setting and R: the GPT-OSS layer's two projections (gate_up + down) in ms, against
    MLX's; the setting with the lowest R = 1 figure (serial decoding) is the default's candidate."""
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in records if "variant" in r):
        for R in ROWS:
            mine = [r for r in records if r.get("variant") == variant and r["R"] == R]
            kernel, mlx = sum(r["ms"]["kernel"] for r in mine), sum(r["ms"]["mlx"] for r in mine)
            rows.append({"variant": variant, "R": R, "kernel_ms": kernel, "mlx_ms": mlx, "kernel_over_mlx": kernel / mlx,
                         "all_identical": all(r["identical_to_1_row"] and r["identical_to_default_cols"] for r in mine)})
    return rows


def render_mxfp4(summary: list[dict]) -> str:
    lines = ["GPT-OSS MXFP4 experts, gate_up + down per layer: kernel ms (kernel / MLX gather_qmm)",
             f"{'variant':32s} " + " ".join(f"{'R=' + str(R):>16s}" for R in ROWS) + "  same"]
    for variant in dict.fromkeys(s["variant"] for s in summary):
        mine = [s for s in summary if s["variant"] == variant]
        cells = " ".join(f"{s['kernel_ms']:8.4f} ({s['kernel_over_mlx']:4.2f})" for s in mine)
        lines.append(f"{variant:32s} {cells}  {all(s['all_identical'] for s in mine)!s}")
    mlx = {s["R"]: s["mlx_ms"] for s in summary}
    lines.append(f"{'MLX gather_qmm':32s} " + " ".join(f"{mlx[R]:8.4f}{'':8s}" for R in ROWS))
    for R in ROWS:
        best = min((s for s in summary if s["R"] == R), key=lambda s: s["kernel_ms"])
        lines.append(f"fastest at R={R}: {best['variant']} {best['kernel_ms']:.4f} ms ({best['kernel_over_mlx']:.2f}x MLX)")
    return "\n".join(lines)


def run_mxfp4(*, small: bool, repeats: int, inner: int, peak_gbs: float) -> dict:
    """`--mxfp4`: only GPT-OSS's MXFP4 experts, every kernel setting against MLX."""
    use_kernel = kernels.kernels_usable(mx.bfloat16)
    E, top_k = (4, 2) if small else (32, 4)
    records = []
    for name, (K, N) in (SMALL_GPT_OSS_EXPERTS if small else GPT_OSS_EXPERTS).items():
        records += bench_mxfp4(f"gpt_oss_{name}", E, K, N, top_k, use_kernel=use_kernel, repeats=repeats,
                               inner=inner, peak_gbs=peak_gbs)
    identical = all(r["identical_to_1_row"] and r["identical_to_default_cols"] for r in records)
    return {"device": str(mx.default_device()), "machine": platform.node(), "mlx": mx.__version__,
            "kernels": kernels.status(), "path": "kernel" if use_kernel else "reference", "mode": "mxfp4",
            "dtype": "bfloat16", "repeats": repeats, "inner": inner, "all_rows_identical": identical,
            "records": records, "summary": mxfp4_summary(records)}


def bench_gdn(name: str, Hk: int, Hv: int, Dk: int, Dv: int, *, use_kernel: bool, repeats: int, inner: int,
              peak_gbs: float, conv_kernel: int = 4, seed: int = 0) -> list[dict]:
    """A GDN layer's decode window between its projections, R = 1, 2, 4, 8 rows, bfloat16 inputs."""
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(seed), 6)
    R8 = max(ROWS)
    window = mx.random.normal((1, conv_kernel - 1 + R8, C), key=keys[0]).astype(mx.bfloat16)
    weight = (mx.random.normal((C, conv_kernel), key=keys[1]) * 0.5).astype(mx.bfloat16)
    a, b = (mx.random.normal((1, R8, Hv), key=key).astype(mx.bfloat16) for key in keys[2:4])
    A_log, dt_bias = mx.random.uniform(-1, 1, (Hv,), key=keys[4]), mx.random.uniform(0, 1, (Hv,), key=keys[5])
    S = mx.random.normal((1, Hv, Dk, Dv), key=keys[0]) * 0.1
    heads = {"num_k_heads": Hk, "head_k_dim": Dk}
    mx.eval(window, weight, a, b, A_log, dt_bias, S)

    def step(R, t0=0, *, kernel=use_kernel, state=S):
        joined = window[:, t0 : t0 + conv_kernel - 1 + R]
        ab = (weight, a[:, t0 : t0 + R], b[:, t0 : t0 + R], A_log, dt_bias)
        if kernel:  # the history and rows as the layer hands them over; the joined window left out
            rows = gdn_window.gdn_prepare(joined[:, : conv_kernel - 1], joined[:, conv_kernel - 1 :], *ab, **heads)[:5]
            return gdn_window.gdn_scan(*rows, state)
        return gdn_window.reference_scan(*gdn_window.reference_prepare(joined, *ab, **heads), state)

    return _scan_records(step, S, name=name, K=C, N=Hv * Dv, repeats=repeats, inner=inner, peak_gbs=peak_gbs)


def _scan_records(step, S, *, name: str, K: int, N: int, repeats: int, inner: int, peak_gbs: float) -> list[dict]:
    """A recurrent decode window's records at R = 1, 2, 4, 8 rows: kernel and MLX-ops ms, whether
    R rows equal R chained 1-row calls bit for bit, and the distance to the ops' result.
    `step(R, t0=0, *, kernel, state)` runs R rows from row t0 and returns (y, state)."""
    R8 = max(ROWS)
    chained, state = [], S
    for t in range(R8):
        y, state = step(1, t, state=state)
        chained.append(y)
    chained = mx.concatenate(chained, axis=1)
    expected = step(R8, kernel=False)[0]
    mx.eval(chained, expected)
    state_bytes = 2 * S.nbytes
    records = []
    for R in ROWS:
        y, _ = step(R)
        mx.eval(y)
        times = {"kernel": _median_ms(lambda R=R: step(R), repeats=repeats, inner=inner),
                 "mlx": _median_ms(lambda R=R: step(R, kernel=False), repeats=repeats, inner=inner)}
        gbs = state_bytes / (times["kernel"] / 1000) / 1e9
        records.append({"shape": name, "K": K, "N": N, "R": R, "cols": 0,
                        "identical_to_1_row": mx.array_equal(y, chained[:, :R]).item(),
                        "max_abs_diff": mx.abs(y - expected[:, :R]).max().item(), "ms": times,
                        "kernel_over_mlx": times["kernel"] / times["mlx"], "weight_gbs": gbs, "of_peak": gbs / peak_gbs})
    return records


def bench_mamba2(name: str, H: int, P: int, G: int, N: int, *, use_kernel: bool, repeats: int, inner: int,
                 peak_gbs: float, conv_kernel: int = 4, seed: int = 0) -> list[dict]:
    """A Mamba-2 layer's decode window between its projections, R = 1, 2, 4, 8 rows, bfloat16
    inputs: `mamba2_prepare` + `mamba2_scan` (metal_shaders/mamba2_window.py) against the MLX
    ops the layer runs without them (`reference_prepare` + `reference_scan`)."""
    R8 = max(ROWS)
    window, weight, bias, dt, dt_bias, A_log = mamba2_window.probe_inputs(1, R8, H, P, G, N, K=conv_kernel,
                                                                         dtype=mx.bfloat16, seed=seed)
    S = mx.random.normal((1, H, P, N), key=mx.random.key(seed + 1)) * 0.1
    shapes = {"num_heads": H, "head_dim": P, "n_groups": G, "state_size": N, "dt_limits": (0.001, float("inf"))}
    mx.eval(window, weight, bias, dt, dt_bias, A_log, S)

    def step(R, t0=0, *, kernel=use_kernel, state=S):
        joined = window[:, t0 : t0 + conv_kernel - 1 + R]
        rest = (weight, bias, dt[:, t0 : t0 + R], dt_bias, A_log)
        if kernel:  # the history and rows as the layer hands them over; the joined window left out
            rows = mamba2_window.mamba2_prepare(joined[:, : conv_kernel - 1], joined[:, conv_kernel - 1 :], *rest,
                                                **shapes)[:5]
            return mamba2_window.mamba2_scan(*rows, state)
        return mamba2_window.reference_scan(*mamba2_window.reference_prepare(joined, *rest, **shapes), state)

    return _scan_records(step, S, name=name, K=H * P + 2 * G * N, N=H * P, repeats=repeats, inner=inner,
                         peak_gbs=peak_gbs)


def bench_attention(name: str, Hq: int, Hkv: int, D: int, cells: int, *, use_kernel: bool, repeats: int, inner: int,
                    peak_gbs: float, seed: int = 0) -> list[dict]:
    """A decode window's attention over `cells` cached cells (the window's rows the last R),
    R = 1, 2, 4, 8 query rows, bfloat16: `attention_window` (the reference where the kernel does
    not run) against MLX's sdpa in one causal call (mlx-lm's path) and once per row (the split)."""
    R8 = max(ROWS)
    q8, keys, values = attention_window.probe_inputs(1, Hq, Hkv, D, cells + R8, capacity=cells + R8 + 256,
                                                     dtype=mx.bfloat16, seed=seed)
    scale = D**-0.5
    mx.eval(q8, keys, values)

    def ours(R, t0=0, *, kernel=use_kernel):
        fn = attention_window.attention_window if kernel else attention_window.reference_attention_window
        end = cells + t0 + R
        return fn(q8[:, :, t0 : t0 + R], keys[:, :, :end], values[:, :, :end], scale)

    def theirs(R):
        return mx.fast.scaled_dot_product_attention(q8[:, :, :R], keys[:, :, : cells + R], values[:, :, : cells + R],
                                                    scale=scale, mask="causal" if R > 1 else None)

    alone = mx.concatenate([ours(1, t) for t in range(R8)], axis=1)
    expected = attention_window.reference_attention_window(*(a.astype(mx.float32) for a in
                                                             (q8, keys[:, :, : cells + R8], values[:, :, : cells + R8])),
                                                           scale)
    mx.eval(alone, expected)
    records = []
    for R in ROWS:
        together = ours(R)
        mx.eval(together)
        times = {"kernel": _median_ms(lambda R=R: ours(R), repeats=repeats, inner=inner),
                 "mlx": _median_ms(lambda R=R: theirs(R), repeats=repeats, inner=inner),
                 "split": _median_ms(lambda R=R: ours(R, kernel=False), repeats=repeats, inner=inner)}
        kv_bytes = 2 * Hkv * (cells + R) * D * keys.itemsize
        gbs = kv_bytes / (times["kernel"] / 1000) / 1e9
        # row t sees cells + t + 1 cells in every call here, so R = 8's first R rows are the reference
        diff = mx.abs(together.astype(mx.float32) - expected[:, :R]).max().item()
        records.append({"shape": name, "K": cells, "N": Hq * D, "R": R, "cols": 0,
                        "identical_to_1_row": mx.array_equal(together, alone[:, :R]).item(), "max_abs_diff": diff,
                        "ms": times, "kernel_over_mlx": times["kernel"] / times["mlx"], "weight_gbs": gbs,
                        "of_peak": gbs / peak_gbs})
    return records


def run_dense(*, small: bool, repeats: int, inner: int, peak_gbs: float, cols: tuple[int, ...]) -> dict:
    """`--dense`: GPT-OSS-20B's bfloat16 linears, `rows_matvec` against MLX's own matmul."""
    use_kernel = kernels.kernels_usable(mx.bfloat16)
    records = []
    for name, (K, N) in (SMALL_GPT_OSS_DENSE if small else GPT_OSS_DENSE).items():
        records += bench_shape(name, K, N, use_kernel=use_kernel, repeats=repeats, inner=inner,
                               peak_gbs=peak_gbs, cols=cols, dense=True)
    identical = all(r.get("identical_to_1_row", True) and r.get("identical_to_default_cols", True) for r in records)
    return {"device": str(mx.default_device()), "machine": platform.node(), "mlx": mx.__version__,
            "kernels": kernels.status(), "path": "kernel" if use_kernel else "reference", "mode": "dense",
            "dtype": "bfloat16", "repeats": repeats, "inner": inner, "all_rows_identical": identical,
            "records": records}


def run(*, small: bool, repeats: int, inner: int, peak_gbs: float, cols: tuple[int, ...]) -> dict:
    use_kernel = kernels.kernels_usable()
    shapes = SMALL_SHAPES if small else SHAPES
    records = []
    for name, (K, N) in shapes.items():
        records += bench_shape(name, K, N, use_kernel=use_kernel, repeats=repeats, inner=inner,
                               peak_gbs=peak_gbs, cols=cols)
    E, I, H, top_k = (16, 64, 128, 4) if small else (512, 512, 2048, 10)
    for name, K, N in (("experts_gate", H, I), ("experts_down", I, H)):
        records += bench_experts(name, E, K, N, top_k, use_kernel=use_kernel, repeats=repeats, inner=inner,
                                 peak_gbs=peak_gbs, cols=cols)
    gdn_heads = (2, 4, 64, 64) if small else (16, 32, 128, 128)
    records += bench_gdn("gdn_window", *gdn_heads, use_kernel=gdn_window.usable(), repeats=repeats, inner=inner,
                         peak_gbs=peak_gbs)
    mamba2_heads = (4, 16, 2, 32) if small else (64, 64, 8, 128)  # H, P, G, N: Nemotron-3-Nano-30B-A3B's
    records += bench_mamba2("mamba2_window", *mamba2_heads, use_kernel=mamba2_window.usable(), repeats=repeats,
                            inner=inner, peak_gbs=peak_gbs)
    heads, contexts = ((4, 2, 64), (64,)) if small else ((16, 2, 256), (512, 16384))
    for cells in contexts:
        records += bench_attention(f"attention_{cells}", *heads, cells, use_kernel=attention_window.usable(),
                                   repeats=repeats, inner=inner, peak_gbs=peak_gbs)
    identical = all(r.get("identical_to_1_row", True) and r.get("identical_to_default_cols", True) for r in records)
    return {"device": str(mx.default_device()), "machine": platform.node(), "mlx": mx.__version__,
            "kernels": kernels.status(), "gdn_kernels": gdn_window.status(), "mamba2_kernels": mamba2_window.status(),
            "attention_kernel": attention_window.status(), "path": "kernel" if use_kernel else "reference",
            "bits": BITS, "group_size": GROUP_SIZE, "dtype": "bfloat16", "repeats": repeats, "inner": inner,
            "all_rows_identical": identical, "records": records}


def render(result: dict) -> str:
    lines = [f"device {result['device']}, MLX {result['mlx']}, path {result['path']} {result['kernels']}",
             (f"{'shape':15s} {'K':>5s} {'N':>7s} {'R':>2s} {'cols':>4s} {'kernel ms':>10s} {'mlx ms':>8s} "
              f"{'split ms':>9s} {'ker/mlx':>7s} {'GB/s':>7s} {'peak':>5s} {'same':>5s} {'maxdiff':>8s}")]
    for r in result["records"]:
        ms = r["ms"]
        same = r.get("identical_to_1_row", r.get("identical_to_default_cols"))
        if "variant" in r:  # --mxfp4: both checks, the setting named
            same = r["identical_to_1_row"] and r["identical_to_default_cols"]
            r = {**r, "shape": f"{r['shape']} {r['variant']}"}
        if "mlx" in ms:
            split = f"{ms['split']:9.4f}" if "split" in ms else f"{'':9s}"
            lines.append(f"{r['shape']:15s} {r['K']:5d} {r['N']:7d} {r['R']:2d} {r['cols']:4d} {ms['kernel']:10.4f} "
                         f"{ms['mlx']:8.4f} {split} {r['kernel_over_mlx']:7.2f} {r['weight_gbs']:7.1f} "
                         f"{r['of_peak']:5.0%} {same!s:>5s} {r['max_abs_diff']:8.1e}")
        else:
            lines.append(f"{r['shape']:15s} {r['K']:5d} {r['N']:7d} {r['R']:2d} {r['cols']:4d} {ms['kernel']:10.4f} "
                         f"{'':8s} {'':9s} {'':7s} {r['weight_gbs']:7.0f} {'':5s} {same!s:>5s}")
    lines.append(f"every row identical to its 1-row call: {result['all_rows_identical']}")
    return "\n".join(lines)


def use_butterfly_tail() -> int:
    """Give rows_matvec's bodies the tail they had before their reduce-scatter (every value
    summed by its own xor butterfly: scripts/lab/kernel_emulate.py's BUTTERFLY_TAIL, the same
    bits) and their kernels other names, so a run of this process times the old tail against a
    run of another process, on the same machine. Returns the bodies swapped."""
    from scripts.lab.kernel_emulate import butterfly_bodies

    old = butterfly_bodies()
    swapped = 0
    for attr, value in list(vars(kernels).items()):
        if isinstance(value, str) and id(value) in old:
            setattr(kernels, attr, old[id(value)])
            swapped += 1
    make = kernels._kernel
    kernels._kernel = lambda name, *a, **k: make(f"{name}_butterfly", *a, **k)
    return swapped


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--small", action="store_true", help="small shapes (implied on the CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples (20; 3 with --small)")
    parser.add_argument("--inner", type=int, default=None, help="calls per timed sample (10; 2 with --small)")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth")
    parser.add_argument("--cols", default="2,8", help="extra columns-per-warp settings timed at R = 1 and 8")
    parser.add_argument("--mxfp4", action="store_true",
                        help="only GPT-OSS-20B's MXFP4 experts: each setting of the MXFP4 kernel against MLX")
    parser.add_argument("--dense", action="store_true",
                        help="only GPT-OSS-20B's bfloat16 linears (its 201,088-column head among them): "
                             "rows_matvec against MLX's matmul")
    parser.add_argument("--butterfly-tail", action="store_true",
                        help="time the matrix kernels with the tail they had before the reduce-scatter "
                             "(same bits, five shuffles a value), to set against a run without it")
    args = parser.parse_args(argv)
    if args.butterfly_tail:
        print(f"the butterfly tail: {use_butterfly_tail()} bodies swapped", flush=True)
    small = args.small or mx.default_device() == mx.cpu
    cols = tuple(int(c) for c in args.cols.split(",") if c.strip())
    repeats = args.repeats or (3 if small else 20)
    inner = args.inner or (2 if small else 10)
    if args.mxfp4:
        result = run_mxfp4(small=small, repeats=repeats, inner=inner, peak_gbs=args.peak_gbs)
        print(render(result), render_mxfp4(result["summary"]), sep="\n", flush=True)
    elif args.dense:
        result = run_dense(small=small, repeats=repeats, inner=inner, peak_gbs=args.peak_gbs, cols=cols)
        print(render(result), flush=True)
    else:
        result = run(small=small, repeats=repeats, inner=inner, peak_gbs=args.peak_gbs, cols=cols)
        print(render(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
