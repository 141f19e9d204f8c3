"""Serial decode speed of strata against mlx-lm on one family's small random checkpoint.

Builds the checkpoint with mlx-lm's own model class (random weights, the shapes of the family's
tiny test checkpoint in tests/hf_checkpoints.py), optionally quantized by mlx-lm, saved by mlx-lm;
both engines load the same files and decode the same random prompt greedily, EOS off, prefill
outside the clock. Runs alternate (strata, mlx-lm, strata, ...) after a warm-up pair; the figure
is the ratio of the medians.

    python -m scripts.bench.family_speed --family qwen3_5_moe
    python -m scripts.bench.family_speed --family qwen3_5 --bits 4 --tokens 256
    python -m scripts.bench.family_speed --family qwen3_5_moe --model ~/models/Qwen3.5-35B-A3B-4bit
    python -m scripts.bench.family_speed --family nemotron_h --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family granitemoehybrid --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family glm4_moe --repeats 9 --tokens 256
    python -m scripts.bench.family_speed --family gpt_oss --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family deepseek_v3 --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family kimi_linear --repeats 7 --tokens 128

Families: the TINY table below (add a family with its mlx-lm model_type and a tiny config).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench.compare_mlx_lm import timed_decode
from scripts.bench.family_shapes import TINY
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.options import SpecOptions
from strata_cli.runtime import load_checkpoint



def build_checkpoint(path: Path, family: str, *, bits: int, seed: int) -> Path:
    """The family's tiny config as mlx-lm's model class, random weights, saved (and quantized) by mlx-lm."""
    import importlib

    from mlx_lm.utils import quantize_model, save_config, save_model

    config = json.loads(json.dumps(TINY[family]))
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    # mlx-lm's Nemotron-H router starts at zero: every expert ties, and the picks among ties are
    # each engine's own; random router rows (nn.Linear's scale) make the routing a real one
    from mlx.utils import tree_flatten

    zero_routers = [(name, w) for name, w in tree_flatten(model.parameters())
                    if name.endswith("gate.weight") and not mx.any(w).item()]
    if zero_routers:
        scale = 1 / (zero_routers[0][1].shape[-1] ** 0.5)
        model.load_weights([(name, mx.random.uniform(-scale, scale, w.shape)) for name, w in zero_routers],
                           strict=False)
        mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    if not config["model_type"].startswith("qwen3_5"):  # mlx-lm's load wants a tokenizer for the others
        _tiny_tokenizer(path, vocab_size=config.get("text_config", config)["vocab_size"])
    save_config(config, path / "config.json")
    return path


def _tiny_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of `vocab_size` trained on a few stdlib modules (as the tests
    build theirs); the prompt is random ids, so it only has to load."""
    import argparse as _argparse
    import difflib
    import inspect
    import textwrap

    from scripts.train.build_tokenizer import train_tokenizer

    files = [Path(m.__file__) for m in (textwrap, inspect, json, _argparse, difflib)]
    train_tokenizer(files, vocab_size=vocab_size, out_dir=path)


def vocab_size(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def run(args) -> dict:
    path = args.model
    if path is None:
        path = args.dir / f"{args.family}-{f'q{args.bits}' if args.bits else 'float32'}"
        if not (path / "config.json").is_file():
            print(f"building {path} with mlx-lm", flush=True)
            build_checkpoint(path, args.family, bits=args.bits, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, vocab_size(path), args.context).tolist()
    compute = "float32" if mx.default_device() == mx.cpu else "bfloat16"
    engine = WindowEngine(load_checkpoint(path, dtype=compute))
    peer = MlxLmPeer.load(path, dtype=getattr(mx, compute))
    strata_s, peer_s, strata_cpu, peer_cpu, same = [], [], [], [], True
    for i in range(args.warmup + args.repeats):
        cpu = time.process_time()
        tokens, seconds = timed_decode(engine, prompt, args.tokens, SpecOptions())
        cpu, strata_cpu_s = time.process_time(), time.process_time() - cpu
        result = peer.run("mlx-lm", prompt, args.tokens)
        peer_cpu_s = time.process_time() - cpu
        same &= tokens == result.token_ids[0]
        if i >= args.warmup:
            strata_s.append(seconds)
            peer_s.append(result.seconds)
            strata_cpu.append(strata_cpu_s)
            peer_cpu.append(peer_cpu_s)
    out = {"family": args.family, "model": str(path), "bits": args.bits, "device": str(mx.default_device()),
           "dtype": compute, "mlx": mx.__version__, "machine": f"{platform.node()} ({platform.machine()})",
           "commit": git_commit(), "context": args.context, "tokens": args.tokens, "repeats": args.repeats,
           "strata_tok_s": args.tokens / statistics.median(strata_s),
           "mlx_lm_tok_s": args.tokens / statistics.median(peer_s),
           "strata_runs_s": strata_s, "mlx_lm_runs_s": peer_s, "same_tokens": same,
           # process CPU seconds per run, prompt included for both: on a shared machine the work
           # each engine did, where wall time also counts the time other processes held the cores
           "strata_cpu_s": strata_cpu, "mlx_lm_cpu_s": peer_cpu,
           "cpu_ratio": statistics.median(peer_cpu) / statistics.median(strata_cpu)}
    out["ratio"] = out["strata_tok_s"] / out["mlx_lm_tok_s"]
    print(f"{args.family} serial decode ({compute}, {out['device']}): strata {out['strata_tok_s']:.1f} tok/s, "
          f"mlx-lm {out['mlx_lm_tok_s']:.1f} tok/s ({out['ratio']:.2f}x; CPU time {out['cpu_ratio']:.2f}x); "
          f"same tokens: {same}", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(TINY))
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint both engines read (default: build the tiny one)")
    parser.add_argument("--bits", type=int, default=0, choices=[0, 4, 8], help="quantize the built checkpoint (0: float32)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
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
