"""Where a decode window's time goes: ops per layer by kind, time per kind, host graph building
against evaluation, for T = 1 and T = 8 windows (issue 37), on whatever backend runs it.

For each model and each T it measures, from the same prefilled state, forced-acceptance windows
(`WindowEngine.run` of T tokens, then `commit(T)`):

- `window_ms`: the whole window as decoding runs it (compiled layer ends, every kernel);
- `build_ms` / `eval_ms`: the same windows split at their one `mx.eval`: the host's Python
  time building the lazy graph, then the evaluation (on a GPU: dispatch plus device time; on
  the CPU: the CPU stream's compute). `commit_ms` is the commit's own host time;
- `ops`: MLX primitives in the window's graph as it runs (compiled), and, from the same window
  built eagerly, `ops_by_kind` (exclusive: an op belongs to the first kind, in build order,
  whose output needs it; scripts/bench/graph_ops.py) and `ops_per_layer` (a kind's ops over the
  layers that have it);
- `ms_by_kind`: an instrumented eager window where every part evaluates its inputs before it
  starts and its outputs before it returns, so each kind's exclusive time is its own build plus
  evaluation (`eval_ms_by_kind`: the evaluation alone). Their sum exceeds `window_ms` by the
  synchronisations and the lost fusion; the shares are what to read.

Kinds: embed, norm (input/post/final RMSNorm), gdn.head (projections and their split), gdn.core
(conv, gating, the recurrence, the state), gdn.tail (gated norm, out projection), attn.head,
attn.core (rope, KV write, attention), attn.tail, router (the router linear), moe.glue (softmax,
top-k, weights, the weighted sum, the shared-expert gate), experts (routed experts), shared (the
shared expert's MLP and gate linear), residual (the layer's adds), lm_head, rest (argmax, casts);
host_tail / host_layer / host_experts: on the CPU's host path (model/host_tail.py, host_layer.py,
host_experts.py) the layer's tail after its mixer, the whole layer, and the routed experts where
they run in numpy (their time only: their ops are counted in the eager pass, by their kinds).

Models: the demo model (`--model demo`, its own dtype on a GPU, float32 on the CPU) and the
8-layer Qwen3-Next-80B-A3B-shaped 4-bit checkpoint that scripts/bench/compare_mlx_lm.py builds
with mlx-lm (6 GDN + 2 attention layers; `--tiny`: the small dims of scripts/bench/step_ops.py,
the same op structure, seconds on a CPU).

    python -m scripts.bench.step_profile --out step_profile.json           # the GPU run (< 3 min)
    python -m scripts.bench.step_profile --tiny --out /tmp/step_profile.json   # CPU, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from scripts.bench import compare_mlx_lm as compare
from scripts.bench.graph_ops import count_step
from scripts.bench.step_ops import SHAPE as SMALL_SHAPE
from scripts.bench.step_ops import StandIns, gpu_shaped
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.model import host_blas

try:  # trees before the CPU host path have no host tail or layer (the script also profiles those)
    from strata_cli.model import host_tail
except ImportError:
    host_tail = None
try:
    from strata_cli.model import host_layer
except ImportError:
    host_layer = None
try:
    from strata_cli.model import host_experts
except ImportError:
    host_experts = None
from strata_cli.model.compiled import LayerCompile
from strata_cli.model.host_blas import HostBlas
from strata_cli.options import EngineOptions
from strata_cli.runtime import embedded_model_path, load_checkpoint

real_eval = mx.eval
clock = time.perf_counter  # --clock cpu: time.process_time (both of MLX's CPU threads), steadier on a shared CPU


def arrays_in(value) -> list[mx.array]:
    return [a for _, a in tree_flatten(value) if isinstance(a, mx.array)]


# -- naming the parts -----------------------------------------------------------------------------

def part_methods(model) -> dict[tuple[int, str], str]:
    """(id(module), method) -> kind, for every part of a Qwen3-Next-like model."""
    kinds = {(id(model.model.embed_tokens), "__call__"): "embed", (id(model.model.norm), "__call__"): "norm"}
    if callable(getattr(type(model), "embed", None)):  # strata's lookup: a kernel's runs outside embed_tokens' call
        kinds[(id(model), "embed")] = "embed"
    if "lm_head" in model:
        kinds[(id(model.lm_head), "__call__")] = "lm_head"
    else:
        kinds[(id(model.model.embed_tokens), "as_linear")] = "lm_head"
    for layer in model.model.layers:
        kinds[(id(layer), "__call__")] = "residual"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            kinds[(id(layer[norm]), "__call__")] = "norm"
        kinds[(id(layer.post_attention_layernorm), "add_and_norm")] = "norm"  # the add before it too
        mixer = layer.mixer
        prefix = "gdn" if "linear_attn" in layer else "attn"
        for method in ("head", "core", "tail"):
            kinds[(id(mixer), method)] = f"{prefix}.{method}"
        ffn = layer.ffn
        if "switch_mlp" in ffn:
            kinds[(id(ffn), "__call__")] = "moe.glue"
            kinds[(id(ffn.gate), "__call__")] = "router"
            kinds[(id(ffn.switch_mlp), "__call__")] = "experts"
            if "shared_expert" in ffn:
                kinds[(id(ffn.shared_expert), "__call__")] = "shared"
                kinds[(id(ffn.shared_expert_gate), "__call__")] = "shared"
        else:
            kinds[(id(ffn), "__call__")] = "mlp"
    return kinds


def layer_counts(model) -> dict[str, int]:
    """How many layers have each kind (for ops per layer)."""
    layers = model.model.layers
    gdn = sum("linear_attn" in layer for layer in layers)
    moe = sum("switch_mlp" in layer.ffn for layer in layers)
    per = {"gdn.head": gdn, "gdn.core": gdn, "gdn.tail": gdn, "attn.head": len(layers) - gdn,
           "attn.core": len(layers) - gdn, "attn.tail": len(layers) - gdn, "router": moe, "moe.glue": moe,
           "experts": moe, "shared": moe, "mlp": len(layers) - moe, "residual": len(layers),
           "norm": 2 * len(layers) + 1}
    return {k: v for k, v in per.items() if v}


@contextmanager
def wrapped_parts(model, on_call):
    """Route every part's method through `on_call(kind, original, self, args, kwargs)`."""
    kinds = part_methods(model)
    modules = {id(m): m for _, m in model.named_modules()}
    classes = {}
    for key in kinds:
        module = modules[key[0]]
        cls = next(c for c in type(module).__mro__ if key[1] in c.__dict__)
        classes[(cls, key[1])] = cls.__dict__[key[1]]

    def wrap(original, name):
        def call(self, *args, **kwargs):
            kind = kinds.get((id(self), name))
            if kind is None:
                return original(self, *args, **kwargs)
            return on_call(kind, original, self, args, kwargs)
        return call

    for (cls, name), original in classes.items():
        setattr(cls, name, wrap(original, name))
    try:
        yield
    finally:
        for (cls, name), original in classes.items():
            setattr(cls, name, original)


# -- windows --------------------------------------------------------------------------------------

class Windows:
    """Forced-acceptance windows of T rows, each from the same prefilled state."""

    def __init__(self, model, context: int, seed: int):
        vocab = model.config.vocab_size
        self.engine = WindowEngine(model, EngineOptions())
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.engine.prefill(self.rng.integers(0, vocab, context).tolist())
        self.start = self.engine.snapshot()

    def reset(self):
        self.engine.restore(self.start)

    def one(self, T: int):
        tokens = self.rng.integers(0, self.vocab, T).tolist()
        self.engine.run(tokens, self.engine.length)
        self.engine.commit(T)


def plain_window_ms(w: Windows, T: int, n: int, warmup: int) -> float:
    """The median of `n` windows of T rows from the prefilled state, after `warmup` untimed ones."""
    w.reset()
    plain = []
    for _ in range(warmup + n):
        start = clock()
        w.one(T)
        plain.append(clock() - start)
    return 1e3 * statistics.median(plain[warmup:])


def window_times(w: Windows, T: int, n: int, warmup: int) -> dict:
    """Plain windows, then the same split at their eval: build, eval and commit times."""
    window_ms = plain_window_ms(w, T, n, warmup)
    w.reset()
    build, evals, commits = [], [], []
    marks = {}

    def timed_eval(*args):
        marks["build"] = clock()
        real_eval(*args)
        marks["eval"] = clock()

    with mock.patch.object(mx, "eval", timed_eval):
        for i in range(warmup + n):
            tokens = w.rng.integers(0, w.vocab, T).tolist()
            marks.clear()
            start = clock()
            w.engine.run(tokens, w.engine.length)
            ran = clock()
            w.engine.commit(T)
            done = clock()
            if i >= warmup:
                # The CPU's host path computes its logits in numpy and never calls mx.eval: all build.
                build.append(marks.get("build", ran) - start)
                evals.append(marks.get("eval", ran) - marks.get("build", ran))
                commits.append(done - ran)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"window_ms": window_ms, "build_ms": med(build), "eval_ms": med(evals),
            "commit_ms": med(commits)}


def op_counts(w: Windows, model, T: int) -> dict:
    """Primitives of one window as it runs (compiled) and, built eagerly, by kind.

    Where the window's linears run in numpy (the CPU's `host_blas.rows_linears`), the graph is
    evaluated in pieces, one at each read back (`host_reads`): `ops` then sums the pieces, and
    the eager count by kind is of the same window with its linears in MLX (`ops_by_kind`
    includes their matmuls; `host_linears` says how many left the graph)."""
    w.reset()
    w.one(T)  # the compiled functions of this T traced
    counts = {}
    pieces = {"ops": 0, "reads": 0, "linears": 0, "evals": 0}

    def counting_eval(*args):
        counts["graph"] = count_step(arrays_in(list(args)), parts)
        pieces["ops"] += counts["graph"].total
        pieces["reads"] += 1
        pieces["evals"] += 1
        real_eval(*args)

    def counting_rows_linears(x, weights):
        pieces["ops"] += count_step([x], []).total
        pieces["reads"] += 1
        pieces["linears"] += len(weights)
        return real_rows_linears(x, weights)

    parts: list[tuple[str, mx.array]] = []
    real_rows_linears = getattr(host_blas, "rows_linears", None)
    with mock.patch.object(mx, "eval", counting_eval), \
            mock.patch.object(host_blas, "rows_linears", counting_rows_linears, create=True):
        w.one(T)
    compiled_ops = pieces["ops"]
    # The window's own evaluation is not a read back (a window whose logits the host computes has none).
    reads = pieces["reads"] - min(pieces["evals"], 1)
    parts = []

    def recording(kind, original, self, args, kwargs):
        out = original(self, *args, **kwargs)
        parts.extend((kind, a) for a in arrays_in(out))
        return out

    with wrapped_parts(model, recording), mock.patch.object(LayerCompile, "mode", "never"), \
            mock.patch.object(mx, "eval", counting_eval), mock.patch.object(HostBlas, "windows", False, create=True):
        parts.clear()
        w.one(T)
    eager = counts["graph"]
    per_layer = layer_counts(model)
    by_kind = dict(sorted(eager.by_part.items()))
    return {"ops": compiled_ops, "host_reads": reads, "host_linears": pieces["linears"],
            "ops_eager": eager.total, "ops_by_kind": by_kind,
            "ops_per_layer": {k: round(v / per_layer[k], 1) for k, v in by_kind.items() if k in per_layer},
            "primitives": dict(eager.by_primitive.most_common())}


def kind_times(w: Windows, model, T: int, n: int, warmup: int) -> dict:
    """Each kind's exclusive time in synchronous eager windows (see the module docstring)."""
    w.reset()
    totals: dict[str, list[float]] = defaultdict(list)
    evals: dict[str, list[float]] = defaultdict(list)
    stack: list[list[float]] = []  # per active part: [children's seconds]
    window: Counter = Counter()
    window_eval: Counter = Counter()

    def timing(kind, original, self, args, kwargs):
        real_eval(arrays_in((args, kwargs)))
        stack.append([0.0])
        start = clock()
        out = original(self, *args, **kwargs)
        built = clock()
        real_eval(arrays_in(out))
        end = clock()
        children = stack.pop()[0]
        window[kind] += end - start - children
        window_eval[kind] += end - built
        if stack:
            stack[-1][0] += end - start
        return out

    with (wrapped_parts(model, timing), mock.patch.object(LayerCompile, "mode", "never"),
          timed_host(host_tail, "tail", "host_tail", timing), timed_host(host_layer, "call", "host_layer", timing),
          timed_host(host_experts, "routed", "host_experts", timing)):
        for i in range(warmup + n):
            window.clear()
            window_eval.clear()
            start = clock()
            w.one(T)
            mx.synchronize()  # device work this window left queued is its "rest", not the next window's first part's
            whole = clock() - start
            if i >= warmup:
                window["rest"] += whole - sum(window.values())
                for kind, seconds in window.items():
                    totals[kind].append(seconds)
                for kind, seconds in window_eval.items():
                    evals[kind].append(seconds)
    return {"ms_by_kind": {k: round(1e3 * statistics.median(v), 4) for k, v in sorted(totals.items())},
            "eval_ms_by_kind": {k: round(1e3 * statistics.median(v), 4) for k, v in sorted(evals.items())}}


def timed_host(module, name: str, kind: str, timing):
    """`module.name(layer, ...)` timed as `kind` while the context is open (nothing if the tree lacks it)."""
    if module is None:
        return nullcontext()
    real = getattr(module, name)
    return mock.patch.object(module, name, lambda layer, *a: timing(kind, real, layer, a, {}))


# -- models ---------------------------------------------------------------------------------------

def models(args) -> list[tuple[str, Path, str]]:
    on_cpu = mx.default_device() == mx.cpu
    # The CPU computes in float32 (its gather_mm takes no other), unless the GPU-shaped count is
    # asked for another dtype (the kernels are stand-ins there; bfloat16 adds the casts a GPU runs).
    dtype = "float32" if on_cpu and (args.path != "gpu" or args.dtype is None) else (args.dtype or "bfloat16")
    out = []
    if "demo" in args.models:
        out.append(("demo", embedded_model_path(), dtype))
    if "80b" in args.models:
        path = checkpoint_80b(args.dir, layers=args.layers, tiny=args.tiny)
        out.append((path.name, path, dtype))
    return out


def checkpoint_80b(directory: Path, *, layers: int, tiny: bool) -> Path:
    """The 80B-A3B-shaped 4-bit checkpoint in `directory` (small dims with `tiny`), built with
    mlx-lm's class the first time."""
    path = directory / f"80b-shape-{'small' if tiny else 'full'}-{layers}L-q4"
    if not (path / "config.json").is_file():
        print(f"building {path} with mlx-lm", flush=True)
        compare.build_checkpoint(path, layers=layers, tiny=False, bits=4, seed=0, shape=SMALL_SHAPE if tiny else None)
    return path


def profile(args) -> dict:
    report = {"commit": git_commit(), "machine": platform.platform(), "node": platform.node(), "clock": args.clock,
              "device": str(mx.default_device()), "mlx": mx.__version__, "tiny": args.tiny, "models": []}
    report["path"] = args.path
    shaped = gpu_shaped(StandIns()) if args.path == "gpu" else nullcontext()
    with shaped:
        for entry in profiled_models(args):
            report["models"].append(entry)
    return report


def profiled_models(args):
    for name, path, dtype in models(args):
        model = load_checkpoint(path, dtype=dtype)
        w = Windows(model, args.context, args.seed)
        entry = {"model": name, "dtype": dtype, "layers": len(model.model.layers),
                 "layers_by_kind": layer_counts(model), "context": args.context, "windows": []}
        for T in args.windows:
            if args.path == "gpu":  # op counts only: the stand-ins' times mean nothing
                row = {"T": T, **op_counts(w, model, T)}
                entry["windows"].append(row)
                print(f"{name} {dtype} T={T}: ops {row['ops']} (eager {row['ops_eager']}); per layer: "
                      + ", ".join(f"{k} {v}" for k, v in row["ops_per_layer"].items()), flush=True)
                continue
            row = {"T": T, **window_times(w, T, args.repeats, args.warmup), **op_counts(w, model, T),
                   **kind_times(w, model, T, max(3, args.repeats // 3), 1)}
            entry["windows"].append(row)
            top = sorted(row["ms_by_kind"].items(), key=lambda kv: -kv[1])[:6]
            print(f"{name} {dtype} T={T}: window {row['window_ms']:.2f} ms (build {row['build_ms']:.2f}, eval "
                  f"{row['eval_ms']:.2f}, commit {row['commit_ms']:.2f}); ops {row['ops']} ({row['host_reads']} host "
                  f"reads of {row['host_linears']} linears; eager, linears in MLX: "
                  f"{row['ops_eager']}); by kind ms: " + ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
            print("   ops per layer: " + ", ".join(f"{k} {v}" for k, v in row["ops_per_layer"].items()), flush=True)
        if args.path != "gpu":
            base = entry["windows"][0]["window_ms"]
            entry["relative_to_first"] = {str(r["T"]): round(r["window_ms"] / base, 3) for r in entry["windows"]}
        yield entry
        del model, w


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="the 80B-A3B pattern with small dims, few repeats: a CPU run of under a minute")
    parser.add_argument("--models", default="demo,80b", help="comma-separated: demo, 80b")
    parser.add_argument("--windows", default="1,8", help="row counts T (default 1,8)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 80B-A3B-shaped checkpoint")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="compute dtype on a GPU (default bfloat16); the CPU runs float32 unless --path gpu asks")
    parser.add_argument("--context", type=int, default=None, help="prefilled tokens (default 512; 64 with --tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows per T (default 30; 9 with --tiny)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-step-profile")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, which other processes' load moves less (CPU backend only)")
    parser.add_argument("--path", choices=("native", "gpu"), default="native",
                        help="gpu: count the primitives a CUDA device runs, on any backend (scripts/bench/step_ops.py's "
                             "stand-ins; op counts only)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    args.models = set(args.models.split(","))
    args.windows = [int(t) for t in args.windows.split(",")]
    args.context = args.context or (64 if args.tiny else 512)
    args.repeats = args.repeats or (9 if args.tiny else 30)
    start = clock()
    report = profile(args)
    report["seconds"] = round(clock() - start, 1)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out} ({report['seconds']} s)")
    return report


if __name__ == "__main__":
    main()
