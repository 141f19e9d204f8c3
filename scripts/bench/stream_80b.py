"""Expert streaming at full scale (issue 38): a 48-layer Qwen3-Next-80B-A3B-shaped 4-bit checkpoint
read from disk, tokens/s by expert-cache size, serial, `--suffix-draft 3` and `auto`, cold and warm.

One command builds and measures, within `--budget-seconds` (building included), writing the JSON
after every row; a phase or row that would start after the budget is skipped and named in `skipped`.

1. Build (`stream_curve.build`), or reuse `--dir` when it holds a complete build of these shapes:
   dense weights as stream_curve draws them, and per layer the experts drawn as floats (normal,
   std 1/sqrt(cols)) and quantized to 4 bits by `mx.quantize` (the quantizer mlx-lm calls) on the
   default device, written straight into the streamed layout while the next layer is drawn: one
   layer in memory at a time, one copy on disk (47.2 GB at 48 layers, 43.5 GB of it experts).
2. The disk: sequential (one thread) and random (`--io-threads` threads) reads of 4, 16 and 64 KiB
   records and of whole expert records, O_DIRECT and buffered (page cache dropped before each).
3. Decoding at each expert-cache size (`--fractions`) and mode (serial, draft3, auto), cold and warm:
   each run starts from an empty expert cache (prefill, then `--tokens` greedy tokens); cold drops
   the page cache first (reads: `--cold-io`), warm repeats the run with buffered reads after every
   cold row, the page cache holding what the cold runs read. Per row: tokens/s, bytes read per token, hit rate,
   late waits, experts per layer per window by T, and the decode time per token split into waiting
   on reads, blocking on the routing read-back, installing experts, and the rest (compute, drafting);
   and the read-back itself split by a line through its per-block waits against the records
   installed before it (`router_sync_split`: ms per installed record, ms without installs).
   `speculative_identical`: draft3 and auto produced serial's tokens at every cache size.
4. Cache-aware routing (MoCE, approximate) at `--moce-fraction` (25%): tokens/s against exact
   routing, cold, and teacher-forced top-1 agreement with exact greedy tokens (moce_agreement's parts).
5. With `--profile FRACTION`: one warm serial decode at that cache size under cProfile, the
   functions of most cumulative and of most own time per token (`profile`): where the host's time goes.

    python -m scripts.bench.stream_80b --tiny                                  # CPU, under a minute
    python -m scripts.bench.stream_80b --dir /tmp/strata-80b --budget-seconds 420 \\
        --json-out docs/runs/h200_stream_80b.json                              # the H200 run
    python -m scripts.bench.stream_80b --dir /tmp/strata-80b --budget-seconds 420 \\
        --json-out docs/runs/h200_stream_80b.json --resume                     # what it left out

Cache sizes go in order of need (10%, 25%, 5%, 50%, 100%), every cold row before any warm one.

`disk_bound_tokens_per_s` of a row is the disk's random whole-record read rate over the row's bytes
read per token; `of_disk_bound` is the row's tokens/s over it (issue 38's target: >= 0.8 at 10%, cold).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import math
import mmap
import os
import platform
import pstats
import shutil
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from scripts.bench import stream_curve
from scripts.bench.moce_agreement import (
    _commit,
    decode,
    forced_logits,
    kl,
    label,
    parse_setting,
)
from strata_cli.calibrate import backend_name, device_cost_prior
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.experts.cache import ExpertCache
from strata_cli.experts.store import ExpertStore, layer_of
from strata_cli.experts.switch import StreamedSwitchGLU
from strata_cli.model import qwen3_next
from strata_cli.options import (
    MAX_SUFFIX_DRAFT,
    GenerateOptions,
    SpecOptions,
    StreamOptions,
    parse_suffix_draft,
)
from strata_cli.runtime import embedded_model_path, load_checkpoint
from strata_cli.tokenizer import Tokenizer

PRESETS = {  # the model shapes; both keep a vocabulary the demo tokenizer's ids fit
    "full": {**stream_curve.PRESETS["gpu"]["model"], "num_hidden_layers": 48},
    "tiny": {**stream_curve.PRESETS["tiny"]["model"], "vocab_size": 4096},
}
FRACTIONS = (0.10, 0.25, 0.05, 0.50, 1.00)  # in order of need: the 10% target and MoCE's 25% first
MODES = {
    "serial": SpecOptions(),
    "draft3": SpecOptions(max_drafts=3),
    # as `--suffix-draft auto`: the controller chooses, up to 7 drafts
    "auto": SpecOptions(**dict(zip(("max_drafts", "auto"), parse_suffix_draft("auto")))),
}
PROMPT = "The cat sat on the mat. The cat sat on the mat."  # repeats: the drafter has a suffix to match
RECORD_SIZES = (4096, 16384, 65536)  # plus the whole expert record
PROFILE_FUNCTIONS = 40  # the profile keeps this many functions of most cumulative time, and of most own time


# -- building ------------------------------------------------------------------------------------


def quantized_experts(seed: int):
    """Per layer, float expert weights (normal, std 1/sqrt(cols)) quantized by `mx.quantize`."""
    def draw(layer: int, config, dtype) -> dict:
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        keys = mx.random.split(mx.random.key(seed * 100_003 + layer), 3)
        tensors = {}
        shapes = (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))
        for key, (proj, (rows, cols)) in zip(keys, shapes):
            w = mx.random.normal((E, rows, cols), dtype=dtype, key=key) * (cols ** -0.5)
            q, scales, biases = mx.quantize(w, group_size=stream_curve.GROUP_SIZE, bits=stream_curve.BITS)
            tensors.update({f"{proj}.weight": q, f"{proj}.scales": scales, f"{proj}.biases": biases})
        return tensors

    return draw


def ensure_checkpoint(path: Path, params: dict, *, seed: int, dtype: mx.Dtype, rebuild: bool, log) -> dict:
    """Build the checkpoint unless `path` holds a complete one of these shapes; the tokenizer of the
    embedded demo model goes with it (the prompt is text). Returns {seconds, reused}."""
    start = time.perf_counter()
    reused = not rebuild and stream_curve.is_built(path, params)
    if reused:
        log(f"reusing the complete checkpoint in {path}")
    else:
        path.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path).free + sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        need = checkpoint_bytes(params, dtype)
        if free < 1.02 * need:
            raise SystemExit(f"{path}: the checkpoint needs {need / 1e9:.1f} GB, the disk has {free / 1e9:.1f} GB")
        log(f"building {params['num_hidden_layers']} layers ({need / 1e9:.1f} GB) into {path} on "
            f"{mx.default_device()} ({free / 1e9:.0f} GB free)")
        stream_curve.build(path, params, seed=seed, dtype=dtype, log=log, draw_experts=quantized_experts(seed))
        log("flushing the written checkpoint to disk")
        os.sync()  # so that dropping the page cache later costs no writes
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_model_path() / name, path / name)
    return {"seconds": time.perf_counter() - start, "reused": reused}


def checkpoint_bytes(params: dict, dtype: mx.Dtype) -> int:
    """Bytes the build writes: aligned 4-bit expert records (a scale and a bias per group) and the
    dense weights."""
    H, I, E, L = (params[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts", "num_hidden_layers"))
    per_matrix = I * H * stream_curve.BITS // 8 + 2 * dtype.size * I * H // stream_curve.GROUP_SIZE
    record = -(-3 * per_matrix // 4096) * 4096
    dense = sum(math.prod(v.shape) for k, v in tree_flatten(
        qwen3_next.Model(qwen3_next.Config.from_dict({**stream_curve.BASE, **params})).parameters())
        if ".switch_mlp." not in k)
    return L * E * record + dense * dtype.size


# -- the disk ------------------------------------------------------------------------------------


def read_rate(files: list[Path], *, record: int, pattern: str, direct: bool, threads: int, seconds: float,
              seed: int) -> float | None:
    """GB/s of `record`-byte preads over `files`: "sequential" (one thread, consecutive records from a
    random start) or "random" (`threads` threads, records at random aligned offsets); None where
    the file system refuses O_DIRECT."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    try:
        fds = [os.open(f, flags) for f in files]
    except OSError:
        return None
    sizes = [os.fstat(fd).st_size // record for fd in fds]
    total = [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker(n: int) -> None:
        rng = np.random.default_rng([seed, n])
        buf = mmap.mmap(-1, record)  # page-aligned, as O_DIRECT needs
        done = 0
        f, i = int(rng.integers(len(fds))), int(rng.integers(max(1, sizes[0] // 2)))
        while time.perf_counter() < deadline:
            if pattern == "random":
                f = int(rng.integers(len(fds)))
                i = int(rng.integers(sizes[f]))
            elif i >= sizes[f]:
                f, i = (f + 1) % len(fds), 0
            done += os.preadv(fds[f], [buf], i * record)
            i += 1
        buf.close()
        with lock:
            total[0] += done

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads if pattern == "random" else 1)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return total[0] / elapsed / 1e9


def measure_disk(path: Path, *, threads: int, seconds: float, seed: int, log) -> dict:
    """Every record size, pattern and I/O mode; the page cache is dropped before each buffered one."""
    files = sorted((path / "experts").glob("*.bin"))
    store = ExpertStore(path, io="buffered", verify=False)
    stride = next(iter(store.blocks.values())).stride
    store.close()
    results = []
    for direct in (True, False):
        for record in (*RECORD_SIZES, stride):
            for pattern in ("sequential", "random"):
                dropped = False if direct else stream_curve.drop_page_cache()
                rate = read_rate(files, record=record, pattern=pattern, direct=direct, threads=threads,
                                 seconds=seconds, seed=seed)
                results.append({"io": "direct" if direct else "buffered", "record_bytes": record, "pattern": pattern,
                                "threads": threads if pattern == "random" else 1, "GBps": rate,
                                **({} if direct else {"page_cache_dropped": dropped})})
                log(f"  disk {results[-1]['io']:<8} {pattern:<10} {record / 1024:8.0f} KiB: "
                    + ("refused" if rate is None else f"{rate:.2f} GB/s"))
    whole = [r["GBps"] for r in results if r["record_bytes"] == stride and r["pattern"] == "random" and r["GBps"]]
    return {"record_bytes": stride, "rows": results, "random_record_GBps": max(whole)}


# -- decoding ------------------------------------------------------------------------------------


def fresh_engine(model, path: Path, *, slots: int, io: str, threads: int, dtype: mx.Dtype,
                 warm_rows: set[int], readahead: dict | None = None) -> WindowEngine:
    """`model` with a new, empty expert cache of `slots` per layer reading with `io`, in a new
    engine that knows the window shapes this process already built (`warm_rows`). Cheaper than
    loading the model again: the dense weights stay. Exact routing only (MoCE hooks the old cache)."""
    # in layer order, as the cache needs (named_modules lists them last layer first): router
    # prefetch reads for the block after each one
    switches = sorted((m for _, m in model.named_modules() if isinstance(m, StreamedSwitchGLU)),
                      key=lambda m: layer_of(m.path))
    modules = dict(model.named_modules())
    blocks = [(m.path, modules[m.path.rsplit(".", 1)[0]]) for m in switches]
    if model.expert_cache is not None:
        release(model)  # the old banks go before the new ones are allocated
    options = StreamOptions(resident_experts=slots, io=io, io_threads=threads, **(readahead or {}))
    store = ExpertStore(path, io=io, verify=options.verify)
    cache = ExpertCache(store, blocks, num_slots=slots, dtype=dtype, options=options)
    for m in switches:
        m.cache = cache
    model.expert_cache = cache
    engine = WindowEngine(model)
    engine.warm_rows = warm_rows  # one set: a shape one engine builds, every later one has
    return engine


def measure_row(engine: WindowEngine, prompt: list[int], *, tokens: int, spec: SpecOptions, disk_gbps: float) -> dict:
    """One decode's figures (stream_curve.one_run's and the time split) and its tokens."""
    run = stream_curve.one_run(engine, prompt, tokens=tokens, spec=spec)
    run["time_split_ms_per_token"] = run.pop("ms_per_token")
    run["bytes_read_per_token"] = read = run.pop("bytes_per_token")
    bound = disk_gbps * 1e9 / read if read else None
    return {**run, "disk_bound_tokens_per_s": bound, "of_disk_bound": run["tokens_per_s"] / bound if bound else None,
            "io_mode": engine.expert_cache.store.io_mode, "staging": engine.expert_cache.staging()}


def sweep(model, path: Path, prompt: list[int], args, modes: dict[str, SpecOptions], *, E: int, dtype,
          disk_gbps: float, dropped: bool, warm_rows: set[int], deadline: float, report: dict, save, log) -> None:
    """Every cold row (cache size by mode), then every warm one: when the budget runs short, the
    warm repeats go first. With `--rounds N` a cache size runs its modes N times over, each round
    starting one mode later, and a row is its median run (`median_run`). Rows land in
    report["rows"] as they are measured, each run updating its row."""
    cold_io = args.cold_io if dropped else "direct"  # without a drop, only O_DIRECT keeps the page cache out
    cold_here = set()  # the cold rows this process ran: what the page cache holds
    readahead = {"readahead_depth": args.readahead_depth, "readahead_min_prob": args.readahead_min_prob}
    setting = readahead_label(readahead)
    for temperature in args.temperatures:
        for fraction in args.fractions:
            slots = max(1, math.ceil(E * fraction))
            todo = [m for m in args.modes if find(report["rows"], fraction, m, temperature, readahead) is None]
            runs = {mode: [] for mode in todo}  # the modes the run this one resumes did not measure
            for turn in range(args.rounds * len(todo)):
                mode = todo[(turn + turn // len(todo)) % len(todo)]
                name = f"{fraction:.0%} {mode} {temperature}{setting}"
                if time.perf_counter() > deadline:
                    if not runs[mode]:
                        report["skipped"].append(name)
                        log(f"budget reached: skipping {name}")
                    continue
                io = cold_io if temperature == "cold" else "buffered"
                engine = fresh_engine(model, path, slots=slots, io=io, threads=args.io_threads, dtype=dtype,
                                      warm_rows=warm_rows, readahead=readahead)
                if temperature == "cold" and dropped:
                    stream_curve.drop_page_cache()
                runs[mode].append(measure_row(engine, prompt, tokens=args.tokens, spec=modes[mode],
                                              disk_gbps=disk_gbps))
                del engine  # it holds the cache: its banks must go before the next row allocates its own
                row = {"cache_fraction": fraction, "slots": slots, "mode": mode, "temperature": temperature,
                       **readahead, **median_run(runs[mode])}
                if temperature == "warm":
                    primed = cold_io == "buffered" and (fraction, mode) in cold_here
                    row["page_cache"] = ("holds the cold run's reads" if primed
                                         else "not filled by a cold run of this row")
                serial = None if (mode, temperature) == ("serial", "cold") else find(
                    report["rows"], fraction, "serial", "cold", readahead)
                row["identical_to_serial"] = None if serial is None else row["output"] == serial["output"]
                earlier = find(report["rows"], fraction, mode, temperature, readahead)
                if earlier is not None:
                    report["rows"].remove(earlier)
                report["rows"].append(row)
                if temperature == "cold":
                    cold_here.add((fraction, mode))
                last = runs[mode][-1]
                split = last["time_split_ms_per_token"]
                rounds = f" {len(runs[mode])}/{args.rounds}" if args.rounds > 1 else ""
                log(f"  {name + rounds:<18} {last['tokens_per_s']:7.2f} tok/s  {last['bytes_read_per_token'] / 1e6:8.1f} "
                    f"MB/token  hit {last['hit_rate']:.0%}  late waits {last['late_waits']}  ms/token: reads "
                    f"{split['read_wait']:.0f} / sync {split['router_sync']:.0f} / "
                    f"installs {split['installs']:.0f} / compute {split['compute']:.0f}{sync_note(last)}  "
                    f"same as serial: {row['identical_to_serial']}  ({deadline - time.perf_counter():.0f} s of the sweep's budget left)")
                save()
    release(model)


def profile_row(model, path: Path, prompt: list[int], args, *, E: int, dtype, warm_rows: set[int]) -> dict:
    """Where a streamed token's host time goes: serial decoding at the `--profile` cache size
    under cProfile from the second token on (the prompt and the first token apart), warm (a run
    before it puts the records in the page cache), the functions of most cumulative time per
    token (`functions`) and of most own time (`own_functions`). cProfile adds its own cost to
    every Python call, and MLX's calls count in their caller's own time, the device's work they
    wait for included. From Python 3.12 cProfile also sees the reader threads' calls, in the
    main thread's stack: a function waiting on a read then holds the reads' time too."""
    slots = max(1, math.ceil(E * args.profile))
    profiler = cProfile.Profile()
    for profiled in (False, True):
        engine = fresh_engine(model, path, slots=slots, io="buffered", threads=args.io_threads, dtype=dtype,
                              warm_rows=warm_rows)
        steps = generate(engine, prompt, options=GenerateOptions(max_tokens=args.tokens), spec=MODES["serial"],
                         eos_ids=())
        next(steps)  # the prompt and the first token
        start = time.perf_counter()
        if profiled:
            profiler.enable()
        tokens = sum(len(step.tokens) for step in steps)
        profiler.disable()
        seconds = time.perf_counter() - start
        del engine, steps
    release(model)
    root = Path(__file__).resolve().parents[2]

    def where(file: str, line: int, name: str) -> str:
        at = Path(file)
        return f"{at.relative_to(root) if at.is_relative_to(root) else at.name}:{line}({name})"

    def listed(order: int) -> list[dict]:
        entries = sorted(stats.items(), key=lambda kv: -kv[1][order])[:PROFILE_FUNCTIONS]
        return [{"function": where(*key), "calls": nc, "own_ms_per_token": 1e3 * tt / tokens,
                 "cumulative_ms_per_token": 1e3 * ct / tokens} for key, (_, nc, tt, ct, _) in entries]

    stats = pstats.Stats(profiler).stats
    return {"cache_fraction": args.profile, "slots": slots, "tokens": tokens, "profiled_tokens_per_s": tokens / seconds,
            "python": platform.python_version(), "functions": listed(3), "own_functions": listed(2)}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower of two), with every run's tokens/s beside it
    (`rounds_tokens_per_s`, in the order run) and whether every run decoded the same tokens."""
    median = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    if len(runs) == 1:
        return median
    return {**median, "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "same_tokens_every_round": all(r["output"] == runs[0]["output"] for r in runs)}


def sync_note(row: dict) -> str:
    """The routing read-back's split (stream_curve.router_sync_split), for the row's log line."""
    split = row.get("router_sync_split")
    if not split:
        return ""
    return (f" (a read-back: {split['ms_without_installs']:.1f} ms + {split['ms_per_installed_record']:.2f} ms "
            f"per record installed before it)")


def find(rows: list[dict], fraction: float, mode: str, temperature: str, readahead: dict | None = None) -> dict | None:
    """The row of this cache size, mode, temperature and read-ahead setting (rows from before the
    setting was recorded ran the defaults)."""
    key = (fraction, mode, temperature, readahead_of(readahead or {}))
    return next((r for r in rows if (r["cache_fraction"], r["mode"], r["temperature"], readahead_of(r)) == key), None)


def readahead_of(where: dict) -> tuple:
    """(read-ahead depth, min probability) of a row or a setting, the defaults where absent."""
    return where.get("readahead_depth"), where.get("readahead_min_prob", 0.0)


def readahead_label(where: dict) -> str:
    """" D8 C0.3" for a row or setting off the default reads, "" on them."""
    depth, prob = readahead_of(where)
    return "" if (depth, prob) == readahead_of({}) else f" D{depth or '-'} C{prob:g}"


def release(model) -> None:
    """Stop `model`'s expert reads and free its slot banks (before another model's are allocated)."""
    model.expert_cache.close()
    for _, m in model.named_modules():
        if isinstance(m, StreamedSwitchGLU):
            m.cache = None
    model.expert_cache = None
    gc.collect()
    mx.clear_cache()


def identical(rows: list[dict]) -> bool | None:
    """Whether every speculative row compared with serial produced serial's tokens and every row's
    rounds the same tokens (None: no pair)."""
    checked = [r["identical_to_serial"] for r in rows
               if r["mode"] != "serial" and r["identical_to_serial"] is not None]
    if any(r.get("same_tokens_every_round") is False for r in rows):
        return False  # a row's rounds decoded different tokens: no run is the reference
    return all(checked) if checked else None


def moce_study(path: Path, prompt: list[int], args, *, E: int, dropped: bool, log) -> dict:
    """Exact against cache-aware routing at one cache size, cold: tokens/s and agreement
    (approximate). Each routing gets a model of its own, loaded alike and with its one-row window
    built (`warm(1)`) before the page cache is dropped and it decodes."""
    slots = max(1, math.ceil(E * args.moce_fraction))
    io = args.cold_io if dropped else "direct"
    stream = StreamOptions(resident_experts=slots, io=io, io_threads=args.io_threads)
    engines, speed = {}, {}
    for name, moce in (("exact", None), ("moce", parse_setting(args.moce))):
        engine = engines[name] = WindowEngine(load_checkpoint(path, stream=stream, moce=moce))
        engine.warm(1)
        if dropped:
            stream_curve.drop_page_cache()
        ids, _, summary = decode(engine, prompt, args.tokens)
        speed[name] = {"ids": ids, "tokens_per_s": summary["tokens_per_s"],
                       "bytes_read_per_token": summary["experts"]["bytes_read_per_token"]}
    reference = speed["exact"]["ids"]
    exact_logits = forced_logits(engines["exact"], prompt, reference)
    moce_logits = forced_logits(engines["moce"], prompt, reference)
    same = next((i for i, (a, b) in enumerate(zip(speed["moce"]["ids"], reference)) if a != b), len(reference))
    result = {
        "approximate": True, "setting": args.moce, "label": label(args.moce), "cache_fraction": args.moce_fraction,
        "slots": slots, "io_mode": engines["exact"].expert_cache.store.io_mode, "tokens": args.tokens,
        "exact_tokens_per_s": speed["exact"]["tokens_per_s"], "moce_tokens_per_s": speed["moce"]["tokens_per_s"],
        "speedup": speed["moce"]["tokens_per_s"] / speed["exact"]["tokens_per_s"],
        "exact_bytes_read_per_token": speed["exact"]["bytes_read_per_token"],
        "moce_bytes_read_per_token": speed["moce"]["bytes_read_per_token"],
        "top1_agreement": float(np.mean(moce_logits.argmax(-1) == exact_logits.argmax(-1))),
        "greedy_agreement": same / len(reference), "mean_kl": float(np.mean(kl(exact_logits, moce_logits))),
    }
    for engine in engines.values():
        release(engine.model)
    log(f"  MoCE {result['label']} at {args.moce_fraction:.0%} (approximate): "
        f"{result['moce_tokens_per_s']:.2f} tok/s against exact {result['exact_tokens_per_s']:.2f} "
        f"({result['speedup']:.2f}x), teacher-forced top-1 agreement {result['top1_agreement']:.1%}")
    return result


# -- report --------------------------------------------------------------------------------------


def resumed(path: Path, report: dict) -> dict:
    """What an earlier run of the same shapes, tokens and prompt (its JSON at `path`) measured:
    nothing when there is no such file."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    for key in ("model", "tokens_per_run", "prompt", "dtype"):
        if earlier.get(key) != report[key]:
            raise SystemExit(f"{path}: --resume needs the same {key} as that run ({earlier.get(key)!r})")
    kept = {k: earlier[k] for k in ("build", "disk", "disk_read_gb_s", "moce", "profile") if k in earlier}
    return {**kept, "rows": earlier["rows"],
            "resumed_from": {"tree": earlier.get("tree"), "seconds": earlier.get("seconds")}}


def table(rows: list[dict]) -> str:
    lines = [("| cache | mode | cold/warm | io | tok/s | MB read/token | hit rate | late waits | union/layer by T | "
              "ms/token: reads / sync / installs / compute | disk-bound tok/s | of bound | = serial |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def order(r: dict) -> tuple:
        depth, prob = readahead_of(r)
        return r["temperature"], r["cache_fraction"], depth or 0, prob, list(MODES).index(r["mode"])

    for r in sorted(rows, key=order):
        s, bound, share = r["time_split_ms_per_token"], r["disk_bound_tokens_per_s"], r["of_disk_bound"]
        unions = " ".join(f"{t}:{u:.1f}" for t, u in r["union_per_layer_by_T"].items())
        mode = r["mode"] + readahead_label(r)
        lines.append(f"| {r['cache_fraction']:.0%} | {mode} | {r['temperature']} | {r['io_mode']} | "
                     f"{r['tokens_per_s']:.2f}{spread(r)} | {r['bytes_read_per_token'] / 1e6:.1f} | {r['hit_rate']:.0%} | "
                     f"{r['late_waits']} | {unions} | {s['read_wait']:.0f} / {s['router_sync']:.0f} / "
                     f"{s['installs']:.0f} / {s['compute']:.0f} | {'-' if bound is None else f'{bound:.2f}'} | "
                     f"{'-' if share is None else f'{share:.0%}'} | {r['identical_to_serial']} |")
    return "\n".join(lines)


def spread(row: dict) -> str:
    """" (1.20-1.31)": the range of a row's rounds, for the table ("" for one run)."""
    rounds = row.get("rounds_tokens_per_s")
    return f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds else ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU-sized shapes (4 layers), every phase, under a minute")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers (default 48; tiny 4)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="checkpoint directory (default /tmp/strata-80b[-tiny])")
    parser.add_argument("--rebuild", action="store_true", help="build even if --dir holds a complete checkpoint")
    parser.add_argument("--tokens", type=int, default=None, help="greedy tokens per run (default 16; tiny 8)")
    parser.add_argument("--prompt", default=PROMPT, help="the prompt text (the demo model's tokenizer)")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each cache size's modes this many times over, each round starting one mode later, "
                             "and keep each mode's median run (default 1): single runs of cold reads vary by 10-20%%")
    parser.add_argument("--temperatures", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    parser.add_argument("--cold-io", choices=("buffered", "direct"), default="buffered",
                        help="reads of cold runs (default buffered, the page cache dropped first, so that the warm "
                             "run finds what it read; direct when the page cache cannot be dropped)")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--readahead-depth", type=int, default=None,
                        help="demand reads first, at most this many read-aheads at the disk (StreamOptions; default: "
                             "every read in submission order); rows are kept per setting, so a --resume with "
                             "another setting measures its rows beside the first's")
    parser.add_argument("--readahead-min-prob", type=float, default=0.0,
                        help="router read-ahead only of picks some row predicts at this probability (default 0)")
    parser.add_argument("--disk-seconds", type=float, default=None,
                        help="seconds per disk figure (default 1; tiny 0.05)")
    parser.add_argument("--moce", default="1:1:e", help="the MoCE setting (moce_agreement's J:B[:N][:e]...); "
                                                         "'none' skips the study")
    parser.add_argument("--moce-fraction", type=float, default=0.25)
    parser.add_argument("--moce-reserve", type=float, default=60.0,
                        help="seconds of the budget kept for the MoCE study (default 60)")
    parser.add_argument("--profile", type=float, default=None, metavar="FRACTION",
                        help="after the rows, profile one warm serial decode at this cache size (cProfile: the "
                             "functions of most cumulative and of most own time per token, in the JSON's "
                             "`profile`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-seconds", type=float, default=450.0,
                        help="start no row after this many seconds less --moce-reserve, nor the MoCE study after "
                             "it, building included (default 450)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run --json-out holds (same shapes, tokens and prompt): keep its disk "
                             "figures, rows and MoCE result, and measure only what it lacks")
    args = parser.parse_args(argv)
    if args.resume and args.json_out is None:
        parser.error("--resume continues the run in --json-out; give --json-out")
    args.tokens = args.tokens or (8 if args.tiny else 16)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.tokens < 2:
        parser.error(f"--tokens must be at least 2, got {args.tokens}")
    if not all(0 < f <= 1 for f in [*args.fractions, args.moce_fraction, *([args.profile] if args.profile else [])]):
        parser.error("cache fractions must be in (0, 1]")
    if args.moce != "none":
        parse_setting(args.moce)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_seconds
    name = "tiny" if args.tiny else "full"
    params = {**PRESETS[name], **({"num_hidden_layers": args.layers} if args.layers else {})}
    path = args.dir or Path(f"/tmp/strata-80b{'-tiny' if args.tiny else ''}")
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    report = {"tree": _commit(), "device": backend_name(), "layers": params["num_hidden_layers"],
              "model": params, "dtype": str(dtype).rsplit(".", 1)[-1], "tokens_per_run": args.tokens,
              "prompt": args.prompt, "skipped": [], "rows": []}
    if args.resume:
        report.update(resumed(args.json_out, report))

    def save() -> None:
        report["seconds"] = time.perf_counter() - start
        report["speculative_identical"] = identical(report["rows"])
        if args.json_out:
            tmp = args.json_out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(args.json_out)

    build = ensure_checkpoint(path, params, seed=args.seed, dtype=dtype, rebuild=args.rebuild, log=log)
    report["build"] = report["build"] if build["reused"] and "build" in report else build
    experts = sum(f.stat().st_size for f in (path / "experts").glob("*.bin"))
    report["experts_gb"] = experts / 1e9
    report["checkpoint_gb"] = (experts + (path / "model.safetensors").stat().st_size) / 1e9
    dropped = stream_curve.drop_page_cache()
    report["page_cache_dropped"] = dropped
    log(f"checkpoint {report['checkpoint_gb']:.1f} GB ({report['experts_gb']:.1f} GB of experts), built in "
        f"{report['build']['seconds']:.0f} s; page cache drop: {'yes' if dropped else 'refused'}")
    save()
    if "disk" in report:
        log(f"disk: kept from {args.json_out}")
    else:
        report["disk"] = measure_disk(path, threads=args.io_threads, seed=args.seed, log=log,
                                      seconds=args.disk_seconds or (0.05 if args.tiny else 1.0))
        report["disk_read_gb_s"] = report["disk"]["random_record_GBps"]
        save()

    tokenizer = Tokenizer(path)
    prompt = tokenizer.encode(args.prompt)
    if max(prompt) >= params["vocab_size"]:
        raise SystemExit(f"the prompt's ids reach {max(prompt)}; the model's vocabulary is {params['vocab_size']}")
    E = params["num_experts"]
    model = load_checkpoint(path, stream=StreamOptions(resident_experts=E, io="buffered", io_threads=args.io_threads))
    # every expert read in file order first: the shapes and the cost curve below would otherwise
    # read them one miss at a time (151 and 232 s of a 48-layer run on the H200, 2026-12-02)
    def preloaded(done: int, total: int) -> None:
        if done % 8 == 0 or done == total:
            log(f"  experts of {done}/{total} blocks read")

    start_preload = time.perf_counter()
    records = model.expert_cache.preload(progress=preloaded)
    report["preload_seconds"] = time.perf_counter() - start_preload
    log(f"every expert read in file order: {records} records in {report['preload_seconds']:.1f} s")
    engine = WindowEngine(model)
    # every window shape built now, every expert resident, so that no row pays for it (a GPU builds
    # them on first use otherwise: MLX's kernel JIT and the layers' traces)
    log(f"building window shapes T = 1..{MAX_SUFFIX_DRAFT + 1}")
    report["shape_warmup_seconds"] = sum(engine.warm_up(MAX_SUFFIX_DRAFT + 1).values())
    log(f"  {report['shape_warmup_seconds']:.1f} s")
    warm_rows = engine.warm_rows
    # `auto` as the CLI runs it: the device's window-cost curve (cached or measured, every expert
    # resident: the compute); the cache's own draft read cost adds the reads
    prior, seconds = device_cost_prior(engine, identity=f"stream_80b:{json.dumps(params, sort_keys=True)}",
                                       dtype=report["dtype"], max_T=MAX_SUFFIX_DRAFT + 1)
    modes = {**MODES, "auto": dataclasses.replace(MODES["auto"], cost_prior=prior)}
    report["auto_cost_prior"] = {"source": prior.source, "calibration_seconds": seconds}
    log(f"auto's window-cost curve: {prior.source} ({seconds:.1f} s)")
    del engine
    reserve = args.moce_reserve if args.moce != "none" else 0.0
    sweep(model, path, prompt, args, modes, E=E, dtype=dtype, disk_gbps=report["disk_read_gb_s"], dropped=dropped,
          warm_rows=warm_rows, deadline=deadline - reserve, report=report, save=save, log=log)
    if args.profile is None or "profile" in report:
        pass
    elif time.perf_counter() > deadline - reserve:
        report["skipped"].append("profile")
        log("budget reached: skipping the profile")
    else:
        report["profile"] = profile_row(model, path, prompt, args, E=E, dtype=dtype, warm_rows=warm_rows)
        top = report["profile"]["functions"]
        log(f"profile at {args.profile:.0%}: " + "; ".join(
            f"{f['function']} {f['cumulative_ms_per_token']:.1f} ms" for f in top[:12]))
        save()
    if args.moce == "none" or "moce" in report:
        pass
    elif time.perf_counter() > deadline:
        report["skipped"].append("moce")
        log("budget reached: skipping the MoCE study")
    else:
        del model
        report["moce"] = moce_study(path, prompt, args, E=E, dropped=dropped, log=log)
    save()
    print(table(report["rows"]))
    print(f"\nspeculative_identical: {report['speculative_identical']}; disk {report['disk_read_gb_s']:.2f} GB/s "
          f"(random {report['disk']['record_bytes'] / 1e6:.2f} MB records); "
          f"skipped: {report['skipped'] or 'nothing'}; "
          f"wall {report['seconds']:.0f} s" + (f"; JSON: {args.json_out}" if args.json_out else ""))
    return report


if __name__ == "__main__":
    main()
