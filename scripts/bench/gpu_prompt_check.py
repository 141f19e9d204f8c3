"""Does a prompt chunk compute what serial decoding computes, on this backend?

Greedy identity (draft vs serial) cannot see a wrong prompt path: serial and speculative runs share
prefill. This check can. For a random Qwen3-Next-shaped model (MoE with a shared expert, GDN and
attention layers), unquantized and 4-bit, in float32 and bfloat16, it prefills a prompt in one chunk
and compares the last row's logits with one-row windows run token by token from an empty state
(the decode path: row-invariant kernels, picks one at a time). It also multiplies routed experts
three ways — `gather_mm` told its picks are sorted, unsorted, and a dense matmul per pick — to name
the op when the model-level check fails.

    python -m scripts.bench.gpu_prompt_check --out gpu_prompt_check.json   # on the GPU
    python -m scripts.bench.gpu_prompt_check --tiny                        # seconds, CPU
"""

from __future__ import annotations

import argparse
import json
import platform

import mlx.core as mx

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.model.quant import quantize
from strata_cli.options import EngineOptions

# Relative max-abs difference of last-row logits allowed between a prompt chunk and serial windows:
# the two paths sum in different orders, so they agree to rounding, not bit for bit.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


def rel_diff(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-9)).item()


def gather_ops(*, dtype: mx.Dtype, experts: int, rows: int, dims: tuple[int, int], seed: int) -> dict:
    """Routed-expert products through gather_mm (sorted flag on and off) against a dense matmul."""
    H, I = dims
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    w = (mx.random.normal((experts, I, H), key=k1) / H**0.5).astype(dtype)
    x = mx.random.normal((rows, 1, H), key=k2).astype(dtype)
    ids = mx.sort(mx.random.randint(0, experts, (rows,), key=k3)).astype(mx.uint32)
    wt = w.swapaxes(-1, -2)
    dense = mx.concatenate([x[i] @ wt[ids[i].item()] for i in range(rows)])[:, None, :]
    out = {}
    for name, rhs in (("transposed", wt), ("contiguous", mx.contiguous(wt))):
        for is_sorted in (True, False):
            got = mx.gather_mm(x, rhs, rhs_indices=ids, sorted_indices=is_sorted)
            out[f"{name}_sorted={is_sorted}"] = rel_diff(got, dense)
    return out


def prompt_vs_serial(config, *, dtype: str, bits: int, tokens: list[int], seed: int) -> dict:
    model = random_model(config, seed=seed, dtype=getattr(mx, dtype))
    if bits:
        quantize(model, group_size=32, bits=bits)
    engine = WindowEngine(model, EngineOptions())
    chunk = engine.prefill(tokens, chunk=len(tokens))
    engine.reset()
    last = None
    for pos, tok in enumerate(tokens):
        last = engine.run([tok], pos).logits[0]
        engine.commit(1)
    serial = last
    diff = rel_diff(chunk, serial)
    return {"dtype": dtype, "bits": bits, "prompt_tokens": len(tokens), "rel_diff": diff,
            "argmax_equal": int(mx.argmax(chunk).item()) == int(mx.argmax(serial).item()),
            "ok": diff <= TOLERANCE[dtype]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few-kilobyte model: checks the script on the CPU")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    shape = {} if args.tiny else dict(hidden_size=256, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
                                      shared_expert_intermediate_size=256, vocab_size=512, head_dim=64,
                                      linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=1024)
    config = tiny_qwen3_next_config(**shape)
    tokens = [(7 * i + 3) % config.vocab_size for i in range(args.tokens)]
    dtypes = ["float32", "bfloat16"] if mx.default_device() != mx.cpu else ["float32"]
    result = {"tree": git_commit(), "device": str(mx.default_device()), "machine": platform.node(),
              "mlx": mx.__version__, "gather": {}, "model": []}
    for dtype in dtypes:
        result["gather"][dtype] = gather_ops(dtype=getattr(mx, dtype), experts=config.num_experts,
                                             rows=64 if not args.tiny else 16,
                                             dims=(config.hidden_size, config.moe_intermediate_size), seed=args.seed)
        for bits in (0, 4):
            row = prompt_vs_serial(config, dtype=dtype, bits=bits, tokens=tokens, seed=args.seed)
            result["model"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(result["gather"], indent=1))
    result["ok"] = all(row["ok"] for row in result["model"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
