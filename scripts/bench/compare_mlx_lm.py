"""strata against mlx-lm on one Qwen3-Next-80B-A3B-shaped checkpoint, in one run.

Builds the checkpoint with mlx-lm's own model class (the 80B-A3B layer shapes of
scripts/bench/window_cost.py, `--layers` of them, random weights), quantizes it with mlx-lm
(`quantize_model`, its own predicate: routers at 8 bits) and saves it with mlx-lm; both engines
then load the same files. Measured side by side (medians, warm-up apart):

- serial decode tok/s: a `--context`-token random prompt, `--tokens` greedy tokens, EOS off;
- window cost T = 1..8: strata's forced-acceptance window (run + commit of T rows) against
  mlx-lm's forward of T tokens on its cache;
- identity: greedy `--suffix-draft 3` and `auto` against serial on this model (a prompt of a
  repeated motif, so drafts are proposed), in bfloat16 and float32; and the demo model's
  selftest (strata_cli/bench/selftest.py).

    python -m scripts.bench.compare_mlx_lm --out compare.json    # the H200 run
    python -m scripts.bench.compare_mlx_lm --tiny                # seconds, CPU: checks the script

`--family gpt_oss` runs the same comparison on a GPT-OSS-20B-shaped checkpoint instead
(`build_gpt_oss_checkpoint`: mlx-lm's gpt_oss class, bfloat16, experts MXFP4 as published, the
dense layers affine `--bits` on top when nonzero, routers 8-bit by mlx-lm's predicate).
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

from metal_shaders import attention_window, gdn_window
from metal_shaders import rows_matvec as kernels

from scripts.bench.window_cost import QWEN3_NEXT_80B_A3B
from strata_cli.bench.peers import MlxLmPeer, require_mlx_lm
from strata_cli.bench.runner import git_commit
from strata_cli.bench.selftest import selftest, window_costs
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.runtime import load_checkpoint

TINY = dict(hidden_size=64, vocab_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            intermediate_size=128, max_position_embeddings=4096)


def build_checkpoint(path: Path, *, layers: int, tiny: bool, bits: int, seed: int,
                     shape: dict | None = None) -> Path:
    """An mlx-lm Qwen3-Next with random weights, quantized and saved by mlx-lm; `shape`
    overrides config entries (scripts/bench/step_ops.py: small dims, the 80B's layer pattern)."""
    from mlx_lm.models import qwen3_next
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = {**QWEN3_NEXT_80B_A3B, **(TINY if tiny else {}), **(shape or {}), "num_hidden_layers": layers,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    config = {k: v for k, v in config.items() if k in qwen3_next.ModelArgs.__dataclass_fields__}
    mx.random.seed(seed)
    model = qwen3_next.Model(qwen3_next.ModelArgs(**config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


# GPT-OSS-20B's shapes (its config.json); `--layers` of its 24 layers, sliding and full alternating
GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
                   num_attention_heads=64, num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4,
                   sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
                   tie_word_embeddings=False,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096, "truncate": False})
GPT_OSS_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, sliding_window=8, max_position_embeddings=4096)


def build_gpt_oss_checkpoint(path: Path, *, layers: int, tiny: bool, bits: int, seed: int) -> Path:
    """An mlx-lm GPT-OSS with random weights in bfloat16, its experts MXFP4 (MLX's mxfp4 mode, as
    mlx-lm loads the published checkpoints), the dense layers affine `bits`-bit when nonzero;
    saved by mlx-lm with a tiny tokenizer (mlx-lm's load wants one)."""
    import mlx.nn as nn
    from mlx_lm.models import gpt_oss
    from mlx_lm.utils import quantize_model, save_config, save_model

    from scripts.train.build_tokenizer import train_tokenizer

    kinds = ["sliding_attention", "full_attention"] * layers
    config = {**GPT_OSS_20B, **(GPT_OSS_TINY if tiny else {}), "num_hidden_layers": layers, "layer_types": kinds[:layers]}
    mx.random.seed(seed)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: ".experts." in p and hasattr(m, "to_quantized"))
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    mx.eval(model.parameters())
    if bits:  # per-layer entries for the dense layers: the block already names the experts' mode
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    config["quantization_config"] = config["quantization"]
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    # the prompts are random ids: the tokenizer (trained on this file, small) only has to load
    train_tokenizer([Path(__file__)], vocab_size=512, out_dir=path)
    save_config(config, path / "config.json")
    return path


def _median_time(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_decode(engine, prompt, tokens, spec) -> tuple[list[int], float]:
    """Tokens and decode seconds (prefill excluded: it runs before the clock starts)."""
    engine.reset()
    engine.prefill(prompt[:-1])
    start = time.perf_counter()
    out = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens), spec=spec,
                                  eos_ids=(), prefilled=len(prompt) - 1) for t in step.tokens]
    return out, time.perf_counter() - start


def mlx_lm_window_costs(model, context: list[int], repeats: int, warmup: int) -> dict[str, float]:
    _, make_prompt_cache = require_mlx_lm()
    costs = {}
    for T in range(1, 9):
        cache = make_prompt_cache(model)
        model(mx.array([context]), cache=cache)
        mx.eval([c.state for c in cache])
        rng = np.random.default_rng(T)

        def forward():
            tokens = mx.array([rng.integers(0, model.args.vocab_size, T).tolist()])
            mx.eval(model(tokens, cache=cache))

        costs[str(T)] = 1000 * _median_time(forward, repeats, warmup)
    return costs


def identity(path: Path, dtype: str, prompt: list[int], tokens: int) -> dict:
    model = load_checkpoint(path, dtype=dtype)
    engine = WindowEngine(model, EngineOptions())
    serial, _ = timed_decode(engine, prompt, tokens, SpecOptions())
    row = {"dtype": dtype}
    for label, spec in (("3", SpecOptions(max_drafts=3)), ("auto", SpecOptions(max_drafts=7, auto=True))):
        out, _ = timed_decode(engine, prompt, tokens, spec)
        first = next((i for i, (a, b) in enumerate(zip(serial, out)) if a != b), None)
        row[label] = {"identical": out == serial, "first_difference": first}
    return row


def run(args) -> dict:
    family = "" if args.family == "qwen3_next" else f"{args.family}-"
    path = args.dir / (family + ("tiny" if args.tiny else f"q{args.bits}-{args.layers}L"))
    if not (path / "config.json").is_file():
        print(f"building {path} with mlx-lm", flush=True)
        build = build_gpt_oss_checkpoint if args.family == "gpt_oss" else build_checkpoint
        build(path, layers=args.layers, tiny=args.tiny, bits=args.bits, seed=args.seed)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, vocab, args.context).tolist()
    compute = "float32" if mx.default_device() == mx.cpu else "bfloat16"

    model = load_checkpoint(path, dtype=compute)
    engine = WindowEngine(model)
    peer = MlxLmPeer.load(path, dtype=getattr(mx, compute))
    strata_s, peer_s = [], []
    for i in range(args.warmup + args.repeats):
        _, s = timed_decode(engine, prompt, args.tokens, SpecOptions())
        p = peer.run("mlx-lm", prompt, args.tokens).seconds
        if i >= args.warmup:
            strata_s.append(s)
            peer_s.append(p)
    serial = {"strata_tok_s": args.tokens / statistics.median(strata_s),
              "mlx_lm_tok_s": args.tokens / statistics.median(peer_s)}
    serial["ratio"] = serial["strata_tok_s"] / serial["mlx_lm_tok_s"]
    print(f"serial decode: strata {serial['strata_tok_s']:.1f} tok/s, mlx-lm {serial['mlx_lm_tok_s']:.1f} tok/s "
          f"({serial['ratio']:.2f}x)", flush=True)
    windows = {"strata_ms": window_costs(engine, len(prompt), args.window_repeats),
               "mlx_lm_ms": mlx_lm_window_costs(peer.model, prompt, args.window_repeats, 3)}
    for T in map(str, range(1, 9)):
        print(f"T={T}: strata {windows['strata_ms'][T]:.2f} ms, mlx-lm {windows['mlx_lm_ms'][T]:.2f} ms", flush=True)
    del model, engine, peer

    motif = rng.integers(0, vocab, 24).tolist()
    repeated = (motif * (args.context // 24 + 1))[: args.context]
    dtypes = ["float32"] if mx.default_device() == mx.cpu else ["bfloat16", "float32"]
    same = [identity(path, dtype, repeated, args.tokens) for dtype in dtypes]
    for row in same:
        print(f"identity {row['dtype']}: 3 drafts {row['3']}, auto {row['auto']}", flush=True)
    demo = selftest(max_tokens=args.tokens, with_window_costs=False)
    return {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
            "commit": git_commit(), "family": args.family, "layers": args.layers, "bits": args.bits, "tiny": args.tiny,
            "context": args.context, "tokens": args.tokens, "serial": serial, "window_cost": windows,
            "identity_80b_shape": same, "identity_demo": demo, "kernels": kernels.status(),
            "gdn_kernels": gdn_window.status(), "attention_kernel": attention_window.status(),
            "sink_attention_kernel": attention_window.sinks_status()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a quick CPU check of the script")
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "gpt_oss"],
                        help="the checkpoint's shapes: Qwen3-Next-80B-A3B or GPT-OSS-20B (MXFP4 experts)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4, choices=[0, 4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--window-repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-compare")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.context, args.tokens, args.window_repeats = 4, 64, 16, 3
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return result



if __name__ == "__main__":
    main()
