"""Row invariance and greedy identity of one family on this backend: every window row against
serial decoding, bit for bit.

Builds the family's small random checkpoint with mlx-lm's class (scripts/bench/family_speed.py's
TINY shapes), loads it in the given dtype, prefills a random sequence to four start positions and
decodes on serially (one-row windows) from each, then runs windows of T = 2..8 rows there whose
inputs are the true tokens and compares every row's logits with the serial step's (row invariance: a GPU backend whose kernels
round a row differently with the row count shows up here), and after a commit of each keep the
next row too. Finally greedy decoding with suffix drafts (`--suffix-draft 3`) against serial on a
prompt that repeats itself.

    python -m scripts.bench.family_identity --family deepseek_v3 --dtype bfloat16 --out result.json
    python -m scripts.bench.family_identity --family kimi_linear
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench.family_shapes import TINY
from scripts.bench.family_speed import build_checkpoint
from strata_cli.bench.runner import git_commit
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.runtime import load_checkpoint

STARTS = (16, 17, 18, 19)  # pos0 % 4 = 0..3


def check_rows(model, seq: list[int]) -> dict:
    """Every row of every window (T = 2..8 at STARTS) and the row after each commit, against the
    one-row steps serial decoding takes from the same prefilled state."""
    engine = WindowEngine(model)
    rows = same = 0
    worst = 0.0
    for pos0 in STARTS:
        engine.reset()
        engine.prefill(seq[:pos0])
        start = engine.snapshot()
        serial = []
        for pos in range(pos0, pos0 + 9):
            serial.append(engine.run([seq[pos]], pos).logits[0])
            engine.commit(1)
        for T in range(2, 9):
            for keep in range(1, T + 1):
                engine.restore(start)
                out = engine.run(seq[pos0 : pos0 + T], pos0)
                engine.commit(keep)
                nxt = engine.run([seq[pos0 + keep]], pos0 + keep).logits[0]
                engine.commit(1)
                for got, want in [(out.logits[i], serial[i]) for i in range(T)] + [(nxt, serial[keep])]:
                    diff = float(mx.abs(got - want).max())
                    rows += 1
                    same += diff == 0.0
                    worst = max(worst, diff)
    return {"rows_checked": rows, "rows_bit_identical": same, "max_row_diff": worst}


def greedy(model, prompt: list[int], tokens: int, spec: SpecOptions) -> list[int]:
    steps = generate(WindowEngine(model), prompt, options=GenerateOptions(max_tokens=tokens), spec=spec,
                     eos_ids=frozenset())
    return [t for step in steps for t in step.tokens]


def run(args) -> dict:
    path = args.dir / f"{args.family}-float32"
    if not (path / "config.json").is_file():
        print(f"building {path} with mlx-lm", flush=True)
        build_checkpoint(path, args.family, bits=0, seed=args.seed)
    model = load_checkpoint(path, dtype=args.dtype)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    seq = rng.integers(0, vocab, max(STARTS) + 9).tolist()
    out = {"family": args.family, "device": str(mx.default_device()), "dtype": args.dtype, "mlx": mx.__version__,
           "machine": f"{platform.node()} ({platform.machine()})", "commit": git_commit()}
    out.update(check_rows(model, seq))
    head = rng.integers(0, vocab, 24).tolist()
    prompt = head + head[:12]  # the tail repeats the start: the suffix drafter proposes
    serial = greedy(model, prompt, args.tokens, SpecOptions())
    drafted = greedy(model, prompt, args.tokens, SpecOptions(max_drafts=3))
    out["greedy_identical"] = serial == drafted
    print(f"{args.family} ({args.dtype}, {out['device']}): {out['rows_bit_identical']}/{out['rows_checked']} window "
          f"rows bit-identical to serial (max diff {out['max_row_diff']:.2e}); greedy with 3 drafts = serial: "
          f"{out['greedy_identical']}", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(TINY))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-family-speed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
