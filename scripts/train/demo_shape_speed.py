"""CPU decode speed of candidate demo-model shapes, random weights, through strata's own path.

Each shape is built with transformers (random initialisation), saved in bf16 and installed the
way `train_demo_model.py install` installs a trained one (`strata convert`, 8-bit or bf16), then
opened with `runtime.open_model` (the checkpoint's dtype, float32 compute on the CPU) and timed
decoding greedy tokens. Shapes are timed in turn, round after round, so a shared machine's load
falls on all alike; the figures are medians of the per-round ms/token.

    python -m scripts.train.demo_shape_speed --rounds 5 --tokens 64 --out /tmp/shapes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from scripts.train.train_demo_model import MODEL_CONFIG, attention_layers, install

TODAY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
             linear_num_value_heads=4, num_experts=16, moe_intermediate_size=64,
             shared_expert_intermediate_size=256, intermediate_size=512, **attention_layers(6, 3))
# name -> (config overrides on train_demo_model.MODEL_CONFIG, bits or None for bf16); every shape
# names all its size keys, so the figures do not move when MODEL_CONFIG does.
SHAPES = {
    "today-bf16": (TODAY, None),
    "today-8bit": (TODAY, 8),
    "e32-8bit": ({**TODAY, "num_experts": 32}, 8),
    "e48-8bit": ({**TODAY, "num_experts": 48}, 8),
    "e24x128-8bit": ({**TODAY, "num_experts": 24, "moe_intermediate_size": 128}, 8),
    "h384-8bit": ({**TODAY, "hidden_size": 384, "num_attention_heads": 6, "linear_num_key_heads": 3,
                   "linear_num_value_heads": 6, "shared_expert_intermediate_size": 384,
                   "intermediate_size": 768}, 8),  # the last candidate's shape
    # more attention layers (copying leans on them): 3 of 6 instead of 2
    "e48-attn2-8bit": ({**TODAY, "num_experts": 48, **attention_layers(6, 2)}, 8),
    # bf16 checkpoints compute in float32 on the CPU: what 8-bit storage dequantized at load would cost.
    "e48-bf16": ({**TODAY, "num_experts": 48}, None),
    "e24x128-bf16": ({**TODAY, "num_experts": 24, "moe_intermediate_size": 128}, None),
}
PROMPT = "def fibonacci(n):\n    "


def build(name: str, overrides: dict, bits: int | None, root: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(**{**MODEL_CONFIG, **overrides, "output_router_logits": False})
    model = Qwen3NextForCausalLM(config)
    ckpt = root / f"{len(list(root.iterdir()))}-hf"
    model.to(torch.bfloat16).save_pretrained(ckpt, max_shard_size="12MB")
    params = sum(p.numel() for p in model.parameters())
    (ckpt / "train_summary.json").write_text(json.dumps({"summary": {"parameters": params}}))
    dest = root / f"{len(list(root.iterdir()))}-strata"
    install(ckpt, tokenizer_dir, dest, bits, max_bytes=None)
    return dest, params


def time_decode(runtime, tokens: int) -> float:
    from strata_cli.decode import generate
    from strata_cli.options import GenerateOptions, SpecOptions

    ids = runtime.tokenizer.encode(PROMPT)
    runtime.engine.reset()
    t0, n = None, 0
    for step in generate(runtime.engine, ids, options=GenerateOptions(max_tokens=tokens + 1),
                         spec=SpecOptions(max_drafts=0), eos_ids=()):
        if t0 is None:  # the first token carries the prefill: time the rest
            t0 = time.perf_counter()
            continue
        n += len(step.tokens)
    return (time.perf_counter() - t0) / n * 1000


def compare(runtimes: dict, rounds: int, tokens: int) -> dict[str, dict]:
    """Decode ms/token of each opened model (name -> runtime), one warm-up each, then `rounds`
    rounds in turn: per name its ms_per_token, their median, and the median of its same-round
    ratios to the first model's (steadier than a ratio of medians when the load changes)."""
    for runtime in runtimes.values():
        time_decode(runtime, 8)  # warm-up: compile and allocate once
    times = {name: [] for name in runtimes}
    for _ in range(rounds):
        for name, runtime in runtimes.items():
            times[name].append(round(time_decode(runtime, tokens), 2))
    base = next(iter(times.values()))
    return {name: {"ms_per_token": ms, "median_ms": statistics.median(ms),
                   "round_ratio_to_first": round(statistics.median(a / b for a, b in zip(ms, base)), 3)}
            for name, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tokenizer", type=Path, default=Path("strata_cli/assets/demo"))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from strata_cli.options import LoadOptions
    from strata_cli.runtime import open_model

    names = args.shapes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        built = {n: build(n, *SHAPES[n], Path(tmp), args.tokenizer) for n in names}
        rows = {}
        for n, (path, params) in built.items():
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            rows[n] = {"parameters": params, "asset_mb": round(size / 1e6, 2)}
        timed = compare({n: open_model(LoadOptions(model=str(built[n][0]))) for n in names}, args.rounds, args.tokens)
        for n in names:
            rows[n].update(timed[n])
            print(f"{n:14s} {rows[n]['parameters']:>11,} params {rows[n]['asset_mb']:6.2f} MB "
                  f"{rows[n]['median_ms']:7.2f} ms/token (same-round ratio {rows[n]['round_ratio_to_first']:.2f}x)  "
                  f"{rows[n]['ms_per_token']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
