"""Where a decode step's host time goes on a GPU (issue 10: small-batch decoding is host-bound).

Writes $OUT/gpu_prof.json: per op (quantized matmul, gather_qmm, rope, sdpa, rms_norm, a compiled
elementwise op, and strata's row kernels where they run) the microseconds to build one node and to
dispatch it inside an eval of 300; strata's T=1 step split into graph build and eval, as it
runs, with its layer ends not compiled (`LayerCompile.mode = "never"`) and without the kernels
(`RowSplit.mode = "never"`); mlx-lm's step split the same way; and a cProfile of strata's graph
build (30 functions by own time). On the 80B-A3B-shaped 8-layer 4-bit
checkpoint that scripts/bench/compare_mlx_lm.py builds.

    OUT=. MLX_PTX_CACHE_DIR=/tmp/ptx python -m scripts.lab.gpu_host_profile  # the GPU run
    python -m scripts.lab.gpu_host_profile --tiny                            # CPU: checks the script
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import rows_matvec as K
from scripts.bench import compare_mlx_lm as compare
from strata_cli.bench.peers import MlxLmPeer, require_mlx_lm
from strata_cli.engine.state import Mode
from strata_cli.engine.window import WindowEngine
from strata_cli.model.compiled import LayerCompile
from strata_cli.model.layers import RowSplit, swiglu
from strata_cli.runtime import load_checkpoint

TINY = "--tiny" in sys.argv
out = Path(os.environ.get("OUT", "/tmp")) / "gpu_prof.json"
R = {}
def save(): out.write_text(json.dumps(R, indent=1)); print(json.dumps(R)[-400:], flush=True)
DT = mx.float32 if TINY else mx.bfloat16
# A. per-op host costs
x = mx.random.normal((1, 2048)).astype(DT); w = (mx.random.normal((512, 2048)) * 0.02).astype(DT)
qw, qs, qb = mx.quantize(w, 64, 4); ew = mx.stack([w] * 16); eqw, eqs, eqb = mx.quantize(ew, 64, 4)
idx = mx.array([1, 5, 9, 3, 2, 7, 11, 0, 4, 6], dtype=mx.uint32)
xs = mx.random.normal((10, 1, 2048)).astype(DT)
q = mx.random.normal((1, 16, 1, 256)).astype(DT); kk = mx.random.normal((1, 2, 600, 256)).astype(DT)
mx.eval(x, w, qw, qs, qb, eqw, eqs, eqb, idx, xs, q, kk)
ops = {
    "add": lambda: x + x,
    "quantized_matmul": lambda: mx.quantized_matmul(x, qw, qs, qb, transpose=True, group_size=64, bits=4),
    "gather_qmm": lambda: mx.gather_qmm(xs, eqw, eqs, eqb, rhs_indices=idx, transpose=True, group_size=64, bits=4),
    "rope": lambda: mx.fast.rope(q, 64, traditional=False, base=1e7, scale=1.0, offset=512),
    "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, kk[..., :513, :], kk[..., :513, :], scale=0.06),
    "rms_norm": lambda: mx.fast.rms_norm(x, w[0], 1e-6),
    "swiglu(compiled)": lambda: swiglu(x, x),
}
if not TINY and K.kernels_usable():
    ops["rows_qmatvec"] = lambda: K.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4)
    ops["rows_gather_qmatvec"] = lambda: K.rows_gather_qmatvec(xs.reshape(10, -1), eqw, eqs, eqb, idx, group_size=64, bits=4)
R["kernels"] = K.status()
per = {}
for name, f in ops.items():
    for _ in range(3): mx.eval(f())
    n = 300
    t0 = time.perf_counter(); arrs = [f() for _ in range(n)]; t1 = time.perf_counter()
    mx.eval(arrs); t2 = time.perf_counter()
    per[name] = {"build_us": 1e6 * (t1 - t0) / n, "eval_us": 1e6 * (t2 - t1) / n}
R["per_op"] = per; save()
# B/C/D. step split
path = Path("/tmp/strata-compare/" + ("tiny-dev" if TINY else "q4-8L"))
if not (path / "config.json").is_file():
    compare.build_checkpoint(path, layers=4 if TINY else 8, tiny=TINY, bits=4, seed=0)
vocab = json.loads((path / "config.json").read_text())["vocab_size"]
prompt = np.random.default_rng(0).integers(0, vocab, 512).tolist()
model = load_checkpoint(path, dtype="float32" if TINY else "bfloat16")
engine = WindowEngine(model)
def strata_split(n=40):
    engine.reset(); engine.prefill(prompt)
    b, e = [], []
    for i in range(n):
        t0 = time.perf_counter()
        logits = engine._forward(mx.array([[7]]), engine.length, Mode.WINDOW)[0].astype(mx.float32)
        g = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter(); mx.eval(logits, g); g.tolist(); t2 = time.perf_counter()
        engine._open = (engine.length, 1, Mode.WINDOW); engine.commit(1)
        b.append(t1 - t0); e.append(t2 - t1)
    return {"build_ms": 1e3 * statistics.median(b[5:]), "eval_ms": 1e3 * statistics.median(e[5:])}
strata_split(10)
R["strata_step"] = strata_split(); save()
LayerCompile.mode = "never"; strata_split(10)
R["strata_step_eager"] = strata_split(); LayerCompile.mode = "always"; save()
RowSplit.mode = "never"; strata_split(10)
R["strata_step_no_kernels"] = strata_split(); RowSplit.mode = "auto"; save()
engine.reset(); engine.prefill(prompt)
def build_only():
    engine._forward(mx.array([[7]]), engine.length, Mode.WINDOW)
    for s in engine.states: s.abandon()
pr = cProfile.Profile(); pr.enable()
for _ in range(50): build_only()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
R["cprofile_build"] = s.getvalue()[-6000:]; save()
peer = MlxLmPeer.load(path, dtype=DT)
_, make_cache = require_mlx_lm()
cache = make_cache(peer.model); peer.model(mx.array([prompt]), cache=cache); mx.eval([c.state for c in cache])
b, e = [], []
for i in range(40):
    t0 = time.perf_counter(); o = peer.model(mx.array([[7]]), cache=cache); g = mx.argmax(o[0, -1], -1)
    t1 = time.perf_counter(); mx.eval(g); g.item(); t2 = time.perf_counter(); b.append(t1 - t0); e.append(t2 - t1)
R["mlx_lm_step"] = {"build_ms": 1e3 * statistics.median(b[5:]), "eval_ms": 1e3 * statistics.median(e[5:])}; save()
