"""What a launch costs the host on a GPU backend (issue 37): per op, the Python graph building and
`mx.async_eval`'s dispatch of a 128-op chain of builtin adds, of an `mx.fast.cuda_kernel` and of
strata's precompiled kernel (whole binary, and by key: metal_shaders/module_keys.py); then one
decode window of the tiny 80B-A3B-shaped checkpoint (scripts/bench/step_ops.SHAPE, 8 layers,
4-bit, bfloat16) split into build, dispatch (`async_eval` returning) and the wait for the device;
the size of each strata kernel binary it launched; whether dispatch releases the GIL (a
spinning thread's count while the main thread dispatches, against its count idle); on any
backend, the Python a precompiled launch costs before MLX's own (`call_python_us`: a 5-input
kernel whose binary is held, MLX's launch stood in); and what a small array made on the host
costs the op that reads it (`host_array_us`: 2 int32 values, in MLX's mapped pool, against 8 in
managed pages, each made anew and read by one add, evaluated; on an H100 27.9 against 32.0 µs);
and whether an op whose output reuses a cached buffer the host wrote pays a page fault
(`reused_output_us`, against one a GPU op wrote: the hypothesis for the one 80-240 µs launch of
every window in ncu, docs/benchmarks.md "The H100 loan of 2026-12-06").

    OUT=. python -m scripts.lab.launch_cost                 # CUDA: about a minute, writes $OUT/launch_cost.json
    STRATA_KERNEL_KEYS=0 OUT=. python -m scripts.lab.launch_cost --tag whole    # the same with whole binaries

Off CUDA (the CPU) the kernel chains are skipped and the rest runs, which checks the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import module_keys, precompiled, probe
from scripts.bench import compare_mlx_lm as compare
from scripts.bench.step_ops import SHAPE
from strata_cli.bench.runner import git_commit
from strata_cli.cuda_driver import is_cuda
from strata_cli.engine.window import WindowEngine
from strata_cli.runtime import load_checkpoint

CHAIN = 128
ADD_ONE = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 2048) out[i] = x[i] + 1.0f;"
CALL = dict(output_shapes=[(2048,)], output_dtypes=[mx.float32], grid=(2048, 1, 1), threadgroup=(256, 1, 1))


def per_op(step, repeats: int = 15, warmup: int = 3) -> dict:
    """µs an op of a CHAIN-op chain of `step`: building it, dispatching it, waiting for it (medians)."""
    x0 = mx.ones((2048,), dtype=mx.float32)
    mx.eval(x0)
    rows = []
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        x = x0
        for _ in range(CHAIN):
            x = step(x)
        t1 = time.perf_counter()
        mx.async_eval(x)
        t2 = time.perf_counter()
        mx.eval(x)
        t3 = time.perf_counter()
        if r >= warmup:
            rows.append((t1 - t0, t2 - t1, t3 - t2))
    return {name: round(1e6 * statistics.median(r[i] for r in rows) / CHAIN, 2)
            for i, name in enumerate(("build_us", "dispatch_us", "wait_us"))}


def chains() -> dict:
    steps = {"builtin_add": lambda x: x + 1}
    if is_cuda():
        mlx_kernel = mx.fast.cuda_kernel(name="launch_cost_add", input_names=["x"], output_names=["out"],
                                         source=ADD_ONE)
        ours = precompiled.PrecompiledKernel(mlx_kernel, name="launch_cost_add_pre", input_names=["x"],
                                             output_names=["out"], source=ADD_ONE, header="",
                                             ensure_row_contiguous=True)
        steps["mlx_cuda_kernel"] = lambda x: mlx_kernel(inputs=[x], **CALL)[0]
        steps["precompiled"] = lambda x: ours(inputs=[x], **CALL)[0]
    out = {}
    for name, step in steps.items():
        out[name] = per_op(step)
        print(name, out[name], flush=True)
    return out


def call_python_us(calls: int = 20000, repeats: int = 7) -> dict:
    """µs of Python in one `PrecompiledKernel` call, MLX's launch stood in by a function that
    returns its outputs (medians), beside the stand-in called alone."""
    out = [mx.zeros((1, 256), dtype=mx.bfloat16)]
    inputs = [mx.zeros((4,), dtype=mx.int32), mx.zeros((1, 256), dtype=mx.bfloat16),
              *(mx.zeros((256, n), dtype=d) for n, d in ((32, mx.uint32), (4, mx.bfloat16), (4, mx.bfloat16)))]
    mx.eval(out, inputs)
    kernel = precompiled.PrecompiledKernel(None, name="launch_cost_python", input_names=["dims", "x", "w", "s", "b"],
                                           output_names=["y"], source="y[0] = x[0];", header="",
                                           ensure_row_contiguous=True, make_toolchain=lambda: None)
    call = dict(inputs=inputs, output_shapes=[(1, 256)], output_dtypes=[mx.bfloat16], grid=(256, 1, 1),
                threadgroup=(128, 1, 1), template=[("T", mx.bfloat16), ("ROWS", 1)], init_value=None)
    kernel._binaries[(tuple(x.dtype for x in inputs), (mx.bfloat16,), tuple(call["template"]))] = b"CUBIN" * 8000

    def launch(**_):
        return out

    def per_call(f) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            times.append((time.perf_counter() - t0) / calls)
        return round(1e6 * statistics.median(times), 3)

    saved = (getattr(mx.fast, "precompiled_cuda_kernel", None), module_keys.keys, dict(precompiled._state))
    mx.fast.precompiled_cuda_kernel = launch
    module_keys.keys = module_keys.ModuleKeys()
    module_keys.keys.verified = False  # whole binaries: no key check, nothing written
    precompiled._state.update(off=False, reason=None)
    try:
        result = {"stand_in_us": per_call(lambda: launch(**call)), "precompiled_call_us": per_call(lambda: kernel(**call))}
    finally:
        mx.fast.precompiled_cuda_kernel, module_keys.keys = saved[0], saved[1]
        precompiled._state.clear()
        precompiled._state.update(saved[2])
    print("call_python_us", result, flush=True)
    return result


def host_array_us(n: int = 200, repeats: int = 5) -> dict:
    """µs a step of: make a small int32 array on the host, add 1 on the device, evaluate (medians)."""
    forms = {"pool_2": lambda i: mx.array([i, i]), "mx_array_8": lambda i: mx.array([i] * 8)}
    out = {}
    for name, make in forms.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(n):
                mx.eval(make(i) + 1)
            times.append((time.perf_counter() - t0) / n)
        out[name] = round(1e6 * statistics.median(times), 2)
    print("host_array_us", out, flush=True)
    return out


def window_split(directory: Path, n: int = 50, warmup: int = 10) -> dict:
    """Build / dispatch / wait / commit ms of T = 1 and T = 8 windows (medians)."""
    path = directory / "launch-cost-80b-small-8L-q4"
    if not (path / "config.json").is_file():
        compare.build_checkpoint(path, layers=8, tiny=False, bits=4, seed=0, shape=SHAPE)
    dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    engine = WindowEngine(load_checkpoint(path, dtype=dtype))
    rng = np.random.default_rng(0)
    engine.prefill(rng.integers(0, SHAPE["vocab_size"], 64).tolist())
    real_eval, marks, out = mx.eval, {}, {"dtype": dtype}

    def split_eval(*args):
        marks["built"] = time.perf_counter()
        mx.async_eval(*args)
        marks["dispatched"] = time.perf_counter()
        real_eval(*args)
        marks["done"] = time.perf_counter()

    for T in (1, 8):
        rows = []
        for i in range(warmup + n):
            tokens = rng.integers(0, SHAPE["vocab_size"], T).tolist()
            marks.clear()
            mx.eval = split_eval
            try:
                start = time.perf_counter()
                engine.run(tokens, engine.length)
                ran = time.perf_counter()
            finally:
                mx.eval = real_eval
            engine.commit(T)
            done = time.perf_counter()
            if i >= warmup and marks:  # the CPU's host path may compute a window without mx.eval
                rows.append((marks["built"] - start, marks["dispatched"] - marks["built"],
                             marks["done"] - marks["dispatched"], done - ran, done - start))
        names = ("build_ms", "dispatch_ms", "wait_ms", "commit_ms", "window_ms")
        out[f"T{T}"] = {k: round(1e3 * statistics.median(r[i] for r in rows), 3) for i, k in enumerate(names)} \
            if rows else {"note": "no mx.eval in the window (the CPU's host path)"}
        print(f"T={T}", out[f"T{T}"], flush=True)
    return out


def binary_sizes() -> dict:
    """Bytes of each strata kernel binary this process launched, by kernel."""
    return {name: sorted(len(b) for b in kernel._binaries.values() if b)
            for (name, _), kernel in probe._kernels.items() if isinstance(kernel, precompiled.PrecompiledKernel)}


def gil_during_dispatch() -> dict:
    """A spinning thread's count per second while idle, and while the main thread dispatches."""
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.2)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(0.3)
    idle = (count[0] - c0) / (time.perf_counter() - t0)
    x0 = mx.ones((2048,), dtype=mx.float32)
    mx.eval(x0)
    seconds, spins = 0.0, 0
    for _ in range(20):
        x = x0
        for _ in range(256):
            x = x + 1
        c0, t0 = count[0], time.perf_counter()
        mx.async_eval(x)
        seconds, spins = seconds + time.perf_counter() - t0, spins + count[0] - c0
        mx.eval(x)
    stop[0] = True
    thread.join()
    return {"idle_spins_per_s": round(idle), "spins_per_s_during_dispatch": round(spins / max(seconds, 1e-9)),
            "dispatch_s": round(seconds, 4)}


def reused_output_us(sizes=(32, 4096, 65536, 1 << 20), n: int = 100, repeats: int = 5) -> dict:
    """µs of one evaluated add whose output is `size` bytes, right after an array of that size was
    freed into MLX's buffer cache: made on the host (`host`, managed pages the host wrote) or by
    a GPU op (`device`), alternating, medians. MLX's CUDA allocator hands a cached managed buffer
    to a device op's output; if the GPU must migrate the host's pages to write it, `host` pays a
    page fault that `device` does not (the 80-240 µs launch of every window in ncu)."""
    out = {}
    for size in sizes:
        count = size // 4
        base = mx.zeros((count,), dtype=mx.int32) + 0
        mx.eval(base)
        values = np.arange(count, dtype=np.int32)
        times: dict[str, list[float]] = {"host": [], "device": []}
        for _ in range(repeats):
            sums = {"host": 0.0, "device": 0.0}
            for i in range(n):
                for form in ("host", "device") if i % 2 else ("device", "host"):
                    freed = mx.array(values) if form == "host" else base * 2
                    mx.eval(freed)
                    del freed
                    t0 = time.perf_counter()
                    mx.eval(base + 1)
                    sums[form] += time.perf_counter() - t0
            for form in times:
                times[form].append(sums[form] / n)
        out[str(size)] = {form: round(1e6 * statistics.median(t), 2) for form, t in times.items()}
    print("reused_output_us", out, flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-launch-cost")
    parser.add_argument("--tag", default="launch_cost", help="the output's name: $OUT/<tag>.json")
    args = parser.parse_args(argv)
    report = {"tree": git_commit(), "device": str(mx.default_device()), "mlx": mx.__version__}
    report["call_python_us"] = call_python_us()
    report["host_array_us"] = host_array_us()
    report["reused_output_us"] = reused_output_us()
    report["chains_per_op"] = chains()
    report["window"] = window_split(args.dir)
    report["binary_bytes"] = binary_sizes()
    report["precompiled"] = precompiled.status()
    report["module_keys"] = module_keys.keys.status()
    report["gil"] = gil_during_dispatch()
    print(report["gil"], flush=True)
    path = Path(os.environ.get("OUT", tempfile.gettempdir())) / f"{args.tag}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
