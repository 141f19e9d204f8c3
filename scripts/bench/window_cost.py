"""Forced-acceptance window cost against T for a Qwen3-Next-80B-A3B-shaped synthetic model.

Builds the 80B-A3B layer shapes (hidden 2048, 512 experts top-10 with intermediate 512, a shared
expert of 512, gated attention with 16 query / 2 KV heads of 256, GDN with 16 key / 32 value
heads of 128, conv 4, vocabulary 151936) with only a few layers (default 4: three GDN layers and
one attention layer, the model's own 3:1 pattern), random weights, quantized to 4 bits by
default. It prefills a context of random tokens, then for each T = 1..8 runs windows of T random
tokens and commits all of them (forced acceptance: the state advances exactly as if every draft
had been accepted), each synchronized with mx.eval, and reports the median of N windows after a
warm-up. Every T starts from the same prefilled state.

That curve is what the draft-length controller's cost model must predict: pass the JSON this
writes as `strata generate --suffix-draft auto --draft-cost window_cost.json` (the controller
reads `curve[*].median_s`, T = 1, 2, ...).

Random tokens route to nearly independent experts, so the union a window needs grows almost as
for uniform routing (`uniform_union` column); real text shares experts between neighbouring
tokens, so this curve is an upper bound on the expert part of the cost.

    python -m scripts.bench.window_cost --out window_cost.json      # the GPU run (MLX CUDA or Metal)
    python -m scripts.bench.window_cost --tiny                      # a seconds-long CPU check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.model import qwen3_next
from strata_cli.model.quant import quantize, router_overrides
from strata_cli.options import EngineOptions

# Qwen3-Next-80B-A3B-Instruct's config.json, less the layer count.
QWEN3_NEXT_80B_A3B = dict(
    model_type="qwen3_next",
    hidden_size=2048,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    intermediate_size=5120,
    norm_topk_prob=True,
    full_attention_interval=4,
    rope_theta=10000000.0,
    partial_rotary_factor=0.25,
)
TINY = dict(hidden_size=64, vocab_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, max_position_embeddings=4096)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def build_model(args):
    """The synthetic model: 80B-A3B shapes (or tiny ones), random weights, optionally quantized."""
    if args.tiny:
        config = tiny_qwen3_next_config(num_hidden_layers=args.layers, **TINY)
    else:
        config = qwen3_next.Config.from_dict({**QWEN3_NEXT_80B_A3B, "num_hidden_layers": args.layers})
    model = random_model(config, seed=args.seed, dtype=DTYPES[args.dtype])
    if args.bits:
        quantize(model, group_size=args.group_size, bits=args.bits, overrides=router_overrides(args.group_size))
        mx.eval(model.parameters())
    return model


def uniform_union(num_experts: int, top_k: int, T: int) -> float:
    """Expected distinct experts of T rows that each pick top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** T)


def measure(model, args) -> list[dict]:
    """Median forced-acceptance window seconds for T = 1..max_T, each from the same prefilled state."""
    rng_key = mx.random.key(args.seed)
    vocab = model.config.vocab_size
    windows = args.warmup + args.repeats
    limit = args.context + args.max_t * windows + 1
    engine = WindowEngine(model, EngineOptions(max_context=limit))
    context = mx.random.randint(0, vocab, (args.context,), key=rng_key).tolist()
    engine.prefill(context)
    start_state = engine.snapshot()
    curve = []
    for T in range(1, args.max_t + 1):
        engine.restore(start_state)
        tokens = mx.random.randint(0, vocab, (windows, T), key=mx.random.key(args.seed + T)).tolist()
        seconds = []
        for i in range(windows):
            pos0 = engine.length
            start = time.perf_counter()
            engine.run(tokens[i], pos0)  # evaluates every row's logits
            engine.commit(T)  # forced acceptance
            mx.eval([a for state in engine.states for a in state.snapshot() if isinstance(a, mx.array)])
            seconds.append(time.perf_counter() - start)
        timed = sorted(seconds[args.warmup:])
        curve.append({
            "T": T,
            "median_s": statistics.median(timed),
            "min_s": timed[0],
            "p90_s": timed[min(len(timed) - 1, int(0.9 * len(timed)))],
            "warmup_s": seconds[: args.warmup],
            "uniform_union": uniform_union(model.config.num_experts, model.config.num_experts_per_tok, T),
        })
    base = curve[0]["median_s"]
    for row in curve:
        row["relative"] = row["median_s"] / base
        row["per_token_if_all_kept_ms"] = 1000 * row["median_s"] / row["T"]
    return curve


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, float32: a quick CPU check of the script")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is attention; default 4)")
    parser.add_argument("--bits", type=int, default=None, choices=[0, 2, 3, 4, 5, 6, 8],
                        help="weight bits (default 4; 0 = unquantized, in --dtype; --tiny defaults to 0)")
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="compute dtype (default bfloat16; float32 with --tiny)")
    parser.add_argument("--context", type=int, default=None, help="prefilled positions (default 1024; 64 with --tiny)")
    parser.add_argument("--max-t", type=int, default=8, help="largest window (default 8)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows per T (default 30; 5 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed windows per T first (default 5; 2 with --tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is available")
    parser.add_argument("--out", type=Path, default=Path("window_cost.json"), help="JSON output (default window_cost.json)")
    args = parser.parse_args(argv)
    tiny_defaults = dict(bits=0, dtype="float32", context=64, repeats=5, warmup=2)
    full_defaults = dict(bits=4, dtype="bfloat16", context=1024, repeats=30, warmup=5)
    for key, value in (tiny_defaults if args.tiny else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_t < 1 or args.repeats < 1 or args.warmup < 0 or args.context < 1 or args.layers < 1:
        parser.error("--max-t, --repeats, --context and --layers must be at least 1, --warmup at least 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    t0 = time.perf_counter()
    model = build_model(args)
    build_s = time.perf_counter() - t0
    curve = measure(model, args)
    c = model.config
    result = {
        "model": "tiny synthetic qwen3_next" if args.tiny else "Qwen3-Next-80B-A3B-shaped synthetic (random weights)",
        "layers": list(c.layer_types),
        "config": {k: getattr(c, k) for k in ("hidden_size", "vocab_size", "num_experts", "num_experts_per_tok",
                                              "moe_intermediate_size", "shared_expert_intermediate_size",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "linear_num_key_heads", "linear_num_value_heads")},
        "bits": args.bits or None,
        "group_size": args.group_size if args.bits else None,
        "dtype": args.dtype,
        "device": str(mx.default_device()),
        "context": args.context,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "build_seconds": build_s,
        "commit": git_commit(),
        "machine": {"node": platform.node(), "platform": platform.platform(), "mlx": mx.__version__},
        "curve": curve,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['model']}, {len(c.layer_types)} layers, {args.bits or args.dtype}"
          f"{'-bit' if args.bits else ''}, context {args.context}, {result['device']}: median of {args.repeats} "
          f"after {args.warmup} warm-up")
    print("| T | window ms (median) | min | p90 | relative to T=1 | ms/token if all kept | uniform expert union |")
    print("|---|---|---|---|---|---|---|")
    for row in curve:
        print(f"| {row['T']} | {1000 * row['median_s']:.3f} | {1000 * row['min_s']:.3f} | {1000 * row['p90_s']:.3f} | "
              f"{row['relative']:.2f} | {row['per_token_if_all_kept_ms']:.3f} | {row['uniform_union']:.1f} |")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
