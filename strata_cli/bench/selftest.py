"""`strata selftest`: is speculative decoding lossless on this machine's backend?

Runs the embedded demo model (GDN and attention layers) over built-in prompts, and a tiny
random Nemotron-H model (Mamba-2, attention and MoE layers: bench/hybrid_probe.py) over fixed
prompts of random token ids, serially and with `--suffix-draft 3` and `auto`, in every dtype the
backend computes in (float32 on the CPU; float32 and bfloat16 on a GPU), and reports, per model,
dtype, prompt and mode, identical or the first divergence; then the demo model's window-cost
table (forced acceptance, T = 1..8). It is how a user checks the Metal or CUDA path on their own
machine: any divergence is a bug (docs/design.md, "Row invariance").
"""

from __future__ import annotations

import time

import mlx.core as mx

from metal_shaders import (add_norm, argmax_rows, attention_prep, attention_window, embed_rows, gated_norm, gdn_window,
                           mamba2_window, moe_combine, pooled, router_window, rows_mma)
from metal_shaders import rows_matvec as kernels

from ..calibrate import measure_curve
from ..decode import generate
from ..model.config import dtype_name
from ..options import GenerateOptions, LoadOptions, SpecOptions
from ..runtime import open_model
from . import hybrid_probe

# Code to copy, code to continue, prose: drafts are proposed and both kept and rejected.
PROMPTS = (
    "def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
    "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n    return out\n\n\n# The same function, renamed to smooth:\n"
    "def smooth(values, window):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        if os.path.isdir(name):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "The module reads the configuration file, checks every field, and reports the first error it finds. "
    "The module reads the configuration file again when",
)
MODES = (("3", SpecOptions(max_drafts=3)), ("auto", SpecOptions(max_drafts=7, auto=True)))
DEMO, HYBRID = "demo", hybrid_probe.NAME


# Every GPU kernel family: its report key, its probe (`usable(dtype)`) and its `status()`.
KERNEL_PROBES = (
    ("kernels", kernels.kernels_usable, kernels.status),
    ("glu_kernels", kernels.glu_usable, kernels.glu_status),
    ("mapped_kernels", kernels.mapped_usable, kernels.mapped_status),
    ("mma_kernels", rows_mma.usable, rows_mma.status),
    ("gdn_kernels", gdn_window.usable, gdn_window.status),
    ("mamba2_kernels", mamba2_window.usable, mamba2_window.status),
    ("attention_kernel", attention_window.usable, attention_window.status),
    ("sink_attention_kernel", attention_window.sinks_usable, attention_window.sinks_status),
    ("attention_prep_kernel", attention_prep.usable, attention_prep.status),
    ("router_kernel", router_window.usable, router_window.status),
    ("add_norm_kernel", add_norm.usable, add_norm.status),
    ("combine_kernel", moe_combine.usable, moe_combine.status),
    ("gated_norm_kernel", gated_norm.usable, gated_norm.status),
    ("embed_kernel", embed_rows.usable, embed_rows.status),
    ("pool_copies", pooled.usable, pooled.status),
    ("argmax_kernels", argmax_rows.usable, argmax_rows.status),
)


def kernel_statuses() -> dict[str, dict]:
    """Each kernel family's status as its probe left it ({"usable", "probed", "error"})."""
    return {key: status() for key, _, status in KERNEL_PROBES}


def probe_kernels(dtypes: list[str] | None = None) -> dict:
    """Run every kernel family's start-up probe at `dtypes` (the backend's by default), without
    decoding: {"backend", "kernels": {key: {**status, "usable_by_dtype", "seconds"}}, "passed"}.
    Off a GPU backend nothing is probed and every family reports unusable with no error."""
    names = dtypes or backend_dtypes()
    out = {}
    for key, usable, status in KERNEL_PROBES:
        start = time.perf_counter()
        by_dtype = {name: bool(usable(getattr(mx, name))) for name in names}
        out[key] = {**status(), "usable_by_dtype": by_dtype, "seconds": round(time.perf_counter() - start, 2)}
    return {"backend": str(mx.default_device()), "kernels": out,
            "passed": all(entry["error"] is None for entry in out.values())}


def backend_dtypes() -> list[str]:
    """The dtypes to check: float32 on the CPU (its half-precision matmuls are slow), both on a GPU."""
    return ["float32"] if mx.default_device() == mx.cpu else ["float32", "bfloat16"]


def _tokens(engine, ids: list[int], max_tokens: int, spec: SpecOptions) -> list[int]:
    """max_tokens tokens, past end-of-text too: a prompt the model ends at once still compares."""
    steps = generate(engine, ids, options=GenerateOptions(max_tokens=max_tokens), spec=spec, eos_ids=())
    return [t for step in steps for t in step.tokens]


def window_costs(engine, context_length: int, repeats: int = 10) -> dict[str, float]:
    """Median forced-acceptance window milliseconds for T = 1..8 after `context_length` positions
    (calibrate.measure_curve, the curve `auto` calibrates with)."""
    curve = measure_curve(engine, 8, windows=repeats + 1, context=context_length)
    return {str(T): 1000 * seconds for T, seconds in enumerate(curve, start=1)}


def _check(engine, model: str, dtype: str, prompts: list[list[int]], max_tokens: int, results: list,
           progress) -> None:
    """Each prompt serially, then in each mode; one result per prompt and mode."""
    for n, ids in enumerate(prompts):
        serial = _tokens(engine, ids, max_tokens, SpecOptions())
        for label, spec in MODES:
            out = _tokens(engine, ids, max_tokens, spec)
            first = next((i for i, (a, b) in enumerate(zip(serial, out)) if a != b),
                         None if len(out) == len(serial) else min(len(out), len(serial)))
            results.append({"model": model, "dtype": dtype, "prompt": n, "mode": label,
                            "identical": out == serial, "first_difference": first, "tokens": len(serial)})
            if progress:
                progress(results[-1])


def selftest(*, max_tokens: int = 64, dtypes: list[str] | None = None, with_window_costs: bool = True,
             progress=None) -> dict:
    """Check greedy identity of every mode against serial decoding on the demo model and on the
    tiny Mamba-2 hybrid (bench/hybrid_probe.py).

    Returns:
        {"backend", "results": [{"model" ("demo" or "mamba2-hybrid"), "dtype", "prompt", "mode",
        "identical", "first_difference", "tokens"}], "window_ms": {dtype: {T: ms}} (the demo
        model's, when asked), "passed" (every result of both models identical)}.
    """
    results, costs = [], {}
    for dtype in dtypes or backend_dtypes():
        runtime = open_model(LoadOptions(dtype=dtype))
        engine, tokenizer = runtime.engine, runtime.tokenizer
        name = dtype_name(runtime.dtype)
        _check(engine, DEMO, name, [tokenizer.encode(p) for p in PROMPTS], max_tokens, results, progress)
        if with_window_costs:
            costs[name] = window_costs(engine, len(tokenizer.encode(PROMPTS[0])))
        hybrid = hybrid_probe.build_engine(runtime.dtype)
        prompts = hybrid_probe.prompts(lambda ids, n, engine=hybrid: _tokens(engine, ids, n, SpecOptions()))
        _check(hybrid, HYBRID, name, prompts, max_tokens, results, progress)
    report = {"backend": str(mx.default_device()), **kernel_statuses(),
              "results": results,
              "passed": all(r["identical"] for r in results)}
    if with_window_costs:
        report["window_ms"] = costs
    return report
