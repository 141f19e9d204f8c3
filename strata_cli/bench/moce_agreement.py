"""Cache-aware routing (MoCE) against exact routing: agreement and tokens/s by expert-cache size.

For each cache size (10/25/50% of the experts) and each MoCE setting, on the same prompts and
the same cache budget as exact routing:

- greedy agreement: the share of exact's greedy tokens MoCE reproduces before its first
  divergence;
- teacher-forced top-1 agreement: both models read exact's greedy sequence one token at a time;
  the share of positions whose argmax agrees;
- mean KL(exact ‖ MoCE) per token over those positions;
- expert misses (demand reads) per token and tokens/s of serial greedy decoding, exact and
  MoCE, medians of `repeats`, ratio in one run.

    python scripts/moce_agreement.py --tokens 48 --repeats 3     # the CPU table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..convert import convert
from ..decode import generate
from ..engine.window import WindowEngine
from ..options import (
    ConvertOptions,
    GenerateOptions,
    MoceOptions,
    SpecOptions,
    StreamOptions,
)
from ..runtime import embedded_model_path, load_checkpoint
from ..telemetry import DecodeStats
from ..tokenizer import Tokenizer
from .workloads import default_workloads_dir, load_workloads

FRACTIONS = (0.10, 0.25, 0.50)
SETTINGS = {  # label -> MoceOptions; protect J of the demo's top-2
    "J1 B1": MoceOptions(protect=1, bonus=1.0),
    "J1 B3": MoceOptions(protect=1, bonus=3.0),
    "J1 B3 N0": MoceOptions(protect=1, bonus=3.0, budget=0),
}


def open_engine(path: Path, slots: int, moce: MoceOptions | None) -> WindowEngine:
    model = load_checkpoint(path, stream=StreamOptions(resident_experts=slots), moce=moce)
    return WindowEngine(model)


def decode(engine: WindowEngine, prompt: list[int], tokens: int) -> tuple[list[int], float, int]:
    """Greedy ids, seconds, and expert misses (demand reads) of serial decoding."""
    stats = DecodeStats()
    start = time.perf_counter()
    ids = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens),
                                  spec=SpecOptions(), eos_ids=(), stats=stats) for t in step.tokens]
    return ids, time.perf_counter() - start, stats.summary()["experts"]["misses"]


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


def measure(path: Path, prompts: list[list[int]], *, num_experts: int, tokens: int, repeats: int) -> list[dict]:
    rows = []
    for fraction in FRACTIONS:
        slots = max(1, round(fraction * num_experts))
        exact = open_engine(path, slots, None)
        reference = [decode(exact, p, tokens)[0] for p in prompts]
        exact_logits = [forced_logits(exact, p, r) for p, r in zip(prompts, reference)]
        for label, options in SETTINGS.items():
            moce = open_engine(path, slots, options)
            greedy, top1, kls = [], [], []
            for p, ref, ref_logits in zip(prompts, reference, exact_logits):
                ids = decode(moce, p, tokens)[0]
                same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref))
                greedy.append(same / len(ref))
                logits = forced_logits(moce, p, ref)
                top1.extend((logits.argmax(-1) == ref_logits.argmax(-1)).tolist())
                kls.extend(kl(ref_logits, logits).tolist())
            # Exact and MoCE alternate within one run, so their ratio shares the machine's state.
            times, misses = {"exact": [], "moce": []}, {"exact": 0, "moce": 0}
            for _ in range(repeats):
                for name, engine in (("exact", exact), ("moce", moce)):
                    runs = [decode(engine, p, tokens) for p in prompts]
                    times[name].append(sum(r[1] for r in runs))
                    misses[name] += sum(r[2] for r in runs)
            total = tokens * len(prompts)
            tps = {name: total / statistics.median(ts) for name, ts in times.items()}
            rows.append({
                "cache": f"{fraction:.0%}", "slots": slots, "setting": label,
                "greedy_agreement": float(np.mean(greedy)), "top1_agreement": float(np.mean(top1)),
                "mean_kl": float(np.mean(kls)),
                "exact_misses_per_token": misses["exact"] / (total * repeats),
                "moce_misses_per_token": misses["moce"] / (total * repeats), "exact_tokens_per_s": tps["exact"],
                "moce_tokens_per_s": tps["moce"], "speedup": tps["moce"] / tps["exact"],
            })
            print(json.dumps(rows[-1]), flush=True)
            moce.model.expert_cache.close()
        exact.model.expert_cache.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="each prompt's last N tokens")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = convert(embedded_model_path(), Path(tmp) / "demo-stream", options=ConvertOptions(stream=True)).path
        tokenizer = Tokenizer(path)
        workloads = load_workloads(default_workloads_dir())
        prompts = [tokenizer.encode(w.prompts[0])[-args.prompt_tokens:] for w in workloads]
        num_experts = json.loads((path / "config.json").read_text())["num_experts"]
        rows = measure(path, prompts, num_experts=num_experts, tokens=args.tokens, repeats=args.repeats)
    header = ("cache", "slots", "setting", "greedy_agreement", "top1_agreement", "mean_kl",
              "exact_misses_per_token", "moce_misses_per_token", "exact_tokens_per_s", "moce_tokens_per_s", "speedup")
    print("| " + " | ".join(header) + " |")
    for r in rows:
        print("| " + " | ".join(f"{r[h]:.3f}" if isinstance(r[h], float) else str(r[h]) for h in header) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
