"""Prefill tokens per second of strata and mlx-lm on the same weights, in one run.

Both sides prefill the same random prompt of `--tokens` ids from empty state and end with the
last row's logits evaluated: strata through `WindowEngine.prefill` (its prompt chunks, the
chunked gated-delta rule), mlx-lm the way its `generate_step` prefills (chunks of 2,048 with
the cache evaluated between them, then the last chunk's logits). One warm-up run of each, then
`--repeats` timed runs, the two sides alternating so drift on a shared machine hits both; the
table shows medians and their ratio. The last logits of both sides are compared too, so a
mismatch of the two models shows up next to the speed.

    python -m scripts.bench.prefill_bench                                # demo model, 3,000 tokens (CPU)
    python -m scripts.bench.prefill_bench --synthetic 80b                # 8-layer 80B-A3B shape, 4-bit, 4,096 tokens (GPU)
    python -m scripts.bench.prefill_bench --synthetic tiny --tokens 200  # a seconds-long CPU check
    python -m scripts.bench.prefill_bench --compare blas=mlx             # also strata with MLX's own CPU BLAS

`--synthetic 80b` builds Qwen3-Next-80B-A3B's layer shapes (scripts/bench/window_cost.py) with mlx-lm's
own model class, random weights, quantized by mlx-lm's `quantize_model` (its 8-bit routers),
and hands strata the very same arrays in the MLX layout, as if loaded from one checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from scripts.bench.window_cost import DTYPES, QWEN3_NEXT_80B_A3B, TINY
from strata_cli.bench.peers import MlxLmPeer, require_mlx_lm
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import GPU_PREFILL_CHUNK, WindowEngine, default_prefill_chunk
from strata_cli.model import moe, qwen3_next
from strata_cli.model.host_blas import HostBlas
from strata_cli.model.loader import read_quantization
from strata_cli.model.quant import apply_to_load
from strata_cli.options import PREFILL_CHUNK, EngineOptions, LoadOptions
from strata_cli.runtime import open_model

MLX_LM_PREFILL_STEP = 2048  # mlx-lm generate_step's default prefill_step_size
SYNTHETIC = ("80b", "tiny")


def build_synthetic(kind: str, *, layers: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int):
    """(strata model, mlx-lm model) sharing one set of random weights.

    mlx-lm's `Model` is built and initialised by mlx-lm itself, quantized by its
    `quantize_model` when `bits`, and strata's model loads the same arrays through its MLX-layout
    `sanitize`, as `strata` would load the checkpoint mlx-lm writes.
    """
    require_mlx_lm()
    from mlx_lm.models import qwen3_next as mlx_qwen3_next
    from mlx_lm.utils import quantize_model

    shape = dict(QWEN3_NEXT_80B_A3B)
    if kind == "tiny":
        shape.update(TINY, hidden_size=128, linear_key_head_dim=32, linear_value_head_dim=32, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                     moe_intermediate_size=64, shared_expert_intermediate_size=128)  # every input a multiple of 64
    params = dict(shape, num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                  tie_word_embeddings=False)
    mx.random.seed(seed)
    peer = mlx_qwen3_next.Model(mlx_qwen3_next.ModelArgs.from_dict(params))
    peer.set_dtype(dtype)
    if bits:
        peer, params = quantize_model(peer, params, group_size, bits)
        params.pop("quantization_config", None)
    for layer in peer.layers:  # one layer at a time: the float weights never all exist at once
        mx.eval(layer.parameters())
    mx.eval(peer.parameters())
    peer.eval()

    config = qwen3_next.Config.from_dict(params)
    model = qwen3_next.Model(config)
    weights = model.sanitize(dict(tree_flatten(peer.parameters())))
    quantization = read_quantization(params)
    if quantization is not None:
        apply_to_load(model, quantization, weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model, peer


def strata_prefill(engine: WindowEngine, ids: list[int], chunk: int | None) -> mx.array:
    engine.reset()
    return engine.prefill(ids, chunk=chunk)  # evaluated inside, chunk by chunk


def mlx_lm_prefill(model, ids: list[int], step: int = MLX_LM_PREFILL_STEP) -> mx.array:
    _, make_prompt_cache = require_mlx_lm()
    cache = make_prompt_cache(model)
    y = mx.array(ids)
    while y.size > step:
        model(y[:step][None], cache=cache)
        mx.eval([c.state for c in cache])
        y = y[step:]
    logits = model(y[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(logits)
    return logits


def timed(fn) -> tuple[float, mx.array]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# Prompt-path settings a run can compare against strata's defaults (`--compare KEY=VALUE`).
SETTINGS = {
    "blas": (HostBlas, "mode", ("auto", "numpy", "mlx")),  # CPU prompt matmuls: numpy's BLAS or MLX's
    "experts": (moe, "GPU_PROMPT_EXPERTS", ("padded", "gather")),  # GPU prompt experts' form
}


@contextmanager
def setting(key: str, value: str):
    """strata's prompt path with SETTINGS[key] set to `value` for the duration."""
    owner, name, _ = SETTINGS[key]
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def parse_setting(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    if key not in SETTINGS or value not in SETTINGS[key][2]:
        choices = "; ".join(f"{k}={'|'.join(v[2])}" for k, v in SETTINGS.items())
        raise argparse.ArgumentTypeError(f"expected one of {choices}, got {text!r}")
    return key, value


def measure(engine: WindowEngine, peer, ids: list[int], *, chunk: int | None, repeats: int, warmup: int,
            compare: list[tuple[str, str]] = ()) -> dict:
    """Median prefill seconds of each side (alternating), tokens/s, ratio and last-logit agreement.
    `compare`: more strata sides, each with one prompt-path setting changed."""
    sides = {"strata": lambda: strata_prefill(engine, ids, chunk)}
    for key, value in compare:
        def changed(key=key, value=value):
            with setting(key, value):
                return strata_prefill(engine, ids, chunk)
        sides[f"strata {key}={value}"] = changed
    if peer is not None:
        sides["mlx-lm"] = lambda: mlx_lm_prefill(peer, ids)
    seconds = {name: [] for name in sides}
    logits = {}
    for i in range(warmup + repeats):
        for name, fn in sides.items():
            s, logits[name] = timed(fn)
            if i >= warmup:
                seconds[name].append(s)
    result = {"tokens": len(ids), "chunk": chunk or default_prefill_chunk(), "repeats": repeats, "warmup": warmup, "sides": {}}
    for name, runs in seconds.items():
        median = statistics.median(runs)
        result["sides"][name] = {"median_s": median, "seconds": runs, "tokens_per_s": len(ids) / median}
    if peer is not None:
        result["ratio"] = result["sides"]["strata"]["tokens_per_s"] / result["sides"]["mlx-lm"]["tokens_per_s"]
        a, b = logits["strata"], logits["mlx-lm"]
        result["last_logits_rel_diff"] = (mx.abs(a - b).max() / mx.abs(b).max()).item()
        result["same_argmax"] = int(mx.argmax(a).item()) == int(mx.argmax(b).item())
    for name in sides:
        if name not in ("strata", "mlx-lm"):  # how far a changed setting moves the last logits
            a, b = logits[name], logits["strata"]
            result["sides"][name]["last_logits_rel_diff_to_strata"] = (mx.abs(a - b).max() / mx.abs(b).max()).item()
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="checkpoint directory or 'demo' (default demo)")
    parser.add_argument("--synthetic", choices=SYNTHETIC, default=None,
                        help="random weights instead of --model: '80b' (80B-A3B layer shapes) or 'tiny'")
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (default 3000; 4096 with --synthetic 80b)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of --synthetic (default 8)")
    parser.add_argument("--bits", type=int, default=None, choices=[0, 4, 8],
                        help="weight bits of --synthetic (default 4 for 80b, 0 for tiny)")
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="compute dtype (default: bfloat16 for --synthetic 80b, else float32 on the CPU and "
                             "the checkpoint's own elsewhere)")
    parser.add_argument("--chunk", type=int, default=None,
                        help=f"strata prompt chunk (default {PREFILL_CHUNK} on the CPU, {GPU_PREFILL_CHUNK} on a GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="time strata only")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is available")
    parser.add_argument("--compare", action="append", type=parse_setting, default=[], metavar="KEY=VALUE",
                        help="also time strata with one prompt-path setting changed, alternating with the rest: "
                             "blas=numpy|mlx (CPU prompt matmuls), experts=padded|gather (GPU prompt "
                             "experts); repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("prefill_bench.json"), help="JSON output (default prefill_bench.json)")
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 4096 if args.synthetic == "80b" else 3000
    if args.bits is None:
        args.bits = 4 if args.synthetic == "80b" else 0
    if args.tokens < 1 or args.repeats < 1 or args.warmup < 0 or (args.chunk is not None and args.chunk < 1):
        parser.error("--tokens, --repeats and --chunk must be at least 1, --warmup at least 0")
    if args.synthetic and args.layers < 4:  # mlx-lm's qwen3_next needs an attention layer (every 4th)
        parser.error(f"--layers must be at least 4 with --synthetic, got {args.layers}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    on_cpu = mx.default_device() == mx.cpu
    t0 = time.perf_counter()
    if args.synthetic:
        dtype_name = args.dtype or ("bfloat16" if args.synthetic == "80b" and not on_cpu else "float32")
        model, peer = build_synthetic(args.synthetic, layers=args.layers, bits=args.bits, group_size=args.group_size,
                                      dtype=DTYPES[dtype_name], seed=args.seed)
        label = (f"synthetic {args.synthetic}: " + ("Qwen3-Next-80B-A3B layer shapes" if args.synthetic == "80b"
                                                     else "tiny Qwen3-Next shapes") + ", random weights")
        if args.no_peer:
            peer = None
    else:
        dtype_name = args.dtype or ("float32" if on_cpu else None)
        runtime = open_model(LoadOptions(model=args.model, dtype=dtype_name))
        model, dtype_name = runtime.model, runtime.dtype_name
        peer = None if args.no_peer else MlxLmPeer.load(runtime.path, dtype=runtime.dtype).model
        label = str(args.model)
    build_s = time.perf_counter() - t0
    c = model.config
    if args.tokens > c.max_position_embeddings:
        raise SystemExit(f"--tokens {args.tokens} exceeds the model's context of {c.max_position_embeddings}")
    engine = WindowEngine(model, EngineOptions(max_context=args.tokens))
    ids = mx.random.randint(0, c.vocab_size, (args.tokens,), key=mx.random.key(args.seed)).tolist()
    result = {
        "model": label,
        "layers": list(c.layer_types),
        "bits": (args.bits or None) if args.synthetic else None,
        "dtype": dtype_name,
        "device": str(mx.default_device()),
        "build_seconds": build_s,
        "commit": git_commit(),
        "machine": {"node": platform.node(), "platform": platform.platform(), "mlx": mx.__version__},
        "settings": {key: getattr(owner, name) for key, (owner, name, _) in SETTINGS.items()},
        **measure(engine, peer, ids, chunk=args.chunk, repeats=args.repeats, warmup=args.warmup,
                  compare=args.compare),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{label}, {len(c.layer_types)} layers, {dtype_name}, {result['device']}: prefill of {args.tokens} tokens, "
          f"median of {args.repeats} after {args.warmup} warm-up (strata chunk {args.chunk or default_prefill_chunk()})")
    print("| side | median s | tok/s |")
    print("|---|---|---|")
    for name, side in result["sides"].items():
        vs = result["sides"].get("mlx-lm")
        ratio = f" ({side['tokens_per_s'] / vs['tokens_per_s']:.2f}x mlx-lm)" if vs and name != "mlx-lm" else ""
        print(f"| {name} | {side['median_s']:.3f} | {side['tokens_per_s']:.0f}{ratio} |")
    if "ratio" in result:
        print(f"strata / mlx-lm: {result['ratio']:.2f}x; last logits rel. diff {result['last_logits_rel_diff']:.2e}, "
              f"same argmax: {result['same_argmax']}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
