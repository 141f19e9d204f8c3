"""What does installing a streamed expert record into the slot banks cost, and how to make it cheap?

On the H200 a 1.77 MB 80B-A3B expert record cost ~1.2 ms to install (docs/benchmarks.md, issue 38):
far below what PCIe moves. This times the ways of getting a pass of P records from host buffers
into (S, ...) slot banks, on whatever device MLX runs, each variant timed as host build time
(graph building, host copies) and evaluation time (the device's share), per record:

- `record`: what ExpertCache does today: one `mx.array` per tensor per record, one `slice_update`
  per tensor per record;
- `pass_slices`: one `mx.array` of the pass's bytes, each tensor's (P, ...) view taken on the
  device, one `slice_update` per tensor per record from those views;
- `pass_scatter`: as `pass_slices`, then one scatter per tensor (`bank[slots] = values`);
- `staging`: a persistent MLX array the host writes in place (numpy view), then as `pass_slices`;
- `advised_staging`: the same, the array advised to stay on the host, mapped for the GPU
  (experts/staging.py, what ExpertCache does; the reader writes the slot itself there);
- `h2d`: one `mx.array` of the pass's bytes and a sum over it (the transfer alone).

`--bank-sizes S...` times instead what a pass costs by cache size: banks of S slots that own
their buffers and were just read (as a layer's compute reads them), P records from advised
staging written into scattered slots three ways: `static`, MLX's static slice update a slot
(`bank[s:s+1] = v`, ExpertCache's `write_slots`), `dynamic`, `mx.slice_update` a slot with the
slot as an index array (what the cache did before), and `scatter`, one scatter per tensor
(`bank[slots] = values`). A cost per record that grows with S is a bank copied per write: on an
H100 (MLX 0.32.4) the dynamic form went from 0.28 to 1.04 ms a record between 26 and 512 slots,
the static one and the scatter stayed at 0.19-0.20 (docs/benchmarks.md, "The H100 loan of
2026-12-05").
Each form's written slots are checked against the staged records.

Every variant's banks are checked equal to `record`'s. Results as JSON on stdout or `--out`.

    python -m scripts.lab.install_bench --out install_bench.json
    python -m scripts.lab.install_bench --tiny           # CPU check
    python -m scripts.lab.install_bench --bank-sizes 26 52 128 512 --passes 9 --out installs_by_slots.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from strata_cli.cuda_driver import host_mapped
from strata_cli.experts.cache import write_slots

# One 80B-A3B expert, 4-bit, group 64: (name, shape, numpy dtype, mlx dtype).
EXPERT_80B = [
    ("gate.weight", (512, 256), np.uint32, mx.uint32), ("gate.scales", (512, 32), np.uint16, mx.bfloat16),
    ("gate.biases", (512, 32), np.uint16, mx.bfloat16),
    ("up.weight", (512, 256), np.uint32, mx.uint32), ("up.scales", (512, 32), np.uint16, mx.bfloat16),
    ("up.biases", (512, 32), np.uint16, mx.bfloat16),
    ("down.weight", (2048, 64), np.uint32, mx.uint32), ("down.scales", (2048, 8), np.uint16, mx.bfloat16),
    ("down.biases", (2048, 8), np.uint16, mx.bfloat16),
]
EXPERT_TINY = [(name, (shape[0] // 16, shape[1]), npd, mxd) for name, shape, npd, mxd in EXPERT_80B]


def layout(tensors):
    offsets, at = [], 0
    for name, shape, npd, mxd in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(npd).itemsize
        offsets.append((name, shape, npd, mxd, at, nbytes))
        at += nbytes
    return offsets, at


def fresh_banks(offsets, slots):
    banks = {name: mx.zeros((slots, *shape), dtype=mxd) for name, shape, npd, mxd, _, _ in offsets}
    mx.eval(list(banks.values()))
    return banks


def as_mx(array: mx.array, mxd) -> mx.array:
    return array.view(mxd) if array.dtype != mxd else array


def install_record(banks, offsets, records, slots):
    for rec, slot in zip(records, slots):
        at = mx.array([int(slot)])
        for name, shape, npd, mxd, off, nbytes in offsets:
            host = np.frombuffer(rec, dtype=npd, count=nbytes // np.dtype(npd).itemsize, offset=off)
            value = as_mx(mx.array(host.reshape(shape)), mxd)
            banks[name] = mx.slice_update(banks[name], value[None], at, axes=(0,))
    return banks


def tensor_views(flat: mx.array, offsets, stride, P):
    """(P, *shape) device views of each tensor of P consecutive records in `flat` (uint8)."""
    rows = flat.reshape(P, stride)
    return {name: rows[:, off:off + nbytes].view(mxd).reshape(P, *shape) for name, shape, npd, mxd, off, nbytes in offsets}


def install_pass_slices(banks, offsets, records, slots, stride):
    flat = mx.array(np.frombuffer(b"".join(records), dtype=np.uint8))
    views = tensor_views(flat, offsets, stride, len(records))
    for p, slot in enumerate(slots):
        at = mx.array([int(slot)])
        for name in banks:
            banks[name] = mx.slice_update(banks[name], views[name][p:p + 1], at, axes=(0,))
    return banks


def install_pass_scatter(banks, offsets, records, slots, stride):
    flat = mx.array(np.frombuffer(b"".join(records), dtype=np.uint8))
    views = tensor_views(flat, offsets, stride, len(records))
    idx = mx.array(np.asarray(slots, dtype=np.int32))
    for name in banks:
        bank = banks[name]
        bank[idx] = views[name]
        banks[name] = bank
    return banks


def install_staging(banks, offsets, records, slots, stride, staging):
    host = np.array(staging, copy=False)
    for p, rec in enumerate(records):
        host[p * stride:(p + 1) * stride] = np.frombuffer(rec, dtype=np.uint8)
    views = tensor_views(staging[: len(records) * stride], offsets, stride, len(records))
    for p, slot in enumerate(slots):
        at = mx.array([int(slot)])
        for name in banks:
            banks[name] = mx.slice_update(banks[name], views[name][p:p + 1], at, axes=(0,))
    return banks


def host_pointer(array: mx.array) -> int:
    return np.array(array, copy=False).__array_interface__["data"][0]


def write_dynamic(bank: mx.array, rows: list[mx.array], slots: list[int]) -> mx.array:
    for slot, row in zip(slots, rows, strict=True):
        bank = mx.slice_update(bank, row, mx.array([slot]), axes=(0,))
    return bank


def write_scatter(bank: mx.array, rows: list[mx.array], slots: list[int]) -> mx.array:
    bank = mx.array(bank)  # a handle of its own, as write_slots takes
    bank[mx.array(slots)] = mx.concatenate(rows)
    return bank


WRITES = {"static": write_slots, "dynamic": write_dynamic, "scatter": write_scatter}


def by_bank_size(offsets, stride, sizes, P, repeats, rng, advice) -> list[dict]:
    """ms per record of a pass of P records into scattered slots of banks of each size."""
    staging = mx.zeros((P * stride,), dtype=mx.uint8)
    mx.eval(staging)
    if advice:
        advice(host_pointer(staging), P * stride)
    host = np.array(staging, copy=False)
    host[:] = rng.integers(0, 127, P * stride, dtype=np.uint8)  # finite bfloat16 bit patterns
    views = tensor_views(staging, offsets, stride, P)
    rows = []
    for S in sizes:
        for variant, write in WRITES.items():
            banks = {name: mx.zeros((S, *shape), dtype=mxd) + 1 for name, shape, npd, mxd, _, _ in offsets}
            mx.eval(list(banks.values()))
            times = []
            for rep in range(repeats + 1):
                slots = rng.permutation(S)[:P].tolist()
                mx.eval([mx.take(b, mx.array(slots[::-1]), axis=0).sum() for b in banks.values()])  # a reader
                t0 = time.perf_counter()
                for name in banks:
                    banks[name] = write(banks[name], [views[name][p:p + 1] for p in range(P)], slots)
                mx.eval(list(banks.values()))
                if rep:
                    times.append((time.perf_counter() - t0) * 1e3 / P)
            for name, bank in banks.items():  # the last pass's slots hold its records
                if not mx.array_equal(bank[mx.array(slots)], views[name][:P]).item():
                    raise SystemExit(f"{variant} wrote {name} wrong at {S} slots")
            row = {"variant": variant, "slots": S, "records_per_pass": P, "ms_per_record": statistics.median(times)}
            row["ms_per_record_per_slot"] = row["ms_per_record"] / S
            rows.append(row)
            print(json.dumps(row), flush=True)
            del banks
    return rows


def save(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small records (a CPU check)")
    parser.add_argument("--slots", type=int, default=51, help="slots per bank (51: 10%% of 512 experts)")
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 9, 32], help="records per pass")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--bank-sizes", type=int, nargs="+", default=None,
                        help="time a pass by cache size instead (slots per bank; --passes' first value is P)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    offsets, stride = layout(EXPERT_TINY if args.tiny else EXPERT_80B)
    rng = np.random.default_rng(0)
    if args.bank_sizes:  # its own study: none of the pools and staging below
        mapped = host_mapped() if mx.default_device() == mx.gpu and not args.tiny else None
        save({"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
              "record_bytes": stride, "advised": mapped is not None,
              "rows": by_bank_size(offsets, stride, args.bank_sizes, args.passes[0], args.repeats, rng, mapped)},
             args.out)
        return
    pool = [rng.integers(0, 2**16, stride // 2, dtype=np.uint16).view(np.uint8) for _ in range(64)]
    # bfloat16 payloads: keep them finite (no NaN bit patterns) so equality checks are exact
    pool = [np.where(p % 128 == 127, 0, p).astype(np.uint8).tobytes() for p in pool]
    staging = mx.zeros((max(args.passes) * stride,), dtype=mx.uint8)
    mx.eval(staging)

    advised = mx.zeros((max(args.passes) * stride,), dtype=mx.uint8)
    mx.eval(advised)
    advice = None
    if mx.default_device() == mx.gpu and not args.tiny:
        try:
            advice = host_mapped()(host_pointer(advised), max(args.passes) * stride)
        except Exception as error:  # noqa: BLE001 - a lab probe: say why and go on
            advice = f"failed: {error}"
    variants = {
        "record": lambda b, r, s: install_record(b, offsets, r, s),
        "pass_slices": lambda b, r, s: install_pass_slices(b, offsets, r, s, stride),
        "pass_scatter": lambda b, r, s: install_pass_scatter(b, offsets, r, s, stride),
        "staging": lambda b, r, s: install_staging(b, offsets, r, s, stride, staging),
        "advised_staging": lambda b, r, s: install_staging(b, offsets, r, s, stride, advised),
    }
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
           "record_bytes": stride, "slots": args.slots, "advice": advice, "rows": []}
    print("advice:", advice, flush=True)
    for P in args.passes:
        P = min(P, args.slots)
        reference = None
        for name, fn in variants.items():
            build, evals = [], []
            for rep in range(args.repeats + 1):
                banks = fresh_banks(offsets, args.slots)
                records = [pool[(rep * P + j) % len(pool)] for j in range(P)]
                slots = rng.permutation(args.slots)[:P].tolist()
                t0 = time.perf_counter()
                banks = fn(banks, records, slots)
                t1 = time.perf_counter()
                mx.eval(list(banks.values()))
                t2 = time.perf_counter()
                if rep:
                    build.append((t1 - t0) * 1e3 / P)
                    evals.append((t2 - t1) * 1e3 / P)
                if rep == args.repeats:
                    check = {k: np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v) for k, v in banks.items()}
                    state = (records, slots)
            if reference is None:
                reference = (check, state)
            else:  # same records and slots? replay the reference on this variant's last inputs
                ref_banks = install_record(fresh_banks(offsets, args.slots), offsets, *state)
                mx.eval(list(ref_banks.values()))
                for k, v in ref_banks.items():
                    want = np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v)
                    if not np.array_equal(want, check[k]):
                        raise SystemExit(f"{name}: bank {k} differs from the per-record install")
            row = {"variant": name, "records_per_pass": P,
                   "build_ms_per_record": statistics.median(build), "eval_ms_per_record": statistics.median(evals)}
            row["total_ms_per_record"] = row["build_ms_per_record"] + row["eval_ms_per_record"]
            row["gb_s"] = stride / row["total_ms_per_record"] / 1e6
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        # the transfer alone
        times = []
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            flat = mx.array(np.frombuffer(b"".join(pool[j % len(pool)] for j in range(P)), dtype=np.uint8))
            mx.eval(flat.astype(mx.uint32).sum())
            if rep:
                times.append((time.perf_counter() - t0) * 1e3 / P)
        row = {"variant": "h2d", "records_per_pass": P, "total_ms_per_record": statistics.median(times),
               "gb_s": stride / statistics.median(times) / 1e6}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    save(out, args.out)


if __name__ == "__main__":
    main()
