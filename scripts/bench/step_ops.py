"""MLX primitives per decode step, by layer kind, and the Python time to build a step's graph:
strata and mlx-lm's own model class on one small Qwen3-Next-80B-A3B-patterned checkpoint
(issue 10: on the H200 each primitive costs ~10 µs of host dispatch, and decoding is host-bound).

A step is what one eval call gets: strata's serial step (the decode loop's `launch` + commit,
or its window loop's `run` on the CPU), strata's T = 4 and 8 windows (run + commit of every
row), mlx-lm's `generate_step` step and its forward of T = 4 and 8 tokens on its cache.
The count walks the step's lazy graph (`mx.export_to_dot`, scripts/bench/graph_ops.py); the parts are
the model's modules (norms, GDN mixer with its state, attention mixer with its KV writes, MoE
block, residual adds, embedding, lm_head; "rest" is sampling and loop glue). `ops` is what runs
(strata's compiled layer ends included, model/compiled.py); the parts come from the same step
built eagerly (`ops_eager`), since a compiled trace hides its parts. Build time is the
host time between one step's eval and the next, the eval itself excluded (medians).

--path gpu (default) counts what a CUDA device runs, on any backend: strata's CUDA kernels
(rows_matvec and its GLU and column-mapped forms, gdn_window, attention_window, router_window,
add_norm, moe_combine, gated_norm, attention_prep, embed_rows) become one stand-in primitive each
(`mx.depends` on zeros: evaluable, so the step runs, with meaningless values), `mx.fast`
rms_norm/rope/sdpa and `mx.dequantize` become one primitive each (the CPU builds them from
~10-30 ops), RowSplit splits windows as on a GPU and the decode loop overlaps its steps. What
still differs from the H200: the stand-ins' Python cost is not the kernels' call cost, and MLX's
CUDA backend may itself fall back for some fast-op shapes, and the CPU's loader keeps a small
checkpoint's dense layers dequantized (its 4-bit embedding is one Gather here, a quantized table
that embed_rows looks up on a GPU).
--path native counts what the running backend runs (on the GPU: the real thing).

    python -m scripts.bench.step_ops --out /tmp/step_ops.json                           # CPU, ~1 minute
    OUT=. python -m scripts.bench.step_ops --path native --out $OUT/step_ops_h200.json  # on the GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import ExitStack, contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from metal_shaders import (add_norm, attention_prep, attention_window, embed_rows, gated_norm, gdn_window, moe_combine,
                           router_window, rows_matvec)
from scripts.bench import compare_mlx_lm as compare
from scripts.bench.graph_ops import count_step
from strata_cli.bench.peers import MlxLmPeer, require_mlx_lm
from strata_cli.bench.runner import git_commit
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model.compiled import LayerCompile
from strata_cli.model.layers import CpuShortCalls, RowSplit
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.runtime import load_checkpoint

# The 80B-A3B's layer pattern and head counts (3 GDN + 1 attention, top-10 of its experts,
# shared expert), small dims: the op structure is the 80B's, the weights a few MB. Head dims
# are multiples of 32 so that the CUDA kernels take them.
SHAPE = dict(hidden_size=256, vocab_size=1024, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts=32, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             intermediate_size=256, max_position_embeddings=4096)
# `--family gpt_oss`: GPT-OSS-20B's layer pattern (sliding and full attention alternating, sinks,
# biases, 32 MXFP4 experts top-4), small dims; head dims and widths multiples of 32 (the kernels').
GPT_OSS_SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=8,
                     num_key_value_heads=2, sliding_window=16, max_position_embeddings=4096)
WARMUP = 3
real_eval = mx.eval  # Steps hooks mx.eval; the stand-ins' own evals are not steps


# -- the GPU-shaped path on any backend ---------------------------------------------------------

class StandIns:
    """One evaluable primitive per backend kernel call, remembered so the count can name it."""

    def __init__(self):
        self.made: list[tuple[str, mx.array]] = []
        self._zeros: dict[tuple, mx.array] = {}

    def __call__(self, name: str, inputs, shapes, dtypes) -> list[mx.array]:
        zeros = []
        for shape, dtype in zip(shapes, dtypes):
            key = (tuple(shape), dtype)
            if key not in self._zeros:
                self._zeros[key] = mx.zeros(shape, dtype=dtype)
                real_eval(self._zeros[key])
            zeros.append(self._zeros[key])
        outputs = mx.depends(zeros, [a for a in inputs if isinstance(a, mx.array)])
        self.made.append((name, outputs[0]))
        return outputs

    def kernel(self, name: str, *_args, **_kwargs):
        def launch(*, inputs, output_shapes, output_dtypes, **_):
            return self(name, inputs, output_shapes, output_dtypes)
        return launch

    def rms_norm(self, x, weight, eps, **_):
        dtype = x.dtype if weight is None else result_type(x.dtype, weight.dtype)
        return self("rms_norm", [x, weight], [x.shape], [dtype])[0]

    def dequantize(self, w, scales, biases=None, group_size=64, bits=4, **_):
        return self("dequantize", [w, scales, biases], [(*w.shape[:-1], w.shape[-1] * 32 // bits)], [scales.dtype])[0]

    def rope(self, x, dims, **_):
        return self("rope", [x], [x.shape], [x.dtype])[0]

    def sdpa(self, q, k, v, **_):
        return self("sdpa", [q, k, v], [(*q.shape[:-1], v.shape[-1])], [q.dtype])[0]


@lru_cache
def result_type(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    return (mx.zeros((), dtype=a) + mx.zeros((), dtype=b)).dtype


@contextmanager
def gpu_shaped(stand_ins: StandIns):
    """Build steps as a CUDA device with strata's kernels would (see the module docstring)."""
    mode, compiled, short = RowSplit.mode, LayerCompile.mode, CpuShortCalls.mode
    RowSplit.mode = LayerCompile.mode = "always"
    CpuShortCalls.mode = "never"  # the MLX forms a GPU runs, not the CPU's numpy linears
    try:
        patches = [
            (rows_matvec, "kernels_usable", lambda dtype=None: True),
            (rows_matvec, "glu_usable", lambda dtype=None: True),
            (rows_matvec, "mapped_usable", lambda dtype=None: True),
            (rows_matvec, "gpu_kernel", stand_ins.kernel),
            (gdn_window, "usable", lambda dtype=None: True),
            (gdn_window, "gpu_kernel", stand_ins.kernel),
            (attention_window, "usable", lambda dtype=None: True),
            (attention_window, "sinks_usable", lambda dtype=None: True),
            (attention_window, "gpu_kernel", stand_ins.kernel),
            (router_window, "usable", lambda dtype=None: True),
            (router_window, "gpu_kernel", stand_ins.kernel),
            (add_norm, "usable", lambda dtype=None: True),
            (add_norm, "gpu_kernel", stand_ins.kernel),
            (moe_combine, "usable", lambda dtype=None: True),
            (moe_combine, "gpu_kernel", stand_ins.kernel),
            (gated_norm, "usable", lambda dtype=None: True),
            (gated_norm, "gpu_kernel", stand_ins.kernel),
            (attention_prep, "usable", lambda dtype=None: True),
            (attention_prep, "gpu_kernel", stand_ins.kernel),
            (embed_rows, "usable", lambda dtype=None: True),
            (embed_rows, "gpu_kernel", stand_ins.kernel),
            (mx.fast, "rms_norm", stand_ins.rms_norm),
            (mx.fast, "rope", stand_ins.rope),
            (mx, "dequantize", stand_ins.dequantize),
            (mx.fast, "scaled_dot_product_attention", stand_ins.sdpa),
            (WindowEngine, "can_overlap", property(lambda self: True)),
        ]
        with ExitStack() as stack:  # more patches than one `with` statement may nest
            for target, name, value in patches:
                stack.enter_context(mock.patch.object(target, name, value))
            yield
    finally:
        RowSplit.mode, LayerCompile.mode, CpuShortCalls.mode = mode, compiled, short


# -- recording steps ----------------------------------------------------------------------------

class Steps:
    """Hooks mx.eval / mx.async_eval: each call is a step; its graph is counted (when `parts` are
    recorded) and the host time since the previous step's eval ended is its build time."""

    def __init__(self, stand_ins: StandIns, count: bool):
        self.stand_ins, self.count = stand_ins, count
        self.parts: list[tuple[str, mx.array]] = []
        self.counts, self.build_s = [], []
        self._since = None

    def start(self):
        self.parts.clear()
        self.stand_ins.made.clear()
        self._since = time.perf_counter()

    def on_eval(self, *args):
        now = time.perf_counter()
        roots = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
        if self._since is not None:
            self.build_s.append(now - self._since)
            if self.count:
                self.counts.append(count_step(roots, list(self.parts), list(self.stand_ins.made)))
        real_eval(*args)
        self.start()

    @contextmanager
    def hooked(self):
        self.start()
        with mock.patch.object(mx, "eval", self.on_eval), mock.patch.object(mx, "async_eval", self.on_eval):
            yield
        self._since = None


@contextmanager
def parts_of(model, steps: Steps):
    """Record each part's output as it is built (both engines name their modules alike).

    strata's mixers run as head, core and tail (model/decoder_layer.py): each is recorded as
    the mixer. Inside compiled layer ends nothing is seen: count with LayerCompile "never".
    """
    names = {id(model.model.embed_tokens): "embed", id(model.model.norm): "norm", id(model.lm_head): "lm_head"}
    mixers = set()
    for layer in model.model.layers:
        is_linear = "linear_attn" in layer
        mixer = layer.linear_attn if is_linear else layer.self_attn
        names[id(mixer)] = "gdn" if is_linear else "attention"
        mixers.add(id(mixer))
        names[id(layer.input_layernorm)] = names[id(layer.post_attention_layernorm)] = "norm"
        names[id(layer.mlp)] = "moe"
        names[id(layer)] = "residual"
    modules = [m for _, m in model.named_modules() if id(m) in names]
    methods = {("__call__", next(c for c in type(m).__mro__ if "__call__" in c.__dict__)) for m in modules}
    if callable(getattr(type(model), "embed", None)):  # strata's lookup: a kernel's runs outside embed_tokens' call
        names[id(model)] = "embed"
        methods.add(("embed", next(c for c in type(model).__mro__ if "embed" in c.__dict__)))
    methods |= {(name, type(m)) for m in modules if id(m) in mixers
                for name in ("head", "core", "tail") if name in type(m).__dict__}  # strata's mixers only
    methods |= {("add_and_norm", type(m)) for m in modules if "add_and_norm" in type(m).__dict__}  # strata's norms
    active: set[int] = set()
    originals = {(name, cls): cls.__dict__[name] for name, cls in methods}

    def wrap(original):
        def call(self, *args, **kwargs):
            if id(self) not in names or id(self) in active:
                return original(self, *args, **kwargs)
            active.add(id(self))
            try:
                out = original(self, *args, **kwargs)
            finally:
                active.discard(id(self))
            steps.parts.extend((names[id(self)], a) for _, a in tree_flatten(out) if isinstance(a, mx.array))
            return out
        return call

    for (name, cls), original in originals.items():
        setattr(cls, name, wrap(original))
    try:
        yield
    finally:
        for (name, cls), original in originals.items():
            setattr(cls, name, original)


# -- the two engines' steps ---------------------------------------------------------------------

def strata_steps(engine: WindowEngine, prompt: list[int], T: int, n: int, steps: Steps) -> None:
    engine.reset()
    engine.prefill(prompt[:-1])
    with steps.hooked():
        if T == 1:
            for _ in generate(engine, prompt, options=GenerateOptions(max_tokens=n), spec=SpecOptions(),
                              eos_ids=(), prefilled=len(prompt) - 1):
                pass
            return
        pos = len(prompt) - 1
        for i in range(n):
            engine.run([(pos + j) % engine.vocab_size for j in range(T)], pos)
            engine.commit(T)  # forced acceptance: every row kept
            pos += T


def mlx_lm_steps(model, prompt: list[int], T: int, n: int, steps: Steps, vocab: int | None = None) -> None:
    """mlx-lm's decode steps (T = 1) or T-row forward passes; `vocab` where the model's args lack it
    (a multimodal model's)."""
    vocab = vocab or model.args.vocab_size
    mlx_generate, make_prompt_cache = require_mlx_lm()
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    with steps.hooked():
        if T == 1:
            for _ in mlx_generate.generate_step(mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=cache):
                pass
            return
        for i in range(n):
            mx.eval(model(mx.array([[(i * T + j) % vocab for j in range(T)]]), cache=cache))


def measure(run, model, stand_ins: StandIns, n: int, *, count: bool = True) -> dict:
    """Counts of an instrumented pass, then build times of a plain one (the wrappers cost time)."""
    timed = Steps(stand_ins, count=False)
    if not count:
        run(timed)
        return {"build_ms": 1e3 * statistics.median(timed.build_s[WARMUP:]), "steps": len(timed.build_s)}
    counted = Steps(stand_ins, count=True)
    with parts_of(model, counted), mock.patch.object(LayerCompile, "mode", "never"):
        run(counted)  # eager, so that every part is seen
    compiled = Steps(stand_ins, count=True)
    run(compiled)  # what runs: compiled layer ends where LayerCompile applies
    run(timed)
    counts = [c for c in counted.counts[WARMUP:] if c.total]
    totals_run = [c.total for c in compiled.counts[WARMUP:] if c.total]
    totals = [c.total for c in counts]
    typical = counts[len(counts) // 2]
    return {
        "ops": statistics.median(totals_run), "ops_min": min(totals_run), "ops_max": max(totals_run),
        "ops_eager": statistics.median(totals), "views": typical.views,
        "by_part": dict(sorted(typical.by_part.items())),
        "by_primitive": dict(typical.by_primitive.most_common()),
        "build_ms": 1e3 * statistics.median(timed.build_s[WARMUP:]),
        "steps": len(timed.build_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("gpu", "native"), default="gpu",
                        help="gpu: count what a CUDA device runs (stand-ins on the CPU); native: this backend")
    parser.add_argument("--family", choices=("qwen3_next", "gpt_oss"), default="qwen3_next",
                        help="the checkpoint's family (both built with mlx-lm's class, small dims)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="steps per measurement (the first 3 are warm-up)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--windows", default="1,4,8", help="row counts T to measure")
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--no-count", action="store_true", help="build times only (quicker)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/strata-step-ops"))
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the first 3 are warm-up)")
    if args.path == "native" and mx.default_device() == mx.cpu:
        print("note: --path native on the CPU counts the CPU's graph (fast ops decomposed, no kernels)")

    shape = GPT_OSS_SHAPE if args.family == "gpt_oss" else SHAPE
    path = args.dir / (f"L{args.layers}" if args.family == "qwen3_next" else f"{args.family}-L{args.layers}")
    if not (path / "config.json").is_file():
        build = compare.build_checkpoint if args.family == "qwen3_next" else compare.build_gpt_oss_checkpoint
        build(path, layers=args.layers, tiny=False, bits=4 if args.family == "qwen3_next" else 0, seed=0, shape=shape)
    prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], args.context).tolist()
    model = load_checkpoint(path, dtype=args.dtype)
    engine = WindowEngine(model)
    peer = None if args.no_mlx_lm else MlxLmPeer.load(path, dtype=getattr(mx, args.dtype)).model
    stand_ins = StandIns()
    shaped = gpu_shaped(stand_ins) if args.path == "gpu" else nullcontext()

    report = {"commit": git_commit(), "machine": platform.platform(), "device": str(mx.default_device()),
              "mlx": mx.__version__, "path": args.path, "dtype": args.dtype, "layers": args.layers,
              "family": args.family, "shape": shape, "context": args.context, "results": []}
    with shaped:
        for T in (int(t) for t in args.windows.split(",")):
            sides = [("strata", model, lambda s, T=T: strata_steps(engine, prompt, T, args.steps, s))]
            if peer is not None:
                sides.append(("mlx-lm", peer, lambda s, T=T: mlx_lm_steps(peer, prompt, T, args.steps, s)))
            for name, m, run in sides:
                row = {"engine": name, "T": T, **measure(run, m, stand_ins, args.steps, count=not args.no_count)}
                report["results"].append(row)
                if args.no_count:
                    print(f"{name:7s} T={T}  build {row['build_ms']:6.2f} ms", flush=True)
                    continue
                parts = " ".join(f"{k}={v}" for k, v in row["by_part"].items())
                print(f"{name:7s} T={T}  ops {row['ops']:5.0f} (eager {row['ops_eager']:4.0f}, views "
                      f"{row['views']:3d})  build {row['build_ms']:6.2f} ms  {parts}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
