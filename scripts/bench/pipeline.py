"""Two ranks against one (distributed.py): decode throughput and window cost by T.

A pipeline at one request runs its stages one after the other, so every window pays each
stage's compute plus a hand-off per rank boundary (the bubbles); a window of T rows pays them
once for T rows, which is what wider windows (drafts) amortize. This measures, on the demo model
and on a larger random checkpoint, for 1 process and for N ranks started by `mlx.launch`:

- the forced-acceptance window cost for T = 1..8 (median ms, every T from the same prefilled
  state, as scripts/bench/window_cost.py), and
- greedy decode throughput serial and with `--suffix-draft 3` on a repetitive prompt, with the
  generated token ids, which must be identical for 1 process and N ranks.

Runs alternate (1, N, N, 1, ...) so drifting load hits both alike; medians are reported.

    python -m scripts.bench.pipeline --out pipeline.json                      # 2 GPUs of one host (NCCL)
    python -m scripts.bench.pipeline --tiny --backend ring --out tiny.json    # CPU, loopback, ~a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

RESULT = "PIPELINE-RESULT "
# The Qwen3-Next-80B-A3B layer shapes (scripts/bench/window_cost.py) with few layers, bfloat16.
LARGE = dict(layers=8)
# CPU: a few hundred MB in float32, windows several times the demo model's.
TINY_LARGE = dict(hidden_size=512, num_hidden_layers=8, vocab_size=4096, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16, num_experts_per_tok=2,
                  moe_intermediate_size=256, shared_expert_intermediate_size=512, max_position_embeddings=4096,
                  full_attention_interval=4)


def build_checkpoint(out: Path, *, tiny: bool, bits: int, seed: int = 0) -> Path:
    """A random Qwen3-Next written in strata's format (mlx-lm's layout), with the demo's tokenizer
    files (the benchmark feeds token ids; its vocabulary need not match)."""
    from mlx.utils import tree_flatten

    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from scripts.bench.window_cost import QWEN3_NEXT_80B_A3B
    from strata_cli.model import qwen3_next
    from strata_cli.model.layout import to_mlx_layout
    from strata_cli.model.loader import FORMAT_KEY, FORMAT_VERSION
    from strata_cli.model.quant import quantize, router_overrides
    from strata_cli.runtime import embedded_model_path

    if tiny:
        config, dtype = tiny_qwen3_next_config(**TINY_LARGE), mx.float32
    else:
        config = qwen3_next.Config.from_dict({**QWEN3_NEXT_80B_A3B, "num_hidden_layers": LARGE["layers"]})
        dtype = mx.bfloat16
    model = random_model(config, seed=seed, dtype=dtype)
    params = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    params.update({FORMAT_KEY: FORMAT_VERSION, "dtype": "float32" if tiny else "bfloat16"})
    if bits:
        quantization = quantize(model, group_size=64, bits=bits, overrides=router_overrides(64))
        params["quantization"] = params["quantization_config"] = quantization.to_config()
    mx.eval(model.parameters())
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(params))
    tensors = to_mlx_layout(dict(tree_flatten(model.parameters())))
    shard, shards, size = {}, [], 0
    for name, value in tensors.items():  # shards of at most 2 GB
        if shard and size + value.nbytes > 2 << 30:
            shards.append(shard)
            shard, size = {}, 0
        shard[name], size = value, size + value.nbytes
    shards.append(shard)
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), part)
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_path() / name, out / name)
    return out


# -- one run, on every rank ------------------------------------------------------------------------


def window_costs(engine, *, context: int, repeats: int, warmup: int, max_T: int = 8, seed: int = 0) -> list[float]:
    """Median ms of forced-acceptance windows of T = 1..max_T rows, each T from one prefilled state."""
    key = mx.random.key(seed)
    vocab = engine.vocab_size
    engine.reset()
    engine.prefill(mx.random.randint(0, vocab, (context,), key=key).tolist())
    start_state = engine.snapshot()
    curve = []
    for T in range(1, max_T + 1):
        engine.restore(start_state)
        tokens = mx.random.randint(0, vocab, (warmup + repeats, T), key=mx.random.key(seed + T)).tolist()
        seconds = []
        for row in tokens:
            start = time.perf_counter()
            engine.run(row, engine.length)
            engine.commit(T)
            mx.eval(engine.state_tensors())  # the commit's folds, on the ranks that run them here
            seconds.append(time.perf_counter() - start)
        curve.append(1000 * statistics.median(seconds[warmup:]))
    engine.reset()
    return curve


def decode_runs(engine, *, max_tokens: int, seed: int = 0) -> dict:
    """Greedy decoding of a repetitive prompt, serial and with 3 drafts: tok/s and token ids."""
    from strata_cli.decode import generate
    from strata_cli.options import GenerateOptions, SpecOptions
    from strata_cli.telemetry import DecodeStats

    vocab = engine.vocab_size
    motif = mx.random.randint(0, vocab, (24,), key=mx.random.key(seed + 100)).tolist()
    prompt = motif * 4
    runs = {}
    for label, drafts in (("serial", 0), ("drafts3", 3)):
        stats = DecodeStats()
        tokens = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=max_tokens),
                                         spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats)
                  for t in step.tokens]
        summary = stats.summary()
        runs[label] = {"tokens_per_s": summary["tokens_per_s"], "window_ms_mean": summary["window_ms_mean"],
                       "tokens_per_window": summary["tokens_per_window"], "token_ids": tokens}
    return runs


def worker(args) -> int:
    from strata_cli.options import EngineOptions, LoadOptions
    from strata_cli.runtime import open_model

    runtime = open_model(LoadOptions(model=args.model), EngineOptions())
    if runtime.follower is not None:
        return runtime.follower.serve()
    engine = runtime.engine
    result = {
        "ranks": runtime.stage.ranks if runtime.stage else 1,
        "layers": runtime.stage.summary()["layers"] if runtime.stage else None,
        "window_ms_by_T": window_costs(engine, context=args.context, repeats=args.repeats, warmup=args.warmup),
        "decode": decode_runs(engine, max_tokens=args.max_tokens),
    }
    print(RESULT + json.dumps(result), flush=True)
    return 0


# -- the comparison ------------------------------------------------------------------------------


def run_once(args, model: str, ranks: int) -> dict:
    worker_cmd = [sys.executable, "-m", "scripts.bench.pipeline", "--worker", "--model", model,
                  "--context", str(args.context), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                  "--max-tokens", str(args.max_tokens)]
    if ranks > 1:
        launcher = str(Path(sys.executable).with_name("mlx.launch"))
        worker_cmd = [launcher, "--hosts", "127.0.0.1", "-n", str(ranks), "--backend", args.backend, "--",
                      *worker_cmd]
    # A pipeline only sends and receives; NVLink multicast stays off unless the caller sets it.
    env = {"NCCL_NVLS_ENABLE": "0", **os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(worker_cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=args.timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{ranks} rank(s) on {model}: no result (exit {proc.returncode}): {proc.stderr[-2000:]}")


def summarise(runs: list[dict]) -> dict:
    curves = [r["window_ms_by_T"] for r in runs]
    out = {"window_ms_by_T": [statistics.median(c[t] for c in curves) for t in range(len(curves[0]))]}
    for label in runs[0]["decode"]:
        out[f"{label}_tokens_per_s"] = statistics.median(r["decode"][label]["tokens_per_s"] for r in runs)
        out[f"{label}_window_ms_mean"] = statistics.median(r["decode"][label]["window_ms_mean"] for r in runs)
        out[f"{label}_tokens_per_window"] = statistics.median(r["decode"][label]["tokens_per_window"] for r in runs)
    return out


def compare(args) -> dict:
    from strata_cli.bench.runner import git_commit

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="strata-pipeline-"))
    large = workdir / (f"large-tiny-{args.bits}" if args.tiny else f"large-{args.bits}")
    if "large" in args.models and not large.exists():
        build_checkpoint(large, tiny=args.tiny, bits=args.bits)
    record = {
        "command": "python -m scripts.bench.pipeline " + " ".join(args.argv),
        "tree": git_commit(), "machine": platform.platform(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "device": str(mx.default_device()), "backend": args.backend,
        "ranks": args.ranks, "rounds": args.rounds, "large_bits": args.bits, "models": {},
    }
    for name, model in (("demo", "demo"), ("large", str(large))):
        if name not in args.models:
            continue
        runs = {1: [], args.ranks: []}
        for round_ in range(args.rounds):
            order = (1, args.ranks) if round_ % 2 == 0 else (args.ranks, 1)
            for ranks in order:
                runs[ranks].append(run_once(args, model, ranks))
                print(f"{name}: round {round_ + 1}, {ranks} rank(s) done", file=sys.stderr, flush=True)
        one, many = runs[1], runs[args.ranks]
        identical = all(r["decode"][k]["token_ids"] == one[0]["decode"][k]["token_ids"]
                        for r in one + many for k in r["decode"])
        record["models"][name] = {"layers": many[0]["layers"], "identical_tokens": identical,
                                  "one": summarise(one), "ranks": summarise(many)}
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small random checkpoint in float32: a CPU run")
    parser.add_argument("--backend", default="nccl", help="mlx.launch backend (default nccl; ring on CPUs, Macs)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", default="demo,large", help="which of demo,large to run (default both)")
    parser.add_argument("--bits", type=int, default=None, help="the large checkpoint's bits (default 4; 0 tiny)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per setting, alternating (default 3; 2 tiny)")
    parser.add_argument("--context", type=int, default=None, help="prefilled positions (default 1024; 64 tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows per T (default 20; 7 tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed windows per T first (default 3; 2 tiny)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per decode run (default 256; 64 tiny)")
    parser.add_argument("--workdir", default=None, help="where the random checkpoint is written (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="demo", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.models = args.models.split(",")
    defaults = dict(rounds=2, context=64, repeats=7, warmup=2, max_tokens=64, bits=0) if args.tiny else \
        dict(rounds=3, context=1024, repeats=20, warmup=3, max_tokens=256, bits=4)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    record = compare(args)
    text = json.dumps(record, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if all(m["identical_tokens"] for m in record["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
