"""Expert streaming: tokens/s against expert-cache size, serial and with --suffix-draft 3.

Builds a synthetic Qwen3-Next with random 4-bit experts straight into the streaming layout
(experts/ records + dense safetensors, nothing ever holds all experts in memory), measures the
disk with the same pread path the cache uses, then decodes with the cache at 10/25/50/100% of the
experts, serial and speculative, and compares prefetch modes. Prints a table and JSON.

Reads are made real: the page cache is dropped before every measured run when the system allows
(`echo 3 > /proc/sys/vm/drop_caches`), and expert reads use O_DIRECT wherever the file system
takes it; the report says which happened.

    python -m scripts.bench.stream_curve --tiny                          # CPU, ~1 minute
    python -m scripts.bench.stream_curve --preset cpu --repeats 5        # the CPU curve in docs/benchmarks.md
    python -m scripts.bench.stream_curve --preset gpu --dir /tmp/strata-stream --budget-seconds 450 --json-out gpu.json
    python -m scripts.bench.stream_curve --model strata_cli/assets/demo --prompt-file strata_cli/assets/workloads/copy_edit.txt

With --model, a real checkpoint is converted (`convert --stream`) instead: trained routers give the
expert locality and the draft acceptance that a random-weight model lacks.

Presets: tiny (CI-sized), cpu (experts 4x a 25% cache on a 2-core CPU), gpu (Qwen3-Next-80B-A3B
layers: hidden 2048, 512 experts top-10, expert 512, shared 512, 16q/2kv x 256 attention, GDN 16k/32v
x 128; 8 layers, 4-bit experts ~1.7 MB each, ~7 GB on disk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from strata_cli.convert import convert
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.experts.store import ExpertLayoutWriter, ExpertStore
from strata_cli.model import qwen3_next
from strata_cli.model.layout import to_mlx_layout
from strata_cli.model.loader import FORMAT_KEY, FORMAT_VERSION
from strata_cli.options import ConvertOptions, GenerateOptions, SpecOptions, StreamOptions
from strata_cli.rows_write import write_rows
from strata_cli.runtime import load_checkpoint
from strata_cli.telemetry import DecodeStats
from strata_cli.tokenizer import Tokenizer

BASE = dict(model_type="qwen3_next", rms_norm_eps=1e-6, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
            rope_theta=10000.0, norm_topk_prob=True, full_attention_interval=4, max_position_embeddings=4096)
PRESETS = {
    "tiny": dict(
        model=dict(hidden_size=128, num_hidden_layers=4, vocab_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=128,
                   shared_expert_intermediate_size=128, intermediate_size=256),
        prompt=24, tokens=24, repeats=1),
    "cpu": dict(
        model=dict(hidden_size=1024, num_hidden_layers=4, vocab_size=4096, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                   linear_value_head_dim=128, num_experts=128, num_experts_per_tok=4, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, intermediate_size=2048),
        prompt=32, tokens=48, repeats=3),
    "gpu": dict(
        model=dict(hidden_size=2048, num_hidden_layers=8, vocab_size=32768, num_attention_heads=16, num_key_value_heads=2,
                   head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, intermediate_size=5120, rope_theta=10_000_000.0),
        prompt=16, tokens=48, repeats=3),
}
BITS, GROUP_SIZE = 4, 64
FRACTIONS = (0.10, 0.25, 0.50, 1.00)


# -- building the model ------------------------------------------------------------------------


def build(out: Path, params: dict, *, seed: int, dtype: mx.Dtype, log, draw_experts=None) -> dict:
    """Write a streamed checkpoint: random dense weights, random 4-bit experts (layer by layer).

    `draw_experts(layer, config, dtype)` gives one layer's expert tensors (default: uniform
    random codes, `random_codes`); the next layer's are evaluated asynchronously while one is
    written, so at most two layers are ever in memory. config.json is written last: it marks the build complete
    (`is_built`)."""
    params = {**BASE, **params}
    config = qwen3_next.Config.from_dict(params)
    model = qwen3_next.Model(config)  # expert stacks stay lazy zeros: never materialized
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    dense = {}
    keys = iter(mx.random.split(mx.random.key(seed), 4096))
    for name, value in tree_flatten(model.parameters()):
        if ".switch_mlp." not in name:
            dense[name] = _draw_dense(name, value.shape, next(keys)).astype(dtype)
    mx.save_safetensors(str(out / "model.safetensors"), to_mlx_layout(dense))
    del dense
    draw_experts = draw_experts or random_codes(np.random.default_rng(seed))
    writer = ExpertLayoutWriter(out, num_experts=config.num_experts)
    quant = {p: {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"} for p in ("gate_proj", "up_proj", "down_proj")}
    start = time.perf_counter()
    upcoming = draw_experts(0, config, dtype)
    for i in range(config.num_hidden_layers):
        tensors = upcoming
        if i + 1 < config.num_hidden_layers:  # drawn (lazily, on the device) while this layer is written
            upcoming = draw_experts(i + 1, config, dtype)
            mx.async_eval([v for v in upcoming.values() if isinstance(v, mx.array)])
        writer.add_block(f"model.layers.{i}.mlp.switch_mlp", tensors, quantization=quant)
        del tensors
        stride = writer.blocks[-1]["stride"]
        log(f"  experts of layer {i} written ({config.num_experts} x {stride / 1e6:.2f} MB); {i + 1}/"
            f"{config.num_hidden_layers} layers at {(i + 1) * config.num_experts * stride / 1e9 / (time.perf_counter() - start):.2f} GB/s")
    writer.finish()
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    (out / "config.json").write_text(json.dumps({**params, FORMAT_KEY: FORMAT_VERSION, "dtype": dtype_name}, indent=1))
    return params


def is_built(path: Path, params: dict) -> bool:
    """`path` holds a complete build (config.json is written last) of exactly these shapes."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(k) == v for k, v in {**BASE, **params}.items())


def random_codes(rng):
    """Expert tensors as uniform random 4-bit codes (cheap on a CPU: no quantizer pass)."""
    def draw(i: int, config, dtype) -> dict:
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        tensors = {}
        for proj, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors.update(_random_quantized(proj, E, rows, cols, rng, dtype))
        return tensors

    return draw


def _draw_dense(name: str, shape, key) -> mx.array:
    """As model/synthetic.py draws them: O(1) activations, a decisive router."""
    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
    if name.endswith("dt_bias"):
        return mx.ones(shape)
    if len(shape) == 1:
        return 1.0 + 0.1 * mx.random.normal(shape, key=key)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape, key=key)
    scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0
    return scale * mx.random.normal(shape, key=key) / shape[-1] ** 0.5


def _random_quantized(proj: str, E: int, rows: int, cols: int, rng, dtype) -> dict:
    """Uniform 4-bit codes with scale and bias giving zero-mean weights of std 1/sqrt(cols)."""
    packed = rng.integers(0, 2**32, (E, rows, cols * BITS // 32), dtype=np.uint32)
    groups = cols // GROUP_SIZE
    scale = 1.0 / (4.61 * math.sqrt(cols))  # the std of uniform 0..15 is 4.61
    scales = mx.array(scale * (1 + 0.05 * rng.standard_normal((E, rows, groups), dtype=np.float32)))
    return {f"{proj}.weight": packed, f"{proj}.scales": scales.astype(dtype), f"{proj}.biases": (-7.5 * scales).astype(dtype)}


# -- measuring ---------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Drop the page cache (needs root and a writable /proc/sys); False when refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_bandwidth(path: Path, *, io: str, threads: int, seconds: float) -> dict:
    """Sequential (one thread, records in file order) and random (the cache's thread count,
    random records of random layers) read bandwidth through `ExpertStore.read`."""
    store = ExpertStore(path, io=io, verify=False)
    blocks = list(store.blocks.values())
    stride = blocks[0].stride
    pool = store.pools[stride]
    result = {"io_mode": store.io_mode, "record_bytes": stride}

    def read(block, e):
        buf = pool.take()
        try:
            store.read(block.path, e, buf)
        finally:
            pool.give(buf)

    drop_page_cache()
    start, n = time.perf_counter(), 0
    for block in blocks:
        for e in range(block.num_experts):
            read(block, e)
            n += 1
            if time.perf_counter() - start > seconds:
                break
        if time.perf_counter() - start > seconds:
            break
    result["sequential_GBps"] = n * stride / (time.perf_counter() - start) / 1e9
    drop_page_cache()
    rng = np.random.default_rng(0)
    picks = [(blocks[rng.integers(len(blocks))], int(rng.integers(blocks[0].num_experts))) for _ in range(100_000)]
    with ThreadPoolExecutor(threads) as ex:
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds and n < len(picks):
            batch = picks[n : n + 4 * threads]
            list(ex.map(lambda p: read(*p), batch))
            n += len(batch)
        result["random_GBps"] = n * stride / (time.perf_counter() - start) / 1e9
    store.close()
    return result


def one_run(engine, prompt: list[int], *, tokens: int, drafts: int = 0, spec: SpecOptions | None = None) -> dict:
    """One greedy decode (`drafts` per window, or `spec`): its figures and its tokens (`output`)."""
    stats = DecodeStats()
    out = []
    for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens),
                         spec=spec or SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats):
        out += step.tokens
    s = stats.summary()
    e = s["experts"]
    picks = e["hits"] + e["misses"] + e["prefetch_hits"]
    by_T = {}
    for w in stats.windows:
        if w.experts is not None and w.experts.union_experts:
            by_T.setdefault(w.T, []).append(sum(w.experts.union_experts) / len(w.experts.union_experts))
    waits = {"read_wait": e["late_wait_ms"], "router_sync": e["router_sync_ms"], "installs": e["install_ms"]}
    total_ms = 1000 * s["decode_seconds"]
    sync = router_sync_split(stats.windows)
    return {
        "tokens_per_s": s["tokens_per_s"],
        "acceptance": s["acceptance"],
        "tokens_per_window": s["tokens_per_window"],
        "bytes_per_token": e["bytes_read_per_token"],
        "demand_bytes_per_token": e["bytes_read"] / len(out),
        "drafts_offered": s.get("drafts_offered", 0),
        "hit_rate": e["hits"] / picks if picks else 0.0,
        "late_waits": e["late_waits"],
        "late_wait_share": e["late_wait_share"],
        "prefetch_coverage": e["prefetch_coverage"],
        "wasted_prefetches": e["wasted_prefetches"],
        "union_per_layer": e["union_experts_per_layer"],
        "union_per_layer_by_T": {T: sum(v) / len(v) for T, v in sorted(by_T.items())},
        # decode ms per token: waiting on reads, blocked on routing, installing, and the rest (compute
        # outside the routing read-backs, drafting, host work)
        "ms_per_token": {k: v / len(out) for k, v in {**waits, "compute": total_ms - sum(waits.values())}.items()},
        "router_sync_split": sync,
        "cold_beyond_root": e["cold_experts_beyond_root"],
        "misses": e["misses"],
        "hits": e["hits"],
        "output": out,
    }


def router_sync_split(windows) -> dict | None:
    """The routing read-back of block i evaluates block i-1's installs (left lazy) with the rest
    of the layer's compute. A least-squares line through every decode window's (records installed
    at block i-1, ms blocked at block i's read-back) says how much of the wait grows with the
    installs (`ms_per_installed_record`) and how much does not (`ms_without_installs`, per
    block); None with fewer than 3 samples or one install count only."""
    installed, waited = [], []
    for w in windows:
        if w.experts is None or not w.experts.layers:
            continue
        layers = w.experts.layers
        for before, at in zip(layers, layers[1:]):
            installed.append(before["cold_misses"] + before["capacity_misses"] + before["prefetch_hits"])
            waited.append(1000 * at["router_sync_seconds"])
    if len(installed) < 3 or len(set(installed)) < 2:
        return None
    slope, intercept = np.polyfit(np.array(installed, float), np.array(waited, float), 1)
    return {"ms_per_installed_record": float(slope), "ms_without_installs": float(intercept),
            "samples": len(installed), "mean_records": float(np.mean(installed)), "mean_ms": float(np.mean(waited))}


def synthetic_prompts(preset: dict, seed: int, count: int) -> list[list[int]]:
    """Random ids with a repeated motif (so the drafter proposes), a fresh sequence per run."""
    prompts = []
    for j in range(count):
        motif = np.random.default_rng([seed, j]).integers(0, preset["model"]["vocab_size"], 8).tolist()
        prompts.append((motif * (preset["prompt"] // 8 + 1))[: preset["prompt"]])
    return prompts


def file_prompts(path: Path, model_dir: Path, count: int) -> list[list[int]]:
    """A prompt file's text (after a workload file's `---` header) in the checkpoint's tokens, cut
    into `count` consecutive pieces: one per run."""
    text = path.read_text()
    if "\n---\n" in text:
        text = text.split("\n---\n", 1)[1]
    ids = Tokenizer(model_dir).encode(text)
    size = len(ids) // count
    if size < 16:
        raise SystemExit(f"{path}: {len(ids)} tokens is too short for {count} prompts of at least 16")
    return [ids[j * size : (j + 1) * size] for j in range(count)]


def sweep(path: Path, preset: dict, prompts: list[list[int]], args, *, deadline: float, page_cache_dropped: bool,
          log) -> list[dict]:
    """Each point: a warm-up run on prompts[0], then one measured run per further prompt. Every run
    decodes a new sequence with the cache as the previous runs left it: replaying one sequence
    would show LRU a cyclic pattern (no hits once it outgrows the cache), not a steady state."""
    E = preset["model"]["num_experts"]
    rows, outputs = [], {}
    plan = [(f, mode, "router") for f in args.fractions for mode in ("serial", "draft3")]
    plan += [(args.prefetch_fraction, "serial", p) for p in ("history", "off")]
    for fraction, mode, prefetch in plan:
        if time.perf_counter() > deadline:
            log(f"budget reached: skipping {fraction:.0%} {mode} {prefetch}")
            continue
        slots = max(1, math.ceil(E * fraction))
        model = load_checkpoint(path, stream=StreamOptions(resident_experts=slots, prefetch=prefetch, io=args.io,
                                                       io_threads=args.io_threads))
        engine = WindowEngine(model)
        drafts = 3 if mode == "draft3" else 0
        runs = []
        warm = one_run(engine, prompts[0], tokens=preset["tokens"], drafts=drafts)  # fills the cache, builds graphs
        for prompt in prompts[1:]:
            if time.perf_counter() > deadline:
                break
            if page_cache_dropped:
                drop_page_cache()
            runs.append(one_run(engine, prompt, tokens=preset["tokens"], drafts=drafts))
        model.expert_cache.close()
        if runs:  # the warm-up decoded another prompt: its tokens are not comparable
            outputs[(fraction, mode, prefetch)] = [r["output"] for r in runs]
        runs = runs or [warm]
        med = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, (int, float))}
        row = {"fraction": fraction, "slots": slots, "mode": mode, "prefetch": prefetch, "runs": len(runs),
               "tokens_per_s_all": [round(r["tokens_per_s"], 2) for r in runs], **med}
        rows.append(row)
        log(f"  {fraction:>4.0%} {mode:<6} {prefetch:<7} {row['tokens_per_s']:7.2f} tok/s  "
            f"{row['bytes_per_token'] / 1e6:7.2f} MB/token  late-wait {row['late_wait_share']:.0%}  "
            f"coverage {row['prefetch_coverage']:.0%}")
    rows.append(identity(outputs, runs=len(prompts) - 1))
    return rows


def identity(outputs: dict, *, runs: int) -> dict:
    """Whether every cache size and prefetch mode produced the same tokens, per decoding mode and
    across modes (bit-exact on CPU; MLX's CUDA kernels are not batch-invariant, see docs)."""
    complete = {key: tuple(map(tuple, v)) for key, v in outputs.items() if len(v) == runs}
    by_mode = {}
    for (_, mode, _), tokens in complete.items():
        by_mode.setdefault(mode, set()).add(tokens)
    return {
        "identical_outputs_by_mode": {mode: len(seen) == 1 for mode, seen in by_mode.items()},
        "identical_outputs_across_modes": len(set(complete.values())) <= 1,
    }


def bank_write_costs(shape=(512, 2048), slots=64, trials=8) -> dict:
    """Milliseconds to put one expert matrix into a slot bank: the cache's write (`write_rows`,
    donated) against re-stacking per-slot arrays (the alternative design)."""
    bank = mx.zeros((slots, *shape))
    new = mx.random.normal(shape)
    mx.eval(bank, new)
    times = []
    for i in range(trials):
        start = time.perf_counter()
        bank = write_rows(bank, new[None], i % slots, axis=0)
        mx.eval(bank)
        times.append(time.perf_counter() - start)
    per_slot = [mx.zeros(shape) for _ in range(slots)]
    mx.eval(per_slot)
    stack_times = []
    for i in range(max(2, trials // 4)):
        start = time.perf_counter()
        per_slot[i % slots] = new + 0
        stacked = mx.stack(per_slot)
        mx.eval(stacked)
        stack_times.append(time.perf_counter() - start)
        del stacked
    return {"matrix_MB": new.nbytes / 1e6, "slots": slots, "slice_update_ms": 1000 * statistics.median(times),
            "restack_ms": 1000 * statistics.median(stack_times)}


# -- report ------------------------------------------------------------------------------------


def table(rows: list[dict], disk: dict) -> str:
    lines = ["| cache | slots | mode | prefetch | tokens/s (median) | MB read/token | late-wait share | "
             "prefetch coverage | disk-bound tokens/s | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "mode" not in r:
            continue
        mb = r["bytes_per_token"] / 1e6
        bound = disk["random_GBps"] * 1e3 / mb if mb > 0 else float("inf")
        lines.append(f"| {r['fraction']:.0%} | {r['slots']} | {r['mode']} | {r['prefetch']} | {r['tokens_per_s']:.2f} | "
                     f"{mb:.2f} | {r['late_wait_share']:.0%} | {r['prefetch_coverage']:.0%} | "
                     f"{bound:.1f} | {r['runs']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", type=Path, default=None,
                        help="Measure a real checkpoint instead (converted with --stream into --dir).")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=None, help="With --model: quantize while converting.")
    parser.add_argument("--prompt-file", type=Path, default=None, help="With --model: the prompt (a workload file).")
    parser.add_argument("--tiny", action="store_true", help="Same as --preset tiny (CPU, about a minute).")
    parser.add_argument("--dir", type=Path, default=None, help="Where the model is built (default: /tmp/strata-stream-<preset>).")
    parser.add_argument("--rebuild", action="store_true", help="Rebuild the model even if --dir holds one.")
    parser.add_argument("--layers", type=int, default=None, help="Override the preset's number of layers.")
    parser.add_argument("--tokens", type=int, default=None, help="Override the preset's tokens per run.")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--prefetch-fraction", type=float, default=0.25, help="Cache size of the prefetch-mode comparison.")
    parser.add_argument("--repeats", type=int, default=None, help="Measured runs per point (default: the preset's).")
    parser.add_argument("--io", choices=("auto", "direct", "buffered"), default="auto")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-seconds", type=float, default=450.0,
                        help="Stop starting new runs after this many seconds (building included); default 450.")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    name = "tiny" if args.tiny else args.preset
    preset = PRESETS[name]
    if args.model is not None:
        name = args.model.resolve().name
        config = json.loads((args.model / "config.json").read_text())
        preset = {"model": config, "prompt": None, "tokens": 64, "repeats": 3}
    if args.layers is not None:
        preset = {**preset, "model": {**preset["model"], "num_hidden_layers": args.layers}}
    if args.tokens is not None:
        preset = {**preset, "tokens": args.tokens}
    start = time.perf_counter()
    deadline = start + args.budget_seconds

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    path = args.dir or Path(f"/tmp/strata-stream-{name}")
    device = str(mx.default_device())
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    built = is_built(path, preset["model"])
    if args.model is not None and (args.rebuild or not (path / "experts").is_dir()):
        log(f"converting {args.model} into {path} (--stream{f' --bits {args.bits}' if args.bits else ''})")
        convert(args.model, path, options=ConvertOptions(bits=args.bits, stream=True, force=True))
    elif args.model is None and (args.rebuild or not built):
        log(f"building {name} model in {path} on {device}")
        build(path, preset["model"], seed=args.seed, dtype=dtype, log=log)
    experts_bytes = sum(f.stat().st_size for f in (path / "experts").glob("*.bin"))
    dropped = drop_page_cache()
    log(f"experts on disk: {experts_bytes / 1e9:.2f} GB; page cache drop: {'yes' if dropped else 'refused'}")
    disk = disk_bandwidth(path, io=args.io, threads=args.io_threads, seconds=min(5.0, args.budget_seconds / 40))
    log(f"disk ({disk['io_mode']}): sequential {disk['sequential_GBps']:.2f} GB/s, random {disk['random_GBps']:.2f} GB/s "
        f"({disk['record_bytes'] / 1e6:.2f} MB records, {args.io_threads} threads)")
    banks = bank_write_costs()
    log(f"bank write of a {banks['matrix_MB']:.1f} MB matrix into {banks['slots']} slots: slice_update "
        f"{banks['slice_update_ms']:.2f} ms, re-stack {banks['restack_ms']:.1f} ms")
    count = 1 + (preset["repeats"] if args.repeats is None else args.repeats)
    if args.prompt_file is not None:
        prompts = file_prompts(args.prompt_file, path, count)
    else:
        prompts = synthetic_prompts(preset, args.seed, count)
    rows = sweep(path, preset, prompts, args, deadline=deadline, page_cache_dropped=dropped, log=log)
    report = {
        "preset": name, "device": device, "model": preset["model"], "experts_bytes": experts_bytes,
        "page_cache_dropped": dropped, "disk": disk, "bank_writes": banks, "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    print(table(rows, disk))
    same = rows[-1]
    print(f"\nidentical outputs across cache sizes and prefetch modes: {same['identical_outputs_by_mode']}; "
          f"serial = --suffix-draft 3: {same['identical_outputs_across_modes']}; reads: {disk['io_mode']}; "
          f"page cache dropped between runs: {dropped}; wall {report['seconds']:.0f} s")
    print(json.dumps(report, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
