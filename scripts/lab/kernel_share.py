"""Each strata kernel's device time inside a real decode window, by launching it twice (issue 37
and 34: where a T = 8 window's extra time goes, kernel by kernel, without a kernel profiler).

`step_profile` splits a window into host build and device evaluation, and times each kind of
layer part apart (each with a sync of its own); `kernel_bench` times each kernel alone, on its
own inputs. Neither says what a kernel costs where it runs, between its neighbours. Here every
kernel the window launched (metal_shaders/probe.py keeps them by name) is in turn made to run
twice on the same inputs, the window's output depending on both launches (`mx.depends`), and
the window's median time against the plain window's, measured next to it, is that kernel's
share of the window: T = 1 and T = 8 on the same checkpoint, compiled layers as a decode runs
them (the layers' traces are dropped at each switch, so they trace the doubled kernel).

Where the window waits on the host (T = 1 on the H200 is host-bound) a second launch can hide
in the slack, so the shares say most at T = 8; a second launch may also find its weights in L2
(50 MB on an H200): a share of a kernel that reads less than that is a lower bound.

    python -m scripts.lab.kernel_share --out kernel_share.json     # GPU: the 8-layer 80B-A3B shape
    python -m scripts.lab.kernel_share --tiny                      # CPU: the script's own check (no kernels run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from metal_shaders import probe
from scripts.bench.step_profile import Windows, checkpoint_80b, plain_window_ms
from strata_cli.bench.runner import git_commit
from strata_cli.model.compiled import Compiled
from strata_cli.runtime import load_checkpoint


class Twice:
    """A kernel that launches twice on the same arguments; the second launch's outputs depend on
    the first's, so neither is left out of the graph."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args, **kwargs):
        first = self.kernel(*args, **kwargs)
        second = self.kernel(*args, **kwargs)
        return mx.depends(list(second), list(first))

    def __getattr__(self, name):  # the precompiled kernel's own attributes (its name, its build)
        return getattr(self.kernel, name)


def drop_traces(model) -> int:
    """Make every layer trace its compiled parts again at its next call (`Compiled` retraces when
    it holds nothing); returns how many were dropped."""
    dropped = 0
    for _, module in model.named_modules():
        for value in vars(module).values():
            if isinstance(value, Compiled):
                value.held = value.compiled = None
                dropped += 1
    return dropped


def shares(w: Windows, model, windows: list[int], *, repeats: int, rounds: int, warmup: int) -> dict:
    """Per kernel name and T: the doubled window's median ms less the plain window's, each round's
    plain window measured right before it; medians over rounds."""
    for T in windows:  # every kernel the windows use is made (and probed) before the names are read
        plain_window_ms(w, T, 2, 1)
    names = sorted(name for name, _ in probe._kernels)
    plain: dict[int, list[float]] = {T: [] for T in windows}
    extra: dict[str, dict[int, list[float]]] = {name: {T: [] for T in windows} for name in names}
    for rnd in range(rounds):
        for name in names or [None]:  # no kernel (off a GPU): the plain windows alone
            for T in windows:
                drop_traces(model)
                plain[T].append(plain_window_ms(w, T, repeats, warmup))
                if name is None:
                    continue
                originals = {key: kernel for key, kernel in probe._kernels.items() if key[0] == name}
                probe._kernels.update({key: Twice(kernel) for key, kernel in originals.items()})
                drop_traces(model)
                try:
                    extra[name][T].append(plain_window_ms(w, T, repeats, warmup) - plain[T][-1])
                finally:
                    probe._kernels.update(originals)
        print(f"round {rnd + 1} of {rounds}: " + ", ".join(
            f"T={T} {statistics.median(plain[T]):.2f} ms" for T in windows), flush=True)
    out = {"window_ms": {str(T): statistics.median(v) for T, v in plain.items()}, "kernels": {}}
    for name in names:
        out["kernels"][name] = {str(T): statistics.median(v) for T, v in extra[name].items()}
    for T in windows:
        out.setdefault("sum_ms", {})[str(T)] = sum(k[str(T)] for k in out["kernels"].values())
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the 80B-A3B pattern with small dims: the CPU check")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint (default: build the 80B-A3B shape)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--windows", default="1,8", help="row counts T")
    parser.add_argument("--context", type=int, default=None, help="prefilled tokens (default 512; 64 with --tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows a measurement (default 20; 3 tiny)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-step-profile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    path = args.model or checkpoint_80b(args.dir, layers=args.layers, tiny=args.tiny)  # step_profile's
    on_cpu = mx.default_device() == mx.cpu
    dtype = "float32" if on_cpu else "bfloat16"
    model = load_checkpoint(path, dtype=dtype)
    w = Windows(model, args.context or (64 if args.tiny else 512), args.seed)
    windows = [int(t) for t in args.windows.split(",")]
    start = time.perf_counter()
    found = shares(w, model, windows, repeats=args.repeats or (3 if args.tiny else 20), rounds=args.rounds,
                   warmup=args.warmup)
    report = {"commit": git_commit(), "device": str(mx.default_device()), "mlx": mx.__version__, "model": str(path),
              "dtype": dtype, "windows": windows, "rounds": args.rounds, **found,
              "seconds": round(time.perf_counter() - start, 1)}
    if not found["kernels"]:
        print("no strata kernel ran in these windows (off a GPU the references run): window times only", flush=True)
    for name, by_T in sorted(found["kernels"].items(), key=lambda kv: -kv[1][str(windows[-1])]):
        print(f"{name:44s} " + "  ".join(f"T={T} {by_T[str(T)]:+.3f} ms" for T in windows), flush=True)
    print("window " + "  ".join(f"T={T} {found['window_ms'][str(T)]:.2f} ms (kernels' sum "
                                f"{found['sum_ms'][str(T)]:+.2f})" for T in windows), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
