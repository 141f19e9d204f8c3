"""Where a streamed token goes, over a simulated slow disk: routing readback, waits on reads,
slot installs and the rest (compute), serial against `--suffix-draft auto`.

Builds (once) stream_curve's synthetic Qwen3-Next in the streaming layout, puts
`slow_disk.SimulatedDisk(--read-ms)` under every record read, and at each cache size decodes a
fresh prompt per repeat with each mode in turn (one engine per mode, the modes alternating, a
warm-up run each first). Reports medians per token of the expert cache's own timers
(`experts.router_sync_ms`, `late_wait_ms`, `install_ms`), records read per token, the tokens/s the
simulated disk alone allows (1 / (records per token x read ms)) and the share of it reached, and
whether every mode's output is token-identical to serial.

    python -m scripts.bench.stream_split --tiny                         # seconds, checks the script
    python -m scripts.bench.stream_split --preset cpu --fractions 0.1 0.25 0.5 1.0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from scripts.bench.slow_disk import H200_80B_RECORD_MS, SimulatedDisk
from scripts.bench import stream_curve
from scripts.bench.stream_curve import PRESETS, build, synthetic_prompts
from strata_cli.engine.window import WindowEngine
from strata_cli.options import SpecOptions, StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.speculative.controller import CostPrior

MODES = {"serial": SpecOptions(), "auto": SpecOptions(max_drafts=3, auto=True), "draft3": SpecOptions(max_drafts=3)}


def open_engine(path: Path, slots: int, disk: SimulatedDisk, stream: dict) -> WindowEngine:
    model = load_checkpoint(path, stream=StreamOptions(resident_experts=slots, **stream))
    disk.attach(model.expert_cache.store)
    return WindowEngine(model)


def one_run(engine: WindowEngine, prompt: list[int], tokens: int, spec: SpecOptions, stride: int) -> dict:
    """stream_curve.one_run's decode, its time split per token and its reads in records."""
    run = stream_curve.one_run(engine, prompt, tokens=tokens, spec=spec)
    split = run["ms_per_token"]
    return {
        "tokens_per_s": run["tokens_per_s"],
        "ms_per_token": sum(split.values()),
        "router_sync_ms_per_token": split["router_sync"],
        "late_wait_ms_per_token": split["read_wait"],
        "install_ms_per_token": split["installs"],
        "other_ms_per_token": split["compute"],
        "records_per_token": run["bytes_per_token"] / stride,
        "demand_records_per_token": run["demand_bytes_per_token"] / stride,
        "acceptance": run["acceptance"],
        "drafts_offered": run["drafts_offered"],
        "output": run["output"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--tiny", action="store_true", help="Same as --preset tiny.")
    parser.add_argument("--dir", type=Path, default=None, help="Model directory (default /tmp/strata-stream-<preset>).")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.00])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["serial", "auto"])
    parser.add_argument("--read-ms", type=float, default=H200_80B_RECORD_MS,
                        help="Simulated milliseconds per record read (default: an 80B-A3B record on the H200).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--cost-slope", type=float, default=None,
                        help="auto's prior window cost, 1 + slope x (T - 1) one-row windows (e.g. 0.05, a GPU's "
                             "flat curve, so auto tries drafts on the CPU too); default: the built-in prior.")
    parser.add_argument("--io", choices=("auto", "direct", "buffered"), default="buffered",
                        help="Expert reads (default buffered: the simulated disk times them; 'direct' with --read-ms 0 "
                             "for a real disk).")
    parser.add_argument("--disk-gbps", type=float, default=None,
                        help="With --read-ms 0: the measured disk rate for the disk-bound tokens/s.")
    parser.add_argument("--layers", type=int, default=None, help="Override the preset's number of layers.")
    parser.add_argument("--prefetch", default="router")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    name = "tiny" if args.tiny else args.preset
    preset = PRESETS[name]
    if args.layers is not None:
        preset = {**preset, "model": {**preset["model"], "num_hidden_layers": args.layers}}
    modes = dict(MODES)
    if args.cost_slope is not None:
        modes["auto"] = SpecOptions(max_drafts=3, auto=True, cost_prior=CostPrior.linear(args.cost_slope))
    tokens = args.tokens or preset["tokens"]
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    path = args.dir or Path(f"/tmp/strata-stream-{name}")
    if not stream_curve.is_built(path, preset["model"]):
        log(f"building the {name} model in {path}")
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
        build(path, preset["model"], seed=0, dtype=dtype, log=log)
    E = preset["model"]["num_experts"]
    prompts = synthetic_prompts(preset, 1, 1 + args.repeats)
    stream = {"prefetch": args.prefetch, "io": args.io, "io_threads": args.io_threads}
    rows = []
    for fraction in args.fractions:
        slots = max(1, math.ceil(E * fraction))
        disk = SimulatedDisk(args.read_ms)
        engines = {m: open_engine(path, slots, disk, stream) for m in args.modes}
        stride = next(iter(engines.values())).expert_cache.store.blocks[
            next(iter(engines.values())).expert_cache.paths[0]].stride
        runs: dict[str, list[dict]] = {m: [] for m in args.modes}
        for r, prompt in enumerate(prompts):
            for m in (args.modes if r % 2 else args.modes[::-1]):  # alternate which mode goes first
                run = one_run(engines[m], prompt, tokens, modes[m], stride)
                if r:  # prompts[0] warms each engine up
                    runs[m].append(run)
        for m in args.modes:
            med = {k: statistics.median(run[k] for run in runs[m]) for k in runs[m][0] if k != "output"}
            if args.read_ms:
                disk_bound = 1000 / (med["records_per_token"] * args.read_ms) if med["records_per_token"] else math.inf
            else:
                per_token = med["records_per_token"] * stride
                disk_bound = args.disk_gbps * 1e9 / per_token if args.disk_gbps and per_token else math.inf
            row = {"fraction": fraction, "slots": slots, "mode": m, "runs": len(runs[m]), **med,
                   "disk_bound_tokens_per_s": disk_bound, "share_of_disk_bound": med["tokens_per_s"] / disk_bound,
                   "tokens_per_s_all": [round(run["tokens_per_s"], 2) for run in runs[m]],
                   "identical_to_first_mode": [run["output"] for run in runs[m]]
                   == [run["output"] for run in runs[args.modes[0]]]}
            rows.append(row)
            log(f"{fraction:>4.0%} {m:<6} {med['tokens_per_s']:6.2f} tok/s ({row['share_of_disk_bound']:.0%} of disk) "
                f"{med['ms_per_token']:6.1f} ms/token: sync {med['router_sync_ms_per_token']:.1f} "
                f"wait {med['late_wait_ms_per_token']:.1f} install {med['install_ms_per_token']:.1f} "
                f"other {med['other_ms_per_token']:.1f}; {med['records_per_token']:.1f} records/token "
                f"({med['demand_records_per_token']:.1f} demand)  identical {row['identical_to_first_mode']}")
        for engine in engines.values():
            engine.model.expert_cache.close()
    report = {"preset": name, "read_ms": args.read_ms, "cost_slope": args.cost_slope, "io": args.io, "tokens": tokens, "prefetch": args.prefetch,
              "device": str(mx.default_device()), "rows": rows, "seconds": time.perf_counter() - start}
    print(json.dumps(report, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
