"""Row invariance of the kernels a decode window uses, probed one formulation at a time.

A window of T rows is lossless only if each row computes exactly what it computes alone (serial
decoding runs every row as a 1-row window). For each operation of the decode-window hot path and
each way of calling it, this runs T = 1..8 rows in one call and compares every row, bit for bit,
with the same formulation called on that row alone; it also times T = 1, 4 and 8. On the CPU every
formulation is expected to pass; on MLX CUDA the plain ones are known not to (docs/benchmarks.md).

    python -m scripts.bench.row_probe --out row_probe.json  # on the GPU machine
    python -m scripts.bench.row_probe --small               # seconds, CPU: checks the script

Formulations:
- `plain`: the window's rows as one (T, K) operand (what mlx-lm and plain MLX code do);
- `rows`: each row as its own batch entry, (T, 1, K), so every row is an M = 1 problem;
- `split`: one call per row, concatenated (invariant by construction; T times the calls).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from metal_shaders import rows_matvec as kernels

MAX_ROWS = 8


def _time(fn, repeats: int) -> float:
    mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _check(fn, make_input, repeats: int) -> dict:
    """`fn(x)` for x of T rows (T on axis 0) against `fn(x[i:i+1])` for each row."""
    x8 = make_input(MAX_ROWS)
    alone = [fn(x8[i : i + 1]) for i in range(MAX_ROWS)]
    mx.eval(alone)
    mismatched = []
    worst = 0.0
    for T in range(1, MAX_ROWS + 1):
        together = fn(x8[:T])
        mx.eval(together)
        for i in range(T):
            a, b = together[i : i + 1].astype(mx.float32), alone[i].astype(mx.float32)
            if not mx.array_equal(a, b).item():
                mismatched.append(T)
                worst = max(worst, mx.abs(a - b).max().item())
                break
    times = {str(T): 1000 * _time(lambda: fn(x8[:T]), repeats) for T in (1, 4, 8)}
    return {"invariant": not mismatched, "mismatched_T": mismatched, "max_abs_diff": worst, "ms": times}


def _formulations(op):
    """plain / rows / split versions of `op(x)` for x (T, ...)."""
    return {
        "plain": op,
        "rows": lambda x: op(x[:, None])[:, 0],
        "split": lambda x: mx.concatenate([op(x[i : i + 1]) for i in range(x.shape[0])]),
    }


def probe(*, small: bool, repeats: int, seed: int = 0) -> list[dict]:
    mx.random.seed(seed)
    H, I, N, E, k, ctx, heads, kv_heads, D = (
        (64, 32, 96, 8, 2, 40, 4, 2, 16) if small else (2048, 512, 12288, 512, 10, 1024, 16, 2, 256)
    )
    results = []

    def record(name, dtype, op, make_input):
        for form, fn in _formulations(op).items():
            row = {"op": name, "dtype": dtype, "form": form, **_check(fn, make_input, repeats)}
            results.append(row)
            print(f"{name:18s} {dtype:9s} {form:6s} invariant={row['invariant']!s:5s} "
                  f"T=1/4/8 ms {row['ms']['1']:.3f}/{row['ms']['4']:.3f}/{row['ms']['8']:.3f}", flush=True)

    for dtype_name in ("float32", "bfloat16"):
        dt = getattr(mx, dtype_name)
        w = (mx.random.normal((N, H)) * H**-0.5).astype(dt)
        xs = lambda T, dt=dt: mx.random.normal((T, H)).astype(dt)  # noqa: E731
        record("dense", dtype_name, lambda x, w=w: x @ w.T, xs)
        qw, qs, qb = mx.quantize(w, 64, 4)
        record("quantized_4bit", dtype_name,
               lambda x, qw=qw, qs=qs, qb=qb: mx.quantized_matmul(x, qw, qs, qb, transpose=True, group_size=64, bits=4),
               xs)
        if kernels.kernels_usable():
            for name, op in (("dense", lambda x, w=w: kernels.rows_matvec(x, w)),
                             ("quantized_4bit", lambda x, qw=qw, qs=qs, qb=qb: kernels.rows_qmatvec(
                                 x, qw, qs, qb, group_size=64, bits=4))):
                row = {"op": name, "dtype": dtype_name, "form": "kernel", **_check(op, xs, repeats)}
                results.append(row)
                print(f"{name:18s} {dtype_name:9s} kernel invariant={row['invariant']!s:5s} "
                      f"T=1/4/8 ms {row['ms']['1']:.3f}/{row['ms']['4']:.3f}/{row['ms']['8']:.3f}", flush=True)
        experts = (mx.random.normal((E, I, H)) * H**-0.5).astype(dt)
        eq, es, eb = mx.quantize(experts, 64, 4)
        picks = mx.random.randint(0, E, (MAX_ROWS, k))

        def routed(x, sort: bool, picks=picks, eq=eq, es=es, eb=eb):
            T = x.shape[0]
            flat = picks[:T].reshape(-1)
            xs_ = mx.repeat(x, k, axis=0)[:, None, :]  # (T·k, 1, H), pick order = row order
            if sort:
                order = mx.argsort(flat)
                out = mx.gather_qmm(xs_[order], eq, es, eb, rhs_indices=flat[order], transpose=True,
                                    group_size=64, bits=4, sorted_indices=True)
                out = out[mx.argsort(order)]
            else:
                out = mx.gather_qmm(xs_, eq, es, eb, rhs_indices=flat, transpose=True, group_size=64, bits=4)
            return out.reshape(T, k, -1)

        # picks[:T] ties the routing to the row position, so x[i:i+1] alone must use row 0's picks:
        # compare against rows computed with their own picks instead.
        for sort in (True, False):
            name = f"experts_{'sorted' if sort else 'unsorted'}"
            x8 = xs(MAX_ROWS)
            alone = [routed_one(x8[i : i + 1], picks[i : i + 1], eq, es, eb, k, sort) for i in range(MAX_ROWS)]
            mismatched = []
            for T in range(1, MAX_ROWS + 1):
                together = routed(x8[:T], sort)
                if not all(mx.array_equal(together[i : i + 1], alone[i]).item() for i in range(T)):
                    mismatched.append(T)
            times = {str(T): 1000 * _time(lambda T=T, sort=sort: routed(x8[:T], sort), repeats) for T in (1, 4, 8)}
            row = {"op": name, "dtype": dtype_name, "form": "gather", "invariant": not mismatched,
                   "mismatched_T": mismatched, "ms": times}
            results.append(row)
            print(f"{name:18s} {dtype_name:9s} gather invariant={row['invariant']!s:5s} "
                  f"T=1/4/8 ms {times['1']:.3f}/{times['4']:.3f}/{times['8']:.3f}", flush=True)

        keys = mx.random.normal((1, kv_heads, ctx + MAX_ROWS, D)).astype(dt)
        values = mx.random.normal((1, kv_heads, ctx + MAX_ROWS, D)).astype(dt)
        attention = _attention_probe(keys, values, ctx, heads, D, dt, repeats)
        for row in attention:
            row["dtype"] = dtype_name
            results.append(row)
            print(f"{row['op']:18s} {dtype_name:9s} {row['form']:6s} invariant={row['invariant']!s:5s} "
                  f"T=1/4/8 ms {row['ms']['1']:.3f}/{row['ms']['4']:.3f}/{row['ms']['8']:.3f}", flush=True)
    return results


def routed_one(x, picks, eq, es, eb, k, sort):
    flat = picks.reshape(-1)
    xs_ = mx.repeat(x, k, axis=0)[:, None, :]
    if sort:
        order = mx.argsort(flat)
        out = mx.gather_qmm(xs_[order], eq, es, eb, rhs_indices=flat[order], transpose=True, group_size=64, bits=4,
                            sorted_indices=True)[mx.argsort(order)]
    else:
        out = mx.gather_qmm(xs_, eq, es, eb, rhs_indices=flat, transpose=True, group_size=64, bits=4)
    return out.reshape(1, k, -1)


def _attention_probe(keys, values, ctx, heads, D, dt, repeats) -> list[dict]:
    """T queries at positions ctx..ctx+T-1 (row i sees keys 0..ctx+i) against each alone."""
    scale = D**-0.5
    q8 = mx.random.normal((1, heads, MAX_ROWS, D)).astype(dt)

    def one(i):
        return mx.fast.scaled_dot_product_attention(q8[:, :, i : i + 1], keys[:, :, : ctx + i + 1],
                                                    values[:, :, : ctx + i + 1], scale=scale)

    def window(T):
        return mx.fast.scaled_dot_product_attention(q8[:, :, :T], keys[:, :, : ctx + T], values[:, :, : ctx + T],
                                                    scale=scale, mask="causal" if T > 1 else None)

    def split(T):
        return mx.concatenate([one(i) for i in range(T)], axis=2)

    alone = [one(i) for i in range(MAX_ROWS)]
    mx.eval(alone)
    rows = []
    for form, fn in (("plain", window), ("split", split)):
        mismatched = []
        for T in range(1, MAX_ROWS + 1):
            out = fn(T)
            if not all(mx.array_equal(out[:, :, i : i + 1], alone[i]).item() for i in range(T)):
                mismatched.append(T)
        times = {str(T): 1000 * _time(lambda T=T: fn(T), repeats) for T in (1, 4, 8)}
        rows.append({"op": "attention", "form": form, "invariant": not mismatched, "mismatched_T": mismatched,
                     "ms": times})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: a seconds-long check of the script")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    results = probe(small=args.small, repeats=args.repeats)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
              "small": args.small, "kernels": kernels.status(), "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
