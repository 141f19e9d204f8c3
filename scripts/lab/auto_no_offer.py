"""Does `--suffix-draft auto` cost anything per token when it offers no draft?

Decodes the same never-repeating prompt serially and with `auto` (the drafter asked after every
token, the controller learning every one-token step), in one process, alternating, and compares
the median seconds per token; profiles one `auto` run and sums the time spent in the planner,
the controller and the drafter (cProfile inflates it); and times the planner's whole per-token
work alone (`WindowPlanner.after_step`: the controller learns the step, the drafter extends and
finds no match) over 4,000 never-repeating tokens. `auto_drafts_proposed` must be 0 for the
first comparison to mean "auto offering nothing": a model whose output loops gets drafts.

    python -m scripts.lab.auto_no_offer --out auto_no_offer.json            # demo model
    python -m scripts.lab.auto_no_offer --model PATH --rounds 15 --out f.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx

from strata_cli.decode import generate
from strata_cli.options import EngineOptions, GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model
from strata_cli.speculative.controller import CostPrior, DraftController
from strata_cli.speculative.drafters import request_drafter
from strata_cli.speculative.planner import WindowPlanner
from strata_cli.telemetry import DecodeStats

HOST_PARTS = ("speculative/planner.py", "speculative/controller.py", "speculative/suffix_drafter.py",
              "speculative/drafters.py", "speculative/safe_window.py")


def decode(engine, prompt, tokens, spec):
    stats = DecodeStats()
    start = time.perf_counter()
    out = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens), spec=spec,
                                  eos_ids=(), stats=stats) for t in step.tokens]
    return out, time.perf_counter() - start, stats.summary()


def after_step_us(steps: int = 4000, repeats: int = 7) -> float:
    """Median microseconds of one `after_step` with nothing to propose (host work per token)."""
    rng = random.Random(1)
    prompt, stream = rng.sample(range(1 << 20), 512), rng.sample(range(1 << 20, 1 << 21), steps)
    times = []
    for _ in range(repeats):
        planner = WindowPlanner(request_drafter(prompt, max_drafts=7, min_match=3), max_drafts=7,
                                controller=DraftController(7), context_left=lambda pos: 1 << 30)
        start = time.perf_counter()
        for i, token in enumerate(stream):
            planner.after_step(token, 0.005, 512 + i, steps - i)
        times.append((time.perf_counter() - start) / steps)
    return 1e6 * statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    runtime = open_model(LoadOptions(model=args.model), EngineOptions())
    engine = runtime.engine
    rng = random.Random(args.seed)
    prompt = rng.sample(range(engine.vocab_size), args.prompt_tokens)  # no token twice: nothing to match
    modes = {"serial": SpecOptions(), "auto": SpecOptions(max_drafts=7, auto=True, cost_prior=CostPrior.linear())}
    seconds = {m: [] for m in modes}
    proposed, outputs = 0, {}
    for i in range(args.rounds + 1):
        for name in (modes if i % 2 == 0 else reversed(list(modes))):
            out, s, summary = decode(engine, prompt, args.tokens, modes[name])
            outputs.setdefault(name, out)
            if i:  # round 0 warms up
                seconds[name].append(s / len(out))
            if name == "auto":
                proposed = max(proposed, summary["drafts_proposed"])
    profile = cProfile.Profile()
    profile.enable()
    _, auto_s, _ = decode(engine, prompt, args.tokens, modes["auto"])
    profile.disable()
    stats = pstats.Stats(profile)
    host = {part: 0.0 for part in HOST_PARTS}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        for part in HOST_PARTS:
            if filename.endswith(part):
                host[part] += tottime
    med = {m: statistics.median(v) for m, v in seconds.items()}
    result = {
        "model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
        "tokens": args.tokens, "rounds": args.rounds, "auto_drafts_proposed": proposed,
        "identical": outputs["serial"] == outputs["auto"],
        "ms_per_token": {m: 1000 * v for m, v in med.items()},
        "auto_over_serial_speed": med["serial"] / med["auto"],
        "auto_over_serial_by_round": [s / a for s, a in zip(seconds["serial"], seconds["auto"])],
        "profiled_auto_host_us_per_token": {k: 1e6 * v / args.tokens for k, v in host.items()},
        "profiled_auto_run_ms_per_token": 1000 * auto_s / args.tokens,
        "after_step_us": after_step_us(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
