"""Every kernel of a T = 1 and a T = 8 decode window, timed on the device by NVIDIA's Nsight
Compute (`ncu`): where the step goes, kernel by kernel, with no launch of the host in the numbers
(issue 37, "know where the step goes").

step_profile splits a window into host build and evaluation, and kernel_share times a kernel
by launching it twice inside the window; both leave the device's own time per kernel to
inference. Here the window runs under ncu: the script starts itself as ncu's child, which loads
the 8-layer 80B-A3B-shaped 4-bit checkpoint (step_profile's), prefills it, times plain windows
unprofiled (`window_ms`), then profiles `--each` windows of every T between cuProfilerStart and
cuProfilerStop, a marker kernel launched before each. ncu replays every kernel alone (clocks
and caches left as they run: `--clock-control none --cache-control none`), so a kernel's
duration is its own device time, and the sum over a window is the device's busy time; what the
window's wall time holds beyond it is the host and the gaps between launches.

The report, per T: each kernel (by name, in launch order) with its median duration over the
windows, grid and block, registers a thread, and with `--detail` (a second ncu run of strata's
own kernels in one window of each T, the child run again for each pass, caches flushed before
each kernel: the bytes a kernel reads when its inputs are not already in L2, at most what it
reads in the window; stopped after `--detail-timeout` s) DRAM bytes read, DRAM throughput
against peak, active warps against peak, issue slots, FP32 and integer pipes against peak, and
warps' stalls on memory; by name, the sums (the percentages weighted by each launch's µs); and
the change from the first T to the last, largest first.

    python -m scripts.lab.ncu_window --out ncu_window.json            # GPU with ncu (H100: ncu in /usr/local/cuda/bin)
    python -m scripts.lab.ncu_window --parse report.csv --markers m.json  # read an exported report again
    python -m scripts.lab.ncu_window --parse KEEP_DIR                     # or a --keep folder, detail too
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from metal_shaders import attention_window, rows_matvec, rows_mma
from scripts.lab import mma_loop
from strata_cli.bench.runner import git_commit

MARK = "strata_ncu_mark"
TIME_METRICS = ("gpu__time_duration.sum", "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
                "launch__occupancy_limit_registers")
DETAIL_METRICS = ("dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                  "sm__warps_active.avg.pct_of_peak_sustained_active",
                  # what binds a kernel short of DRAM's peak: issue slots, the FP32 and integer pipes,
                  # the SMs' busiest unit, warps waiting on memory (issue 37's routed experts)
                  "smsp__issue_active.avg.pct_of_peak_sustained_active",
                  "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                  "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
                  "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio")
# The kernels the detail profiles (ncu's --kernel-name; the markers' name matches). Replayed
# kernel by kernel, each launch's passes save and restore the device memory it may touch (MLX's
# whole heap): every launch of three windows a T (797) ran past 14 minutes on the H100 at
# 22ead51, and strata's 210 launches of one window a T got through 21 in 16 minutes at 97e7ee1.
# So the detail replays the application (the child again for each pass: it is deterministic)
# and stops at DETAIL_TIMEOUT_S, leaving the times whole.
DETAIL_KERNELS = "regex:strata_"
DETAIL_REPLAY = "application"
DETAIL_TIMEOUT_S = 420
# the detail's percentages as `render` shows them, per kernel name (weighted by each launch's µs)
SHOWN = {"dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
         "warps": "sm__warps_active.avg.pct_of_peak_sustained_active",
         "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
         "fma": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
         "alu": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"}
# a metric's value in the report's unit, scaled to µs (times) or bytes; ncu 2025 writes "ns",
# older ones "nsecond". Counts, percentages and the like keep their value.
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
UNITLESS = {"", "%", "block", "register/thread", "thread", "warp", "cycle", "inst"}


# -- reading ncu's CSV ----------------------------------------------------------------------------

def short_name(name: str) -> str:
    """A kernel's name without its return type, namespaces' noise, template arguments and parameters."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    out, depth = [], 0
    for ch in name.split("(", 1)[0]:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out)


def number(text: str, unit: str) -> float | None:
    text = text.replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        return None
    unit = unit.strip()
    if unit not in UNITS and unit not in UNITLESS:
        raise ValueError(f"ncu_window: unknown metric unit {unit!r}: add it to UNITS or UNITLESS")
    return value * UNITS.get(unit, 1.0)


def launches(csv_text: str) -> list[dict]:
    """ncu's details page as CSV (one line a kernel launch and metric) -> one dict a launch, in ID
    order: its name, short name and each metric's value (times in µs, bytes in bytes)."""
    rows = list(csv.DictReader(io.StringIO(csv_text[csv_text.find('"ID"'):])))
    by_id: dict[int, dict] = {}
    for row in rows:
        if not row.get("ID", "").strip().isdigit():
            continue
        name = row["Kernel Name"]
        launch = by_id.setdefault(int(row["ID"]), {"name": name, "kernel": short_name(name)})
        value = number(row.get("Metric Value", ""), row.get("Metric Unit", ""))
        if value is not None:
            launch[row["Metric Name"]] = value
    return [by_id[i] for i in sorted(by_id)]


def windows_of(found: list[dict], order: list[int]) -> dict[int, list[list[dict]]]:
    """Launches split at the marker kernels: the i-th marker opens a window of T = order[i]."""
    out: dict[int, list[list[dict]]] = defaultdict(list)
    current = None
    marks = 0
    for launch in found:
        if MARK in launch["kernel"]:
            if marks >= len(order):
                raise ValueError(f"more markers in the report than the {len(order)} windows the child ran")
            current = []
            out[order[marks]].append(current)
            marks += 1
        elif current is not None:
            current.append(launch)
    if marks != len(order):
        raise ValueError(f"{marks} markers in the report, {len(order)} windows run: the report is not this run's")
    return dict(out)


def summarize(windows: list[list[dict]]) -> dict:
    """One T's windows -> its kernels in launch order (the median of each metric over windows
    that launched the same sequence), per-name sums and the device's busy µs."""
    lengths = Counter(len(w) for w in windows)
    usual = lengths.most_common(1)[0][0]  # a window that launched more or fewer kernels is left out
    same = [w for w in windows if len(w) == usual]
    kernels = []
    for i, first in enumerate(same[0]):
        row = {"kernel": first["kernel"]}
        for key in first:
            if key in ("name", "kernel"):
                continue
            values = [w[i].get(key) for w in same if w[i]["kernel"] == first["kernel"] and w[i].get(key) is not None]
            if values:
                row[key] = statistics.median(values)
        kernels.append(row)
    by_name: dict[str, dict] = {}
    for row in kernels:
        entry = by_name.setdefault(row["kernel"], {"launches": 0, "us": 0.0, "dram_bytes": 0.0})
        entry["launches"] += 1
        entry["us"] += row.get("gpu__time_duration.sum", 0.0)
        entry["dram_bytes"] += row.get("dram__bytes_read.sum", 0.0)
    busy = sum(row.get("gpu__time_duration.sum", 0.0) for row in kernels)
    return {"windows": len(windows), "windows_alike": len(same), "launch_counts": sorted(lengths), "kernels": kernels,
            "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"])), "busy_us": busy}


def merge_detail(summary: dict, detail: dict) -> None:
    """The detail run's metrics joined to the timing run's kernels: a name's i-th launch in the
    detail to its i-th in the timing run (the detail profiles only DETAIL_KERNELS), where every
    name the detail holds was launched as often in both."""
    mine: dict[str, list[dict]] = defaultdict(list)
    theirs: dict[str, list[dict]] = defaultdict(list)
    for k in summary["kernels"]:
        mine[k["kernel"]].append(k)
    for k in detail["kernels"]:
        theirs[k["kernel"]].append(k)
    if any(len(mine.get(name, [])) != len(rows) for name, rows in theirs.items()):
        summary["detail_mismatch"] = True
        return
    for name, rows in theirs.items():
        for kernel, measured in zip(mine[name], rows):
            kernel.update({k: v for k, v in measured.items() if k in DETAIL_METRICS})
    for name, entry in summary["by_name"].items():
        entry["dram_bytes"] = detail["by_name"].get(name, {}).get("dram_bytes", 0.0)
        rows = [k for k in summary["kernels"] if k["kernel"] == name and k.get("gpu__time_duration.sum")]
        for short, metric in SHOWN.items():
            weighted = [(k["gpu__time_duration.sum"], k[metric]) for k in rows if metric in k]
            if weighted:
                entry[f"{short}_pct"] = sum(t * v for t, v in weighted) / sum(t for t, _ in weighted)


def deltas(report: dict) -> list[dict]:
    """Per kernel name, the last T's µs less the first T's, largest first."""
    Ts = sorted(report["T"], key=int)
    lo, hi = report["T"][Ts[0]]["by_name"], report["T"][Ts[-1]]["by_name"]
    names = set(lo) | set(hi)
    rows = [{"kernel": n, "first_us": lo.get(n, {}).get("us", 0.0), "last_us": hi.get(n, {}).get("us", 0.0)}
            for n in names]
    for row in rows:
        row["delta_us"] = row["last_us"] - row["first_us"]
    return sorted(rows, key=lambda r: -r["delta_us"])


def render(report: dict) -> str:
    Ts = sorted(report["T"], key=int)
    lines = []
    for T in Ts:
        s = report["T"][T]
        wall = report.get("window_ms", {}).get(T)
        lines.append(f"T = {T}: device busy {s['busy_us'] / 1e3:.3f} ms in {len(s['kernels'])} kernels"
                     + (f", window {wall:.3f} ms unprofiled" if wall else ""))
        for name, e in list(s["by_name"].items())[:25]:
            gb = e["dram_bytes"] / 1e9
            pct = " ".join(f"{short} {e[f'{short}_pct']:.0f}%" for short in SHOWN if f"{short}_pct" in e)
            lines.append(f"  {name[:60]:60s} x{e['launches']:3d} {e['us']:9.1f} us" + (f"  {gb:.4f} GB" if gb else "")
                         + (f"  {pct}" if pct else ""))
    if len(Ts) > 1:
        lines.append(f"T = {Ts[-1]} less T = {Ts[0]}, by kernel (us):")
        for row in deltas(report)[:15]:
            lines.append(f"  {row['kernel'][:60]:60s} {row['first_us']:9.1f} -> {row['last_us']:9.1f} "
                         f"({row['delta_us']:+.1f})")
    return "\n".join(lines)


# -- the child: windows under ncu -----------------------------------------------------------------

def profiler(start: bool) -> None:
    """cuProfilerStart / Stop on the context MLX uses (ncu profiles only between them)."""
    from strata_cli import cuda_driver
    lib = cuda_driver.driver()
    if lib is None or not cuda_driver.has_context(lib):
        raise SystemExit("ncu_window: no CUDA driver context to start the profiler in")
    rc = (lib.cuProfilerStart if start else lib.cuProfilerStop)()
    if rc:
        raise SystemExit(f"ncu_window: cuProfiler{'Start' if start else 'Stop'} returned CUDA error {rc}")


def child(args) -> None:
    import mlx.core as mx

    from metal_shaders.probe import gpu_kernel
    from scripts.bench.step_profile import Windows, checkpoint_80b, plain_window_ms
    from strata_cli.runtime import load_checkpoint

    mark = gpu_kernel(MARK, ["a"], ["out"], "    if (thread_x == 0 && block_x == 0) out[0] = a[0] + 1.0f;\n")
    one = mx.zeros((1,), dtype=mx.float32)
    path = args.model or checkpoint_80b(args.dir, layers=args.layers, tiny=False)
    model = load_checkpoint(path, dtype="bfloat16")
    w = Windows(model, args.context, args.seed)
    Ts = [int(t) for t in args.windows.split(",")]
    wall = {str(T): plain_window_ms(w, T, args.repeats, 3) for T in Ts}  # unprofiled, each its own warm-up
    for T in Ts:
        plain_window_ms(w, T, 2, 0)
    order = [T for T in Ts for _ in range(args.each)]
    w.reset()
    mx.synchronize()
    profiler(True)
    for T in order:
        (out,) = mark(inputs=[one], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                      output_dtypes=[mx.float32])
        mx.eval(out)
        mx.synchronize()
        w.one(T)
        mx.synchronize()
    profiler(False)
    Path(args.child).write_text(json.dumps({"order": order, "window_ms": wall, "model": str(path)}) + "\n")


# -- the parent: ncu around the child, then the report --------------------------------------------

def ncu_path() -> str:
    found = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if not found:
        raise SystemExit("ncu_window: no ncu on this machine (Nsight Compute; /usr/local/cuda/bin/ncu on the H100s)")
    return found


def profile_command(ncu: str, metrics: tuple[str, ...], child_args: list[str], report: Path, record: Path,
                    cache: str = "none", kernels: str | None = None, replay: str = "kernel") -> list[str]:
    """ncu's command line for one run of the child. `cache`: ncu's --cache-control (`all`
    flushes the caches before each pass, so a metric needing several passes never reads what the
    pass before it left in L2); `kernels`: ncu's --kernel-name, the kernels it profiles (every one
    when None); `replay`: ncu's --replay-mode (`application` runs the child once a pass)."""
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", cache,
            "--replay-mode", replay, *(["--kernel-name", kernels] if kernels else []),
            "--metrics", ",".join(metrics), "-f", "-o", str(report),
            sys.executable, "-m", "scripts.lab.ncu_window", "--child", str(record), *child_args]


def run_bounded(cmd: list[str], timeout: float | None) -> subprocess.CompletedProcess:
    """`cmd` to its end, or killed with everything it started (ncu's child holds the GPU) once
    `timeout` seconds have passed (SystemExit then)."""
    with subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise SystemExit(f"ncu_window: the profiled run passed its {timeout:.0f} s and was stopped") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def profile_run(ncu: str, metrics: tuple[str, ...], child_args: list[str], work: Path, tag: str,
                cache: str = "none", kernels: str | None = None, replay: str = "kernel",
                timeout: float | None = None) -> tuple[str, dict]:
    """One ncu run of the child (profile_command's options; stopped after `timeout` s): the
    exported CSV and the child's own record."""
    report, record = work / f"{tag}", work / f"{tag}.json"
    cmd = profile_command(ncu, metrics, child_args, report, record, cache, kernels, replay)
    print("$ " + " ".join(cmd), flush=True)
    done = run_bounded(cmd, timeout)
    sys.stdout.write(done.stdout[-3000:])
    if done.returncode or not record.exists():
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"ncu_window: the profiled run failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    exported = subprocess.run([ncu, "-i", f"{report}.ncu-rep", "--csv", "--page", "details", "--print-units", "base"],
                              text=True, capture_output=True, check=True).stdout
    (work / f"{tag}.csv").write_text(exported)
    return exported, json.loads(record.read_text())


def build_report(time_csv: str, record: dict, detail_csv: str | None = None, detail_record: dict | None = None) -> dict:
    report = {"window_ms": record["window_ms"], "model": record.get("model"), "T": {}}
    timed = windows_of(launches(time_csv), record["order"])
    detailed = windows_of(launches(detail_csv), detail_record["order"]) if detail_csv else {}
    for T, windows in sorted(timed.items()):
        report["T"][str(T)] = summarize(windows)
        if T in detailed:
            merge_detail(report["T"][str(T)], summarize(detailed[T]))
    report["deltas"] = deltas(report)
    return report


def kept_run(folder: Path, name: str) -> tuple[str | None, dict | None]:
    """One run's CSV and child record from a --keep folder; (None, None) where it has none."""
    csv_path, record = folder / f"{name}.csv", folder / f"{name}.json"
    if not csv_path.exists() or not record.exists():
        if name == "time":
            raise SystemExit(f"ncu_window: {folder} holds no time.csv and time.json (a --keep folder)")
        return None, None
    return csv_path.read_text(), json.loads(record.read_text())


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default="1,8", help="row counts T")
    parser.add_argument("--each", type=int, default=3, help="profiled windows of each T (medians over them)")
    parser.add_argument("--repeats", type=int, default=20, help="unprofiled windows timed for window_ms")
    parser.add_argument("--context", type=int, default=512, help="prefilled tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint (default: step_profile's 80B-A3B shape)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-step-profile")
    parser.add_argument("--detail", action="store_true",
                        help="a second ncu run for DRAM bytes, throughput and warps (strata's kernels, one window a T)")
    parser.add_argument("--detail-kernels", default=DETAIL_KERNELS,
                        help="ncu's --kernel-name for the detail run (default %(default)s)")
    parser.add_argument("--detail-timeout", type=float, default=DETAIL_TIMEOUT_S,
                        help="seconds the detail run may take before it is stopped (the times are kept)")
    parser.add_argument("--keep", type=Path, default=None, help="keep ncu's reports and CSVs in this folder")
    parser.add_argument("--parse", type=Path, default=None,
                        help="read an exported CSV (with --markers), or a --keep folder, instead of profiling")
    parser.add_argument("--markers", type=Path, default=None, help="with --parse: the child's JSON record")
    parser.add_argument("--loop", action="append", default=[], metavar="KIND=W/S/U",
                        help="rows_mma's K loop of a kind of form for this run (plain or routed; "
                             "scripts/lab/mma_loop.py), e.g. plain=8/8/1; may repeat")
    parser.add_argument("--split-cells", type=int, default=None, metavar="N",
                        help="attention_window.SPLIT_CELLS for this run (cells a split; 0: one kernel)")
    parser.add_argument("--glu-cols", type=int, default=None, metavar="N",
                        help="rows_matvec.GLU_COLS for this run (the routed GLU's output columns a warp)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    loops = []
    for item in args.loop:
        kind, _, setting = item.partition("=")
        try:
            mma_loop.parse(setting)
        except ValueError as e:
            parser.error(f"--loop {item!r}: {e}")
        if kind not in rows_mma.LOOPS:
            parser.error(f"--loop {item!r}: the kinds are {', '.join(rows_mma.LOOPS)}")
        loops.append((kind, setting))
    if args.split_cells is not None and (args.split_cells < 0 or args.split_cells % 32):
        parser.error(f"--split-cells takes 0 or a positive multiple of 32, got {args.split_cells}")
    if args.glu_cols is not None and (args.glu_cols < 1 or args.glu_cols & (args.glu_cols - 1)):
        parser.error(f"--glu-cols takes a power of two, got {args.glu_cols}")
    # the run's settings, in the child that runs them and in the parent whose report names them
    for kind, setting in loops:
        mma_loop.apply(setting, kind)
    if args.split_cells is not None:
        attention_window.SPLIT_CELLS = args.split_cells
    if args.glu_cols is not None:
        rows_matvec.GLU_COLS = args.glu_cols
    if args.child:
        child(args)
        return None
    if args.parse and args.parse.is_dir():
        report = build_report(*kept_run(args.parse, "time"), *kept_run(args.parse, "detail"))
    elif args.parse:
        if not args.markers:
            parser.error("--parse needs --markers (the child's JSON record)")
        report = build_report(args.parse.read_text(), json.loads(args.markers.read_text()))
    else:
        ncu = ncu_path()
        def child_args(each: int) -> list[str]:
            return (["--windows", args.windows, "--each", str(each), "--repeats", str(args.repeats),
                     "--context", str(args.context), "--layers", str(args.layers), "--seed", str(args.seed),
                     "--dir", str(args.dir)] + (["--model", str(args.model)] if args.model else [])
                    + [f"--loop={kind}={setting}" for kind, setting in loops]
                    + ([f"--split-cells={args.split_cells}"] if args.split_cells is not None else [])
                    + ([f"--glu-cols={args.glu_cols}"] if args.glu_cols is not None else []))
        work = args.keep or Path(tempfile.mkdtemp(prefix="ncu-window-"))
        work.mkdir(parents=True, exist_ok=True)
        time_csv, record = profile_run(ncu, TIME_METRICS, child_args(args.each), work, "time")
        detail, detail_error = (None, None), None
        if args.detail:
            try:  # a metric this ncu lacks costs the detail, never the times; one window of each T
                detail = profile_run(ncu, DETAIL_METRICS, child_args(1), work, "detail", "all", args.detail_kernels,
                                     DETAIL_REPLAY, args.detail_timeout)
            except SystemExit as e:
                detail_error = str(e)
                print(f"ncu_window: no detail: {detail_error}", file=sys.stderr, flush=True)
        report = build_report(time_csv, record, *detail)
        if detail_error:
            report["detail_error"] = detail_error
        report["loops"] = {kind: "/".join(map(str, loop)) for kind, loop in rows_mma.LOOPS.items()}
        report["split_cells"], report["glu_cols"] = attention_window.SPLIT_CELLS, rows_matvec.GLU_COLS
    report["commit"] = git_commit()
    print(render(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
