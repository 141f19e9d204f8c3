"""What a decode window's small ops cost on this device (issues 37 and 38), each alone, medians:

- `embed`: the 80B shape's quantized embedding lookup (`lookup_embedding`: strata's kernel on a
  GPU) at T = 1, 2, 4, 8 tokens, the ids made on the host each step (`mx.array`, as a window makes
  them) against ids made once and kept. The H100's step_profile (bd55861) gave the lookup 0.03-0.07
  ms at T = 1, 2 and 0.26-0.30 at T = 4, 8, with the ids' pages mapped for the GPU: is it the
  kernel, the ids, or neither (the profile's own split)?
- `kv`: one window's row written into a KV buffer (1, 2, C, 256) of C cells, by `mx.slice_update`
  with the position as an index array (KVState's form before) and by strata's `write_rows` (a
  static slice update, KVState's form now), and whether the buffer kept its address (MLX donated it). On an
  H100 the dynamic form copied a whole expert bank per write (scripts/lab/install_bench.py); a
  KV buffer copied a step costs O(context).

    python -m scripts.lab.small_ops --out small_ops.json
    python -m scripts.lab.small_ops --tiny                  # CPU check: small sizes, few steps
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from strata_cli.model.layers import lookup_embedding
from strata_cli.rows_write import write_rows


def _address(a: mx.array) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(a)))  # any dtype, bfloat16 too


def embed_us(vocab: int, width: int, steps: int, rounds: int) -> dict:
    """µs a step of looking up T host-made ids (and T kept ids), evaluated, by T."""
    table = nn.QuantizedEmbedding(vocab, width, group_size=64, bits=4)
    table.scales = table.scales.astype(mx.bfloat16)
    table.biases = table.biases.astype(mx.bfloat16)
    mx.eval(table.parameters())
    rng = np.random.default_rng(0)
    out: dict[str, dict[int, float]] = {"host_ids": {}, "kept_ids": {}}
    for T in (1, 2, 4, 8):
        kept = mx.array(rng.integers(0, vocab, (1, T)).tolist())
        mx.eval(kept, lookup_embedding(table, kept))
        times = {"host_ids": [], "kept_ids": []}
        for _ in range(rounds):
            for form in times:
                start = time.perf_counter()
                for i in range(steps):
                    ids = mx.array([[(i * 7 + j) % vocab for j in range(T)]]) if form == "host_ids" else kept
                    mx.eval(lookup_embedding(table, ids))
                times[form].append(1e6 * (time.perf_counter() - start) / steps)
        for form, ts in times.items():
            out[form][T] = round(statistics.median(ts), 2)
    print("embed_us", json.dumps(out), flush=True)
    return out


def kv_write_us(cells: list[int], steps: int, rounds: int) -> list[dict]:
    """µs a step of writing one row into a (1, 2, C, 256) bfloat16 buffer, two ways, and whether
    the buffer kept its address over the steps."""
    rows = []
    row = mx.ones((1, 2, 1, 256), dtype=mx.bfloat16)
    for C in cells:
        times: dict[str, list[float]] = {"dynamic": [], "static": []}
        kept = {}
        for _ in range(rounds):
            for form in times:
                buf = mx.zeros((1, 2, C, 256), dtype=mx.bfloat16) + 0
                mx.eval(buf)
                first = _address(buf)
                start = time.perf_counter()
                for i in range(steps):
                    p = (i * 37) % C
                    if form == "dynamic":
                        buf = mx.slice_update(buf, row, mx.array([p]), axes=(2,))
                    else:
                        buf = write_rows(buf, row, p, axis=2)
                    mx.eval(buf)
                times[form].append(1e6 * (time.perf_counter() - start) / steps)
                kept[form] = _address(buf) == first
        entry = {"cells": C, "MB": round(2 * C * 256 * 2 / 1e6, 2),
                 **{f"{form}_us": round(statistics.median(ts), 2) for form, ts in times.items()},
                 **{f"{form}_kept_buffer": kept[form] for form in times}}
        rows.append(entry)
        print("kv_write", json.dumps(entry), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, few steps (a CPU check)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = 5 if args.tiny else 200
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
              "embed_us": embed_us(512 if args.tiny else 151936, 128 if args.tiny else 2048, steps, args.rounds),
              "kv_write": kv_write_us([64, 256] if args.tiny else [1024, 8192, 32768, 131072], steps, args.rounds)}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
