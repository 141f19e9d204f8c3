"""What does the expert cache's own install cost a record: the host building its writes, and the
device running them?

Streaming the 48-layer 80B shape on an H100 (`61b7952`, docs/benchmarks.md) spent 58 ms a token
installing records, about 0.15 ms of host time a record: MLX ops built in Python, 27 tensor views
and 9 writes a record, evaluated at the next routing read-back. A staging slot now keeps the
views of its tensors (made once, the reader rewrites the bytes under them), so an install builds
its writes only. This times `ExpertCache.serve` installing passes of P cold records into one
block (prefetch off, buffered reads, the records read before the clock starts): the host's
install time (the cache's `install_seconds`, waits excluded) and the evaluation of the banks
after it, per record, medians; each round once with the views kept (`kept`) and once building
them lazily for every install (`fresh`, as the cache did before), alternating.
The banks' slots are checked against the records the store reads.

    python -m scripts.lab.install_host --out install_host.json             # 2 layers of the 80B shape
    python -m scripts.lab.install_host --tiny                              # CPU check, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from scripts.bench import stream_80b
from scripts.bench.moce_agreement import _commit
from strata_cli.calibrate import backend_name
from strata_cli.experts.store import ExpertStore
from strata_cli.options import StreamOptions
from strata_cli.runtime import load_checkpoint

VARIANTS = ("kept", "fresh")


def install_pass(model, path: str, experts: list[int], *, fresh: bool) -> tuple[float, float]:
    """Serve `experts` (all cold) as one row's picks at block `path`; (host install s, banks' eval s)."""
    cache = model.expert_cache
    if fresh:  # as every install built them before: lazy views of the slot, cast, given a leading axis
        cache._record_rows = lambda block, staged: {
            name: v[None] for name, v in cache.store.tensor_views(block.layout.path, staged.flat, block.dtypes).items()}
    else:
        cache.__dict__.pop("_record_rows", None)
    cache.begin_window()
    x = mx.zeros((1, model.config.hidden_size), dtype=cache.dtype)
    for _, _, banks in cache.serve(path, x, mx.array([experts], dtype=mx.uint32)):
        start = time.perf_counter()
        mx.eval(list(banks.values()))
        evaluated = time.perf_counter() - start
    return cache.end_window().install_seconds, evaluated


def check(model, root: Path, path: str) -> None:
    """Every resident expert's slot holds the bytes of its record."""
    block = model.expert_cache._blocks[model.expert_cache.paths.index(path)]
    with ExpertStore(root) as store:
        pool = store.pools[store.blocks[path].stride]
        for e in np.nonzero(block.slot_of >= 0)[0].tolist():
            buf = pool.take()
            want = store.to_arrays(path, store.read(path, e, buf), {})
            pool.give(buf)
            for name, bank in block.banks.items():
                got = bank[int(block.slot_of[e])]
                if not mx.array_equal(got.view(mx.uint8), want[name].astype(got.dtype).view(mx.uint8)).item():
                    raise SystemExit(f"expert {e}'s {name} is not its record in slot {block.slot_of[e]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="stream_80b's tiny shapes with 512 experts (CPU)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint (default /tmp/strata-install-host[-tiny])")
    parser.add_argument("--slots", type=int, default=52, help="resident experts per block (default 52: 10%%)")
    parser.add_argument("--passes", type=int, default=9, help="cold records a pass (default 9)")
    parser.add_argument("--rounds", type=int, default=40, help="passes per variant (default 40)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.passes <= args.slots:
        parser.error("--passes must be in 1..--slots")
    name = "tiny" if args.tiny else "full"
    params = {**stream_80b.PRESETS[name], "num_experts": 512, "num_experts_per_tok": 10,
              "num_hidden_layers": args.layers}
    root = args.dir or Path(f"/tmp/strata-install-host{'-tiny' if args.tiny else ''}")
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    stream_80b.ensure_checkpoint(root, params, seed=0, dtype=dtype, rebuild=False, log=print)
    model = load_checkpoint(root, stream=StreamOptions(resident_experts=args.slots, io="buffered", prefetch="off"))
    cache = model.expert_cache
    path = cache.paths[0]
    with ExpertStore(root) as store:  # every record once into the page cache: the timed reads are warm
        pool = store.pools[store.blocks[path].stride]
        buf = pool.take()
        for e in range(params["num_experts"]):
            store.read(path, e, buf)
        pool.give(buf)
    rng = np.random.default_rng(0)
    times = {v: {"host": [], "eval": []} for v in VARIANTS}
    for r in range(args.rounds + 1):
        for v in (VARIANTS if r % 2 else VARIANTS[::-1]):
            cold = np.nonzero(cache.resident_mask(path) == 0)[0]
            experts = rng.choice(cold, args.passes, replace=False).tolist()
            host, evaluated = install_pass(model, path, experts, fresh=v == "fresh")
            if r:  # the first round builds the staging slots and their views
                times[v]["host"].append(host * 1e6 / args.passes)
                times[v]["eval"].append(evaluated * 1e6 / args.passes)
    check(model, root, path)
    report = {"tree": _commit(), "device": backend_name(), "record_bytes": cache._blocks[0].layout.record_bytes,
              "slots": args.slots, "records_per_pass": args.passes, "rounds": args.rounds,
              "us_per_record": {v: {k: statistics.median(t) for k, t in times[v].items()} for v in VARIANTS}}
    print(json.dumps(report["us_per_record"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
