"""`--suffix-draft auto` against serial at every expert-cache size, as a user runs it: issue 38's
"`auto` never below 0.97x serial at any cache size", on the CPU with a trained router (the demo
model, whose experts repeat from token to token as a real model's do; a random 80B checkpoint's
do not, and it offers `auto` nothing to accept).

The demo model is converted to the streamed layout once (`strata convert --stream`); each round
runs `strata generate --json` for every resident count, workload and mode, serial and `auto`
next to each other, and records `steady_tokens_per_s`, the drafts offered and kept, and whether
every process gave the same tokens. Medians over rounds, and each round's auto/serial pair.

    python -m scripts.lab.stream_auto --rounds 5 --out docs/runs/stream_auto_cpu_demo7.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from scripts.lab.cli_trees import DEMO_EXPERTS, WORKLOADS, convert_streamed, run_generate

ROOT = Path(__file__).resolve().parents[2]
MODES = ("0", "auto")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--resident", type=int, nargs="+", default=[2, 5, DEMO_EXPERTS // 4, DEMO_EXPERTS // 2,
                                                                    DEMO_EXPERTS],
                        help=f"resident experts per MoE layer (of {DEMO_EXPERTS})")
    parser.add_argument("--workloads", nargs="+", default=["copy_edit", "prose"],
                        help="bundled workloads (strata_cli/assets/workloads/NAME.txt)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="strata-stream-auto-"))
    model = convert_streamed(ROOT, work).as_posix()
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for resident in args.resident:
            for workload in args.workloads:
                text = (WORKLOADS / f"{workload}.txt").read_text()
                for mode in MODES:
                    record = run_generate(ROOT, ["--max-tokens", str(args.tokens), "--suffix-draft", mode,
                                                 "--resident-experts", str(resident), "--model", model],
                                          text, work / "cache")
                    stats = record["stats"]
                    runs.setdefault(f"{resident}|{workload}|{mode}", []).append(
                        {"tokens_per_s": stats["steady_tokens_per_s"], "offered": stats["drafts_offered"],
                         "kept": stats["drafts_kept"], "token_ids": record["token_ids"]})
        print(f"round {rnd + 1} of {args.rounds} done", flush=True)
    result = {"experts": DEMO_EXPERTS, "rounds": args.rounds, "tokens": args.tokens, "rows": []}
    for resident in args.resident:
        for workload in args.workloads:
            serial, auto = runs[f"{resident}|{workload}|0"], runs[f"{resident}|{workload}|auto"]
            s = statistics.median(r["tokens_per_s"] for r in serial)
            a = statistics.median(r["tokens_per_s"] for r in auto)
            row = {"resident": resident, "cache_fraction": resident / DEMO_EXPERTS, "workload": workload,
                   "serial_tokens_per_s": s, "auto_tokens_per_s": a, "auto_over_serial": a / s,
                   "pairs": [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(auto, serial, strict=True)],
                   "offered": [r["offered"] for r in auto], "kept": [r["kept"] for r in auto],
                   "identical": all(r["token_ids"] == serial[0]["token_ids"] for r in serial + auto)}
            result["rows"].append(row)
            print(f"{resident:3d}/{DEMO_EXPERTS} {workload:18s} serial {s:7.1f}  auto {a:7.1f}  {a / s:.2f}x  pairs "
                  + " ".join(f"{p:.2f}" for p in row["pairs"]) + f"  offered {row['offered']}"
                  + ("" if row["identical"] else "  TOKENS DIFFER"), flush=True)
    result["lowest_auto_over_serial"] = min(r["auto_over_serial"] for r in result["rows"])
    result["identical"] = all(r["identical"] for r in result["rows"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
