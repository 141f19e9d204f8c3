"""Cache-aware routing (MoCE) against exact routing: agreement and tokens/s by expert-cache size.

For each cache size and each MoCE setting, on the same prompts and the same cache budget as
exact routing:

- greedy agreement: the share of exact's greedy tokens MoCE reproduces before its first
  divergence;
- teacher-forced top-1 agreement: both models read exact's greedy sequence one token at a time;
  the share of positions whose argmax agrees;
- mean KL(exact ‖ MoCE) per token over those positions;
- expert misses (demand reads), prefetch reads, wasted prefetches (read ahead, picked by no
  row) and disk reads (misses plus prefetch reads) per token: counts, which load does not move;
- late-wait ms (compute waiting on reads) per token, and
  tokens/s of serial greedy decoding, exact and MoCE, medians of `repeats`; every engine of a cache
  size runs once per repeat in turn, so the ratios share the machine's state. Each cache size also
  times the same model loaded whole, without streaming (`resident_tokens_per_s`): the gap between
  it and exact at that size is what streaming costs (reads, installs, the per-layer routing sync),
  the most that saving reads can win back.

A setting with `:n` keeps the natural router prefetch (`--moce-natural-prefetch`), and one with
`:i` counts experts whose read-ahead is in flight as resident (`--moce-count-inflight`), so one
run compares them against the same exact engine.
`--read-ms` puts a simulated disk under the reads (scripts/bench/slow_disk.py). `--prefetch-study` measures
`--spec-root-prefetch` (issue 15, item 4): with 3 drafts per window (only then do draft rows
exist to leave out of read-ahead), exact routing and the first MoCE setting, router prefetch from
every row against the root row only: late waits, late-wait ms and prefetched MB per token, and
tokens/s, medians of `repeats` in one interleaved run.

    python -m scripts.bench.moce_agreement --preset cpu                             # the CPU tables in docs/benchmarks.md
    python -m scripts.bench.moce_agreement --preset h200 --json-out moce_h200.json  # H200, under 3 minutes
    python -m scripts.bench.moce_agreement --tokens 48 --repeats 3                  # the cpu preset, shorter
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench.slow_disk import H200_80B_RECORD_MS, SimulatedDisk
from strata_cli.bench.workloads import default_workloads_dir, load_workloads
from strata_cli.convert import convert
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import (
    ConfigError,
    ConvertOptions,
    GenerateOptions,
    MoceOptions,
    SpecOptions,
    StreamOptions,
)
from strata_cli.runtime import embedded_model_path, load_checkpoint
from strata_cli.telemetry import DecodeStats
from strata_cli.tokenizer import Tokenizer

# J:B[:N][:e][:n][:i] = --moce-protect J --moce-bonus B [--expert-budget N] [--moce-exact-prefill]
# [--moce-natural-prefetch] [--moce-count-inflight]; the demo routes top-2 of 16.
DEFAULT_SETTINGS = ("1:0.25:e", "1:0.5:e", "1:1:e")


@dataclass
class Plan:
    """What one run measures: greedy tokens per prompt, timed repeats, prompt length, cache sizes
    (shares of the experts), MoCE settings (J:B[:N][:e][:n][:i]), simulated ms per read, the prefetch study
    and its cache sizes, and the seconds after which no new point starts (None: no limit)."""

    tokens: int = 48
    repeats: int = 3
    prompt_tokens: int = 128
    fractions: tuple[float, ...] = (0.10, 0.25, 0.50)
    settings: tuple[str, ...] = DEFAULT_SETTINGS
    read_ms: tuple[float, ...] = (0.0,)
    prefetch_study: bool = False
    prefetch_fractions: tuple[float, ...] = (0.25,)
    budget_seconds: float | None = None


PRESETS = {
    # the CPU figures of record: page-cache reads and reads at the 80B-A3B record's H200 cost
    "cpu": Plan(read_ms=(0.0, H200_80B_RECORD_MS), prefetch_study=True),
    # the "H200 streaming preset": the same demo model on the GPU with reads at the cost of
    # an 80B-A3B record on that machine's disk (its own page-cache reads of 98 KB records are near
    # free); smaller than cpu, and the budget stops new points so that it ends inside 3 minutes
    "h200": Plan(tokens=32, repeats=2, settings=("1:0.25:e", "1:1:e"), read_ms=(H200_80B_RECORD_MS,),
                 prefetch_study=True, budget_seconds=120.0),
    # a smoke run (tests, CI-sized)
    "tiny": Plan(tokens=6, repeats=1, prompt_tokens=24, fractions=(0.25,), settings=("1:0.25:e",), read_ms=(0.0,)),
}


FLAGS = {"e": " EP", "n": " NP", "i": " IF"}  # exact prefill, natural (not MoCE-aware) prefetch, in flight counts
# read options a setting may end with: dN = --expert-readahead-depth N, cP = --expert-readahead-min-prob P
READS = {"d": ("readahead_depth", int, " D"), "c": ("readahead_min_prob", float, " C")}
EXACT = "x"  # a setting "x[:dN][:cP]" is exact routing with those read options


def split_setting(text: str) -> tuple[list[str], set[str], dict[str, str]]:
    """`J:B[:N][:e][:n][:i][:dN][:cP]` as (["J", "B"(, "N")], trailing flags, {read letter: value})."""
    parts, flags, reads = text.split(":"), set(), {}
    while parts:
        last = parts[-1]
        if last in FLAGS and last not in flags:
            flags.add(parts.pop())
        elif len(last) > 1 and last[0] in READS and last[0] not in reads and last[1].isdigit():
            reads[last[0]] = parts.pop()[1:]
        else:
            break
    return parts, flags, reads


def read_options(text: str) -> dict:
    """The StreamOptions read knobs a setting ends with (`dN`, `cP`), as keyword arguments.

    Raises:
        ConfigError: a value that is not a number.
    """
    out = {}
    for letter, value in split_setting(text)[2].items():
        name, kind, _ = READS[letter]
        try:
            out[name] = kind(value)
        except ValueError:
            raise ConfigError(f"{letter}{value} in {text!r}: {letter} takes a number") from None
    return out


def parse_setting(text: str) -> MoceOptions | None:
    """`J:B[:N][:e][:n][:i]` as MoceOptions(protect=J, bonus=B, budget=N, exact_prefill=bool(e),
    natural_prefetch=bool(n), count_inflight=bool(i)); None for exact routing (`x`). Trailing read
    options (`read_options`) are skipped.

    Raises:
        ConfigError: a malformed setting or a knob MoceOptions refuses.
    """
    parts, flags, _ = split_setting(text)
    if parts == [EXACT] and not flags:
        return None
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        protect, bonus = int(parts[0]), float(parts[1])
        budget = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ConfigError(f"a MoCE setting is J:B[:N][:e][:n][:i] (protect, bonus, budget, exact prefill, natural "
                          f"prefetch, in-flight reads count as resident), got {text!r}") from None
    return MoceOptions(protect=protect, bonus=bonus, budget=budget, exact_prefill="e" in flags,
                       natural_prefetch="n" in flags, count_inflight="i" in flags)


def label(text: str) -> str:
    parts, flags, reads = split_setting(text)
    name = "exact" if parts == [EXACT] else " ".join(f"{n}{v}" for n, v in zip(("J", "B", "N"), parts))
    return (name + "".join(FLAGS[f] for f in FLAGS if f in flags)
            + "".join(f"{READS[r][2]}{reads[r]}" for r in READS if r in reads))


def open_engine(path: Path, slots: int, moce: MoceOptions | None, disk: SimulatedDisk, *,
                root_prefetch: bool = False, reads: dict | None = None) -> WindowEngine:
    """A streamed engine of `slots` resident experts per layer on `disk`; `reads`: StreamOptions
    read knobs (`read_options`)."""
    stream = StreamOptions(resident_experts=slots, root_prefetch=root_prefetch, **(reads or {}))
    model = load_checkpoint(path, stream=stream, moce=moce)
    disk.attach(model.expert_cache.store)
    return WindowEngine(model)


def decode(engine: WindowEngine, prompt: list[int], tokens: int, *, drafts: int = 0) -> tuple[list[int], float, dict]:
    """Greedy ids, decode seconds (prefill apart), and the stats summary of one decode (serial, or
    `drafts` per window)."""
    stats = DecodeStats()
    ids = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens),
                                  spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats) for t in step.tokens]
    summary = stats.summary()
    return ids, summary["decode_seconds"], summary


def forced_logits(engine: WindowEngine, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Logits (n, V) at each position of `continuation`, reading it one token per window."""
    engine.reset()
    engine.prefill(prompt[:-1])
    rows, pos = [], len(prompt) - 1
    for tok in [prompt[-1], *continuation[:-1]]:
        out = engine.run([tok], pos)
        engine.commit(1)
        rows.append(np.array(out.logits[0].astype(mx.float32)))
        pos += 1
    return np.stack(rows)


def kl(exact: np.ndarray, approx: np.ndarray) -> np.ndarray:
    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(exact.astype(np.float64)), log_softmax(approx.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def timed(engines: dict[str, WindowEngine], prompts: list[list[int]], *, tokens: int, repeats: int,
          drafts: int = 0) -> dict[str, dict]:
    """Every engine decodes every prompt once per repeat, in turn; per engine the median tokens/s
    and per-token means of misses, late waits, late-wait ms, prefetched MB, prefetch reads (used
    or wasted), wasted prefetches (read ahead, picked by no row) and disk reads (demand misses and
    prefetch reads)."""
    seconds = {name: [] for name in engines}
    sums = {name: {"misses": 0.0, "late_waits": 0.0, "late_wait_ms": 0.0, "prefetched_bytes": 0.0,
                   "prefetch_hits": 0.0, "wasted_prefetches": 0.0, "accepted": 0.0, "offered": 0.0}
            for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            total = 0.0
            for p in prompts:
                _, s, summary = decode(engine, p, tokens, drafts=drafts)
                total += s
                ex = summary["experts"] or {}  # None: the model does not stream
                for key in ("misses", "late_waits", "late_wait_ms", "prefetched_bytes", "prefetch_hits",
                            "wasted_prefetches"):
                    sums[name][key] += ex.get(key, 0)
                sums[name]["accepted"] += summary["drafts_kept"]
                sums[name]["offered"] += summary["drafts_offered"]
            seconds[name].append(total)
    n = tokens * len(prompts) * repeats
    out = {}
    for name, ts in seconds.items():
        s = sums[name]
        out[name] = {
            "tokens_per_s": tokens * len(prompts) / statistics.median(ts),
            "misses_per_token": s["misses"] / n, "late_waits_per_token": s["late_waits"] / n,
            "late_wait_ms_per_token": s["late_wait_ms"] / n, "prefetched_mb_per_token": s["prefetched_bytes"] / n / 1e6,
            # every prefetch ends used (a prefetch hit) or wasted (experts/cache.py)
            "prefetch_reads_per_token": (s["prefetch_hits"] + s["wasted_prefetches"]) / n,
            "wasted_prefetches_per_token": s["wasted_prefetches"] / n,
            "disk_reads_per_token": (s["misses"] + s["prefetch_hits"] + s["wasted_prefetches"]) / n,
            "acceptance": s["accepted"] / s["offered"] if s["offered"] else 0.0,
        }
    return out


def agreement(exact: WindowEngine, moce: WindowEngine, prompts, reference, exact_logits, tokens: int) -> dict:
    greedy, top1, kls = [], [], []
    for p, ref, ref_logits in zip(prompts, reference, exact_logits):
        ids = decode(moce, p, tokens)[0]
        same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref))
        greedy.append(same / len(ref))
        logits = forced_logits(moce, p, ref)
        top1.extend((logits.argmax(-1) == ref_logits.argmax(-1)).tolist())
        kls.extend(kl(ref_logits, logits).tolist())
    return {"greedy_agreement": float(np.mean(greedy)), "top1_agreement": float(np.mean(top1)),
            "mean_kl": float(np.mean(kls))}


def measure(path: Path, prompts: list[list[int]], plan: Plan, *, num_experts: int, read_ms: float,
            deadline: float, log, source: Path | None = None) -> list[dict]:
    """One row per (cache size, setting) at one simulated read cost; `source` is the checkpoint
    `path` was converted from (default: the embedded demo model)."""
    source = source or embedded_model_path()
    rows = []
    disk = SimulatedDisk(read_ms)
    for fraction in plan.fractions:
        if time.perf_counter() > deadline:
            log(f"budget reached: skipping {fraction:.0%} at read {read_ms} ms")
            continue
        slots = max(1, round(fraction * num_experts))
        exact = open_engine(path, slots, None, disk)
        resident = WindowEngine(load_checkpoint(source))  # every expert loaded: no streaming at all
        reference = [decode(exact, p, plan.tokens)[0] for p in prompts]
        exact_logits = [forced_logits(exact, p, r) for p, r in zip(prompts, reference)]
        for p in prompts:
            decode(resident, p, plan.tokens)  # warm-up
        engines, quality = {"exact": exact, "resident": resident}, {}
        for text in plan.settings:
            engines[text] = open_engine(path, slots, parse_setting(text), disk, reads=read_options(text))
            quality[text] = agreement(exact, engines[text], prompts, reference, exact_logits, plan.tokens)
        speed = timed(engines, prompts, tokens=plan.tokens, repeats=plan.repeats)
        ex = speed["exact"]
        for text in plan.settings:
            mo = speed[text]
            rows.append({
                "read_ms": read_ms, "cache": f"{fraction:.0%}", "slots": slots, "setting": label(text), **quality[text],
                "exact_misses_per_token": ex["misses_per_token"], "moce_misses_per_token": mo["misses_per_token"],
                "exact_wait_ms_per_token": ex["late_wait_ms_per_token"],
                "moce_wait_ms_per_token": mo["late_wait_ms_per_token"],
                **{f"{who}_{key}": d[key] for who, d in (("exact", ex), ("moce", mo))
                   for key in ("prefetch_reads_per_token", "wasted_prefetches_per_token", "disk_reads_per_token")},
                "resident_tokens_per_s": speed["resident"]["tokens_per_s"], "exact_tokens_per_s": ex["tokens_per_s"],
                "moce_tokens_per_s": mo["tokens_per_s"], "speedup": mo["tokens_per_s"] / ex["tokens_per_s"],
            })
            log(json.dumps(rows[-1]))
        for name, engine in engines.items():
            if name != "resident":
                engine.model.expert_cache.close()
    return rows


PREFETCH_DRAFTS = 3


def measure_prefetch(path: Path, prompts: list[list[int]], plan: Plan, *, num_experts: int, read_ms: float,
                     deadline: float, log) -> list[dict]:
    """Root-only prefetch on and off, exact and MoCE, with drafts: one row per engine and cache size."""
    rows = []
    disk = SimulatedDisk(read_ms)
    routings = {"exact": "x"}  # label -> setting
    if plan.settings:
        routings[label(plan.settings[0])] = plan.settings[0]
    for fraction in plan.prefetch_fractions:
        if time.perf_counter() > deadline:
            log(f"budget reached: skipping the prefetch study at {fraction:.0%}, read {read_ms} ms")
            continue
        slots = max(1, round(fraction * num_experts))
        engines = {(routing, root): open_engine(path, slots, parse_setting(text), disk, root_prefetch=root,
                                                reads=read_options(text))
                   for routing, text in routings.items() for root in (False, True)}
        for engine in engines.values():
            decode(engine, prompts[0], plan.tokens, drafts=PREFETCH_DRAFTS)  # warm-up
        speed = timed({f"{r}|{root}": e for (r, root), e in engines.items()}, prompts, tokens=plan.tokens,
                      repeats=plan.repeats, drafts=PREFETCH_DRAFTS)
        for routing in routings:
            base = speed[f"{routing}|False"]["tokens_per_s"]
            for root in (False, True):
                rows.append({"read_ms": read_ms, "cache": f"{fraction:.0%}", "slots": slots, "routing": routing,
                             "root_prefetch": root, **speed[f"{routing}|{root}"],
                             "vs_all_rows": speed[f"{routing}|{root}"]["tokens_per_s"] / base})
                log(json.dumps(rows[-1]))
        for engine in engines.values():
            engine.model.expert_cache.close()
    return rows


PREFETCH_COLUMNS = ("read_ms", "cache", "slots", "routing", "root_prefetch", "acceptance", "misses_per_token",
                    "late_waits_per_token", "late_wait_ms_per_token", "prefetched_mb_per_token", "tokens_per_s",
                    "vs_all_rows")

AGREEMENT_COLUMNS = ("read_ms", "cache", "slots", "setting", "greedy_agreement", "top1_agreement", "mean_kl",
                     "exact_misses_per_token", "moce_misses_per_token", "exact_prefetch_reads_per_token",
                     "moce_prefetch_reads_per_token", "exact_wasted_prefetches_per_token",
                     "moce_wasted_prefetches_per_token", "exact_disk_reads_per_token", "moce_disk_reads_per_token",
                     "exact_wait_ms_per_token", "moce_wait_ms_per_token", "resident_tokens_per_s",
                     "exact_tokens_per_s", "moce_tokens_per_s", "speedup")


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + " |")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def plan_from_args(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--tokens", type=int, help="greedy tokens per prompt")
    parser.add_argument("--repeats", type=int, help="timed runs per engine (median)")
    parser.add_argument("--prompt-tokens", type=int, help="each prompt's last N tokens")
    parser.add_argument("--fractions", type=float, nargs="+", help="expert-cache sizes, shares of the experts")
    parser.add_argument("--moce", dest="settings", nargs="+", metavar="J:B[:N][:e][:n][:i][:dN][:cP]",
                        help="MoCE settings: protect J, bonus B, optional budget N, e: exact prefill, "
                             "n: natural (not MoCE-aware) prefetch, i: in-flight reads count as resident, "
                             "dN: read-ahead depth N (demand reads first), cP: read ahead only at predicted "
                             "probability >= P; 'x[:dN][:cP]' is exact routing with those read options")
    parser.add_argument("--read-ms", type=float, nargs="+", help="simulated ms per expert read (0: real reads)")
    parser.add_argument("--prefetch-study", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure --spec-root-prefetch with drafts, exact and the first MoCE setting")
    parser.add_argument("--budget-seconds", type=float, help="start no new point after this many seconds")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("tokens", "repeats", "prompt_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    plan = PRESETS[args.preset]
    plan = Plan(**{**plan.__dict__, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(args).items()
                                         if k in Plan.__dataclass_fields__ and v is not None}})
    for text in plan.settings:
        parse_setting(text)
        StreamOptions(**read_options(text))
    return plan, args


def run(plan: Plan, *, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Build the streamed demo checkpoint, then measure agreement (and the prefetch study)."""
    start = time.perf_counter()
    deadline = start + plan.budget_seconds if plan.budget_seconds else float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        path = convert(embedded_model_path(), Path(tmp) / "demo-stream", options=ConvertOptions(stream=True)).path
        tokenizer = Tokenizer(path)
        prompts = [tokenizer.encode(w.prompts[0])[-plan.prompt_tokens:] for w in load_workloads(default_workloads_dir())]
        num_experts = json.loads((path / "config.json").read_text())["num_experts"]
        rows, prefetch = [], []
        for read_ms in plan.read_ms:
            rows += measure(path, prompts, plan, num_experts=num_experts, read_ms=read_ms, deadline=deadline, log=log)
        if plan.prefetch_study:
            for read_ms in plan.read_ms:
                prefetch += measure_prefetch(path, prompts, plan, num_experts=num_experts, read_ms=read_ms,
                                             deadline=deadline, log=log)
    meta = {"commit": _commit(), "machine": platform.platform(), "device": str(mx.default_device()),
            "seconds": time.perf_counter() - start, "plan": asdict(plan)}
    return {"meta": meta, "agreement": rows, "prefetch": prefetch}


def main(argv: list[str] | None = None) -> None:
    plan, args = plan_from_args(argv)
    report = run(plan)
    print(table(report["agreement"], AGREEMENT_COLUMNS))
    if report["prefetch"]:
        print()
        print(table(report["prefetch"], PREFETCH_COLUMNS))
    print(f"\n{report['meta']['seconds']:.0f} s, commit {report['meta']['commit']}, {report['meta']['device']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
