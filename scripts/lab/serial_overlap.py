"""Serial decoding on the 80B-A3B-shaped 8-layer 4-bit checkpoint (scripts/bench/compare_mlx_lm.py builds it):
strata with overlapped steps, strata without, strata with its layers' ends not compiled
(model/compiled.py) and mlx-lm, alternating, 7 rounds (medians of the
last 6); the host-build / device-wait split of overlapped steps; window costs T = 1..8 against
mlx-lm's forward; greedy identity of `--suffix-draft 3` and auto against serial in bfloat16 and
float32. Writes $OUT/<tag>.json after every stage (the GPU run of docs/benchmarks.md, issue 10).

    OUT=. MLX_PTX_CACHE_DIR=/tmp/ptx python -m scripts.lab.serial_overlap --tag=serial_gdn
    python -m scripts.lab.serial_overlap --tiny --tag=check      # CPU, a minute: checks the script
    flags: --no-windows, --no-identity, --skip-serial
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import attention_window, gdn_window
from metal_shaders import rows_matvec as kernels
from scripts.bench import compare_mlx_lm as compare
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.bench.selftest import window_costs
from strata_cli.engine.window import WindowEngine
from strata_cli.model.compiled import LayerCompile
from strata_cli.options import SpecOptions
from strata_cli.runtime import load_checkpoint

TAG = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tag=")), "gpu_serial")
out = Path(os.environ.get("OUT", "/tmp")) / f"{TAG}.json"
R0 = {"env": {k: v for k, v in os.environ.items() if k.startswith("MLX")}}
R = {"argv": sys.argv, "mlx": mx.__version__, **R0}
def save(): out.write_text(json.dumps(R, indent=1)); print(json.dumps(R)[-600:], flush=True)
t = time.time()
TINY = "--tiny" in sys.argv
path = Path("/tmp/strata-compare/" + ("tiny-dev" if TINY else "q4-8L"))
if not (path / "config.json").is_file():
    compare.build_checkpoint(path, layers=4 if TINY else 8, tiny=TINY, bits=4, seed=0)
R["build_s"] = time.time() - t; save()
vocab = json.loads((path / "config.json").read_text())["vocab_size"]
rng = np.random.default_rng(0)
prompt = rng.integers(0, vocab, 512).tolist()
t = time.time()
DT = "float32" if TINY else "bfloat16"
model = load_checkpoint(path, dtype=DT); engine = WindowEngine(model)
peer = MlxLmPeer.load(path, dtype=getattr(mx, DT))
R["load_s"] = time.time() - t; save()
N = 16 if TINY else 128
def strata(overlap, compiled="always"):
    WindowEngine.can_overlap = property(lambda self: overlap)
    LayerCompile.mode = compiled
    try:
        return compare.timed_decode(engine, prompt, N, SpecOptions())
    finally:
        LayerCompile.mode = "always"
S = {"on": [], "off": [], "eager": [], "mlx": []}
outs = {}
for i in range(0 if '--skip-serial' in sys.argv else 7):
    t = time.time()
    o, s = strata(True); outs.setdefault("on", o); S["on"].append(s)
    o, s = strata(False); outs.setdefault("off", o); S["off"].append(s)
    o, s = strata(True, "never"); outs.setdefault("eager", o); S["eager"].append(s)
    S["mlx"].append(peer.run("mlx-lm", prompt, N).seconds)
    R["serial_raw_s"] = S; R[f"round{i}_s"] = time.time() - t; save()
med = {k: N / statistics.median(v[1:]) for k, v in S.items()} if S["on"] else dict.fromkeys(S, 1)
R["serial_tok_s"] = med; R["ratio_on"] = med["on"] / med["mlx"]; R["ratio_off"] = med["off"] / med["mlx"]
R["overlap_identical_to_plain"] = outs.get("on") == outs.get("off")
R["compiled_identical_to_eager"] = outs.get("on") == outs.get("eager")
R["kernels"] = {"rows": kernels.status(), "gdn": gdn_window.status(), "attention": attention_window.status()}  # after the first forwards (the probe)
save()
# build vs wait split of overlapped steps
WindowEngine.can_overlap = property(lambda self: True)
engine.reset(); engine.prefill(prompt[:-1])
tok = prompt[-1]; pos = len(prompt) - 1; b, w = [], []
cur = engine.launch(tok, pos); engine.commit(1)
for i in range(60):
    t0 = time.perf_counter(); nxt = engine.launch(cur, pos + 1 + i); t1 = time.perf_counter()
    cur.value(); t2 = time.perf_counter(); engine.commit(1); cur = nxt
    b.append(t1 - t0); w.append(t2 - t1)
cur.value(); engine.abandon() if engine._open else None
R["launch_build_ms"] = 1e3 * statistics.median(b[5:]); R["wait_ms"] = 1e3 * statistics.median(w[5:]); save()
if "--no-windows" not in sys.argv:  # (it used to end the script here, skipping the identity stage too)
    R["window_cost"] = {"strata_ms": window_costs(engine, len(prompt), 15),
                        "mlx_lm_ms": compare.mlx_lm_window_costs(peer.model, prompt, 15, 3)}
    save()
motif = rng.integers(0, vocab, 24).tolist()
repeated = (motif * (512 // 24 + 1))[:512]
if "--no-identity" in sys.argv: sys.exit(0)
R["identity_80b"] = []
for dtype in (("float32",) if TINY else ("bfloat16", "float32")):
    t = time.time(); R["identity_80b"].append(compare.identity(path, dtype, repeated, N)); R[f"identity_{dtype}_s"] = time.time() - t
    R["kernels_after_identity"] = {"rows": kernels.status(), "gdn": gdn_window.status(), "attention": attention_window.status()}; save()
