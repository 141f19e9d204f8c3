"""Window cost T = 1, 4, 8 of strata against mlx-lm's one-row forward, alternating round by
round on the 80B-A3B-shaped 8-layer 4-bit checkpoint (scripts/bench/compare_mlx_lm.py builds it), bfloat16,
512-token context: the issue-10 window targets measured so that a noisy host drifts both sides
alike (medians of rounds 2..9; per-round ratios kept). Writes $OUT/window_alternate.json.

    OUT=. python -m scripts.lab.window_alternate      # the GPU run (docs/benchmarks.md)
    python -m scripts.lab.window_alternate --tiny     # CPU, a minute: checks the script
"""
import json
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench import compare_mlx_lm as compare
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.calibrate import measure_curve
from strata_cli.engine.window import WindowEngine
from strata_cli.runtime import load_checkpoint

TINY = "--tiny" in sys.argv
ROUNDS = 3 if TINY else 9
path = Path("/tmp/strata-compare/" + ("tiny-dev" if TINY else "q4-8L"))
if not (path / "config.json").is_file():
    compare.build_checkpoint(path, layers=4 if TINY else 8, tiny=TINY, bits=4, seed=0)
vocab = json.loads((path / "config.json").read_text())["vocab_size"]
prompt = np.random.default_rng(0).integers(0, vocab, 64 if TINY else 512).tolist()
dtype = "float32" if TINY else "bfloat16"
engine = WindowEngine(load_checkpoint(path, dtype=dtype))
peer = MlxLmPeer.load(path, dtype=getattr(mx, dtype))
R = {"mlx": mx.__version__, "device": str(mx.default_device()),
     "strata_T1_ms": [], "strata_T4_ms": [], "strata_T8_ms": [], "mlx_lm_T1_ms": []}
for r in range(ROUNDS):
    curve = measure_curve(engine, 8, windows=16, context=len(prompt))
    for T in (1, 4, 8):
        R[f"strata_T{T}_ms"].append(1e3 * curve[T - 1])
    R["mlx_lm_T1_ms"].append(compare.mlx_lm_window_costs(peer.model, prompt, 15, 3)["1"])
    print(r, {k: round(v[-1], 2) for k, v in R.items() if isinstance(v, list)}, flush=True)
medians = {k: statistics.median(v[1:]) for k, v in R.items() if isinstance(v, list)}
R.update(medians=medians, T1_over_mlx_lm=medians["strata_T1_ms"] / medians["mlx_lm_T1_ms"],
         T4_over_T1=medians["strata_T4_ms"] / medians["strata_T1_ms"],
         T8_over_T1=medians["strata_T8_ms"] / medians["strata_T1_ms"],
         per_round_T1_over_mlx_lm=[a / b for a, b in zip(R["strata_T1_ms"], R["mlx_lm_T1_ms"])])
out = Path(os.environ.get("OUT", "/tmp")) / "window_alternate.json"
out.write_text(json.dumps(R, indent=1))
print({k: R[k] for k in ("T1_over_mlx_lm", "T4_over_T1", "T8_over_T1")})
