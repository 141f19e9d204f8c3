"""Where a `strata generate` process's time to first token goes, phase by phase (issue 41).

It does what `strata generate` does up to the first token, in the same order, with a clock
around each step: the interpreter's start (from the launcher's time), importing MLX and strata,
opening the model (each step timed: prepare the kernel cache, load and check the weights, the
tokenizer, the model's identity, the engine, the kernel workers' check), the start-up probes of strata's kernels
at the model's dtype (done explicitly here, so their cost is not hidden in the first forward
pass; kept verdicts and cubins read back, or compiled), the cost-curve calibration (`auto`),
tokenizing, the prompt, the first window's shape warm-up (eager call, then the mx.compile
traces), the first window, and a few more. Around the whole run it counts what strata read
back from its kernel directory (`kept.read`: cubins, verdicts) and every mx.compile trace made
after start-up (the first call of a compiled function at each new input shape).

    python -m scripts.bench.startup_phases MODEL --launched UNIX_S [--mode auto] [--max-context N] < prompt

Prints one JSON line. scripts/bench/startup.py runs it in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


class Clock:
    def __init__(self):
        self.phases: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now
        return self.phases[name]


def count_reads(kept, counts: dict) -> None:
    """Time and count `kept.read` by kind (cubins, verdicts), hits and misses."""
    read = kept.read

    def timed(kind, stem, keys):
        start = time.perf_counter()
        found = read(kind, stem, keys)
        entry = counts.setdefault(kind, {"hits": 0, "misses": 0, "seconds": 0.0})
        entry["hits" if found is not None else "misses"] += 1
        entry["seconds"] += time.perf_counter() - start
        return found
    kept.read = timed


def count_traces(mx, traces: dict) -> None:
    """Wrap `mx.compile` (for functions compiled from now on) so each call at a new input
    signature, where MLX traces, is timed."""
    compile_ = mx.compile

    def compiled(fn, *args, **kwargs):
        inner = compile_(fn, *args, **kwargs)
        seen = set()

        def call(*xs, **kw):
            key = tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else type(x).__name__ for x in xs)
            if key in seen:
                return inner(*xs, **kw)
            seen.add(key)
            start = time.perf_counter()
            out = inner(*xs, **kw)
            traces["count"] += 1
            traces["seconds"] += time.perf_counter() - start
            return out
        return call
    mx.compile = compiled


def time_calls(module, names: list[str], spent: dict) -> None:
    """Wrap `module`'s functions `names` so their seconds add up in `spent` (open_model's steps)."""
    for name in names:
        fn = getattr(module, name)

        def timed(*args, fn=fn, name=name, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        setattr(module, name, timed)


OPEN_MODEL_STEPS = ["prepare_kernel_cache", "resolve_model_path", "load_checkpoint", "Tokenizer", "model_identity",
                    "WindowEngine", "warm_in_parallel"]


def main(argv=None) -> dict:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--launched", type=float, required=True, help="time.time() just before the process started")
    parser.add_argument("--mode", choices=("serial", "auto"), default="auto")
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--windows", type=int, default=6, help="windows after the first")
    args = parser.parse_args(argv)
    prompt = sys.stdin.read()
    clock = Clock()
    clock.phases["interpreter_start_s"] = started - args.launched
    import mlx.core as mx

    clock.mark("import_mlx_s")
    import strata_cli.cli  # noqa: F401  (what `strata generate` imports before it runs)
    from metal_shaders import attention_window, gdn_window, kept, precompiled, rows_matvec
    from strata_cli.options import MAX_SUFFIX_DRAFT, EngineOptions, LoadOptions, SpecOptions
    from strata_cli import runtime
    from strata_cli.runtime import open_model

    clock.mark("import_strata_s")
    reads, traces, steps = {}, {"count": 0, "seconds": 0.0}, {}
    count_reads(kept, reads)
    count_traces(mx, traces)
    time_calls(runtime, OPEN_MODEL_STEPS, steps)
    rt = open_model(LoadOptions(model=args.model), EngineOptions(max_context=args.max_context))
    clock.mark("open_model_s")
    for name, usable in (("rows_matvec", rows_matvec.kernels_usable), ("gdn_window", gdn_window.usable),
                         ("attention_window", attention_window.usable)):
        usable(rt.dtype)
        clock.mark(f"kernel_probe_{name}_s")
    if args.mode == "auto":
        rt.spec_for(SpecOptions(max_drafts=MAX_SUFFIX_DRAFT, auto=True))
        clock.mark("calibration_s")
    engine = rt.engine
    ids = rt.tokenizer.encode(prompt)
    clock.mark("tokenize_s")
    engine.reset()
    engine.prefill(ids[:-1])
    clock.mark("prompt_s")
    root, pos0 = ids[-1], len(ids) - 1
    engine.ensure_warm(1, pos0)
    clock.mark("first_window_shape_warm_s")
    out = engine.run([root], pos0)
    engine.commit(1)
    clock.mark("first_window_s")
    first_token = time.time()
    windows = []
    for _ in range(args.windows):
        root, pos0 = out.tokens[0], pos0 + 1
        start = time.perf_counter()
        out = engine.run([root], pos0)
        engine.commit(1)
        windows.append(time.perf_counter() - start)
    phases = clock.phases
    result = {
        "mode": args.mode,
        "ttft_s": first_token - args.launched,
        "phases_s": phases,
        "unaccounted_s": first_token - args.launched - sum(phases.values()),
        "open_model_steps_s": steps,
        "prompt_tokens": len(ids),
        "kept_reads": reads,
        "compile_traces": traces,
        "precompiled": precompiled.status(),
        "kernel_workers": rt.kernel_workers.as_dict() if rt.kernel_workers else None,
        "kernel_cache": rt.kernel_cache.as_dict() if rt.kernel_cache else None,
        "later_windows_ms": [round(w * 1000, 3) for w in windows],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
