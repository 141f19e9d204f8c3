"""Start-up of `strata generate` as a user's script runs it: time to first token from process
start, on a fresh machine (empty caches) with and without the kernel workers, and on a machine
that has run strata before, serial and `auto`, and where the time goes.

Every timed run is its own `strata generate --json` process, its clock started just before the
process; time to first token is the `first_token_unix_s` its stats report minus that start. A
"cold" run gets an empty cache directory (XDG_CACHE_HOME: strata's kernel cache, which
MLX_PTX_CACHE_DIR points at, and the cost curve). In order: a fresh machine with the kernel
workers (strata_cli/kernel_warm.py, strata's default); "later" runs, serial and `auto`, reusing
the directory it filled; the same later process phase by phase (scripts/bench/startup_phases.py:
imports, opening the model, kernel probes and what was read back, calibration, prompt, the first
window's shape warm-up and mx.compile traces, the first window); then a fresh machine without
the kernel workers (STRATA_PARALLEL_WARM=0, a directory of its own; the others leave the default). Steady tok/s, the median
and the largest window after the first come from the same stats. Then, each in its own process
and as the budget allows, every window shape warmed at load (`--warm-shapes`) per row count,
padded and not, with the kernel cache cold and warm; and the number of kernel modules MLX kept.

    python -m scripts.bench.startup --out h200_startup.json      # the H200 run (builds the checkpoint)
    python -m scripts.bench.startup --tiny --out /tmp/s.json      # a CPU check of the script, < 1 min

Writes JSON as it goes (a phase that does not fit `--budget-seconds` is skipped and named).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import gpu_memory

ROOT = Path(__file__).resolve().parents[2]
PROMPT_FILE = ROOT / "examples" / "prompts" / "prose.txt"
MODES = {"serial": "0", "auto": "auto"}


def checkpoint(args) -> Path:
    """`--model`, or the 8-layer 80B-A3B-shaped 4-bit checkpoint (`compare_mlx_lm.build_checkpoint`),
    with the demo model's tokenizer (random weights: any tokenizer will do)."""
    if args.model:
        return Path(args.model)
    from scripts.bench.compare_mlx_lm import build_checkpoint
    from strata_cli.runtime import embedded_model_path

    path = args.dir / ("tiny" if args.tiny else f"q4-{args.layers}L")
    if not (path / "config.json").is_file():
        print(f"building {path} with mlx-lm", flush=True)
        start = time.perf_counter()
        # the tiny shape takes the demo tokenizer's vocabulary, so the prompt's ids fit
        build_checkpoint(path, layers=args.layers, tiny=args.tiny, bits=4, seed=0,
                         shape={"vocab_size": 4096} if args.tiny else None)
        print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            shutil.copy(embedded_model_path() / name, path / name)
    return path


def clean_env(cache: Path) -> dict:
    """The environment of a timed process: its own cache directories and no strata or MLX cache
    setting from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "MLX_PTX_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(cache)
    # the CUDA driver's compute cache (PTX JIT-compiled to the GPU's code) goes with the rest: a
    # fresh machine's has nothing in it
    env["CUDA_CACHE_PATH"] = str(cache / "nv-compute")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def generate_run(model: Path, mode: str, cache: Path, args, extra: list[str] = (), parallel: bool = True) -> dict:
    """One `strata generate --json` process: time to first token from process start and its stats.
    `parallel` False turns the kernel workers of a fresh GPU machine off (STRATA_PARALLEL_WARM=0)."""
    cmd = [sys.executable, "-m", "strata_cli.cli", "generate", "-", "--json", "--model", str(model),
           "--max-tokens", str(args.tokens), "--suffix-draft", MODES[mode], *extra]
    if args.max_context:
        cmd += ["--max-context", str(args.max_context)]
    env = clean_env(cache) | ({} if parallel else {"STRATA_PARALLEL_WARM": "0"})  # parallel: the default
    started = time.time()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    memory = gpu_memory.Watch(proc.pid).start()  # the process and its kernel workers
    try:
        stdout, stderr = proc.communicate(args.prompt, timeout=args.process_timeout)
    except subprocess.TimeoutExpired as e:
        # A fresh machine's first process can outlast the timeout: record it, keep what it compiled.
        proc.kill()
        proc.wait()  # not communicate(): a worker still holding a pipe would keep it open (as subprocess.run)
        tail = (e.stderr or b"")[-2000:]
        return {"mode": mode, "timed_out": True, "process_s": time.time() - started, "gpu_memory": memory.stop(),
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail, "token_ids": []}
    wall = time.time() - started
    gpu = memory.stop()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {stderr[-2000:]}")
    record = json.loads(stdout.splitlines()[-1])
    stats = record["stats"]
    return {
        "mode": mode,
        "ttft_s": stats["first_token_unix_s"] - started,
        "process_s": wall,
        "load_warmup_s": stats["warmup_seconds"],
        "shape_warmup_in_request_s": stats["shape_warmup_seconds"],
        "calibration_s": stats["calibration_seconds"],
        "prefill_s": stats["prefill_tokens"] / stats["prefill_tokens_per_s"] if stats["prefill_tokens_per_s"] else 0.0,
        "first_window_ms": stats["warmup_window_ms"],
        "steady_tokens_per_s": stats["steady_tokens_per_s"],
        "median_window_ms": stats["window_ms_median"],
        "max_window_ms_after_first_token": stats["window_ms_max"],
        "generated_tokens": stats["generated_tokens"],
        "drafts_offered": stats["drafts_offered"],
        "windows_by_T": stats["window_T_histogram"],
        "announced_compile": "compiling GPU kernels" in stderr,
        "kernel_workers": kernel_workers(stderr),
        # GPU memory the workers held against what kernel_warm counts each at (None without nvidia-smi)
        "worker_estimate_gb": worker_estimate_gb(stderr),
        "gpu_memory": gpu,
        # the prompt path's workers still compiling at the first token: the exit waited for them
        "exit_waited_for_workers": "waiting for the kernel workers" in stderr,
        "worker_warnings": [line for line in stderr.splitlines() if "warning: kernel worker" in line],
        "token_ids": record["token_ids"],
    }


def kernel_workers(stderr: str) -> int:
    """The kernel workers a process launched (its "once: K workers" line), 0 when none."""
    found = re.search(r"once: (\d+) workers", stderr)
    return int(found.group(1)) if found else 0


def worker_estimate_gb(stderr: str) -> float | None:
    """What kernel_warm counted each worker at (its "of up to X GB each" line), None without workers."""
    found = re.search(r"workers of up to ([\d.]+) GB each", stderr)
    return float(found.group(1)) if found else None


def memory_note(run: dict) -> str:
    """The GPU memory a run's processes held, for its log line ("" without nvidia-smi)."""
    gpu = run.get("gpu_memory")
    if not gpu:
        return ""
    workers = (f", {len(gpu['worker_peaks_mib'])} workers up to {gpu['worker_peak_mib']} MiB"
               + (f" (counted at {run['worker_estimate_gb']} GB)" if run.get("worker_estimate_gb") else "")
               if gpu["worker_peaks_mib"] else "")
    return f"; GPU memory: the process {gpu['parent_peak_mib']} MiB{workers}, together {gpu['total_peak_mib']} MiB"


def phases_run(model: Path, mode: str, cache: Path, args) -> dict:
    """One process of scripts/bench/startup_phases.py: a later process's time to first token, phase by phase."""
    cmd = [sys.executable, "-m", "scripts.bench.startup_phases", str(model), "--mode", mode]
    if args.max_context:
        cmd += ["--max-context", str(args.max_context)]
    launched = time.time()
    try:
        proc = subprocess.run(cmd + ["--launched", repr(launched)], input=args.prompt, capture_output=True, text=True,
                              env=clean_env(cache), timeout=args.process_timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "timed_out": True}
    if proc.returncode:
        raise RuntimeError(f"phase probe exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


SHAPES_PROBE = """
import json, sys, time
start = time.perf_counter()
from strata_cli.kernel_cache import prepare_kernel_cache
from strata_cli.options import EngineOptions, LoadOptions
from strata_cli.runtime import open_model
import mlx.core as mx
from metal_shaders import attention_window, gdn_window, precompiled, probe, rows_matvec
prepare_kernel_cache()  # before any compile: MLX fixes its cache directory at the first
probes = {}
for name, usable in (("rows_matvec", rows_matvec.kernels_usable), ("gdn_window", gdn_window.usable),
                     ("attention_window", attention_window.usable)):
    t = time.perf_counter(); usable(); probes[name] = time.perf_counter() - t
same = None  # strata's compile against MLX's of the same kernel, bit for bit (CUDA only)
if probe.backend() == "cuda" and precompiled.active():
    x = mx.random.normal((3, 512), key=mx.random.key(1)).astype(mx.bfloat16)
    w = mx.random.normal((200, 512), key=mx.random.key(2)).astype(mx.bfloat16)
    qw, qs, qb = mx.quantize(w, 64, 4)
    ours = [rows_matvec.rows_matvec(x, w), rows_matvec.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4)]
    mx.eval(ours)
    precompiled._state["off"] = True
    theirs = [rows_matvec.rows_matvec(x, w), rows_matvec.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4)]
    mx.eval(theirs)
    precompiled._state["off"] = False
    same = all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))
rt = open_model(LoadOptions(model=sys.argv[1]), EngineOptions(warm_shapes=True, pad_windows=sys.argv[2] == "1",
                max_context=int(sys.argv[3]) or None))
first = time.perf_counter() - start
t = time.perf_counter(); again = rt.engine.warm_up(8); rewarm = time.perf_counter() - t
print(json.dumps({"process_to_ready_s": first, "kernel_probes_s": probes, "warmup_s": rt.warmup_seconds,
                  "warmup_by_rows_s": {str(k): v for k, v in rt.warmup_by_rows.items()},
                  "second_warm_up_s": rewarm, "kernel_cache": rt.kernel_cache.as_dict(),
                  "kernels": {"rows": rows_matvec.status(), "gdn": gdn_window.status(),
                              "attention": attention_window.status()},
                  "precompiled": precompiled.status(), "precompiled_same_as_mlx": same,
                  "verdicts_kept_hits": {"rows": rows_matvec._probe.kept_hits, "gdn": gdn_window._probe.kept_hits,
                                         "attention": attention_window._probe.kept_hits}}))
"""


def shapes_probe(model: Path, cache: Path, pad: bool, args) -> dict:
    """One process: load, warm every window shape at load (per row count), then warm them again
    (what is left once the process has built them: the runs themselves)."""
    try:
        proc = subprocess.run([sys.executable, "-c", SHAPES_PROBE, str(model), "1" if pad else "0",
                               str(args.max_context or 0)], capture_output=True, text=True, env=clean_env(cache),
                              timeout=args.process_timeout)
    except subprocess.TimeoutExpired:
        return {"padded": pad, "timed_out": True}
    if proc.returncode:
        raise RuntimeError(f"shape probe exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"padded": pad, **json.loads(proc.stdout.splitlines()[-1])}


def kept_modules(cache: Path) -> int:
    """Kernel modules MLX compiled and kept under `cache` (strata's kernel directory)."""
    root = cache / "strata" / "kernels"
    return sum(1 for p in root.rglob("*.ptx") if not any(part.startswith(".") for part in p.relative_to(root).parts))


def kept_by_strata(cache: Path) -> dict:
    """strata's own compiled kernels and kept probe verdicts under `cache` (metal_shaders/kept.py)."""
    root = cache / "strata" / "kernels"
    return {"cubins": sum(1 for _ in root.rglob("cubins/*.bin")), "verdicts": sum(1 for _ in root.rglob("verdicts/*.json"))}


def git_tree() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(runs: list[dict], mode: str) -> dict:
    """A mode's figures: its first run on a fresh machine (the one whose cache the later runs
    read: with the kernel workers unless `--fresh serial`), its later runs' median, and the
    steady figures of both."""
    done = [r for r in runs if not r.get("timed_out")]
    cold = [r for r in done if r["mode"] == mode and r["phase"] == "cold" and r["shared_cache"]]
    later = [r for r in done if r["mode"] == mode and r["phase"] == "later"]
    steady = [r for r in cold + later]
    timed_out = [r for r in runs if r.get("timed_out") and r["mode"] == mode and r["phase"] == "cold"
                 and r["shared_cache"]]
    out = {"first_run_ttft_s": cold[0]["ttft_s"] if cold else None,
           "first_run_timed_out_after_s": timed_out[0]["process_s"] if timed_out else None,
           "later_run_ttft_s": statistics.median(r["ttft_s"] for r in later) if later else None}
    if later:  # the processes that found the cache filled: what auto_over_serial_later compares
        out["later_steady_tokens_per_s"] = statistics.median(r["steady_tokens_per_s"] for r in later)
    if steady:
        out["steady_tokens_per_s"] = statistics.median(r["steady_tokens_per_s"] for r in steady)
        out["max_window_ms_after_first_token"] = max(r["max_window_ms_after_first_token"] for r in steady)
        out["median_window_ms"] = statistics.median(r["median_window_ms"] for r in steady)
        out["max_over_median"] = out["max_window_ms_after_first_token"] / out["median_window_ms"]
    return out


def agreement(ids: list[tuple[str, list[int]]]) -> dict:
    """Whether the processes gave the same tokens. `identical`: the later processes of every mode
    (they run the prompt alike). `fresh_same_as_later`: the fresh machine's too, which may differ
    by rounding alone: while the kernel workers compile the prompt path, a fresh process runs its
    prompt in window-sized chunks on the window kernels (kernel_warm.py), and the window contract
    leaves prompt chunking open. None where there is nothing to compare."""
    later = {tuple(t) for phase, t in ids if phase == "later"}
    fresh = {tuple(t) for phase, t in ids if phase == "cold"}
    return {"identical": len(later) <= 1 if later else len(fresh) <= 1,
            "fresh_same_as_later": fresh <= later if fresh and len(later) == 1 else None}


def fresh_machine(runs: list[dict]) -> dict:
    """A fresh machine's first token with and without the kernel workers (target <= 90 s)."""
    out = {}
    for r in runs:
        if r["phase"] == "cold":
            out["with_kernel_workers" if r["parallel_warm"] else "without_kernel_workers"] = {
                "ttft_s": r.get("ttft_s"), "timed_out_after_s": r["process_s"] if r.get("timed_out") else None,
                "kernel_workers": r.get("kernel_workers"), "load_warmup_s": r.get("load_warmup_s"),
                "prefill_s": r.get("prefill_s"), "kept_modules_after": r["kept_modules_after"],
                "process_s": r["process_s"], "exit_waited_for_workers": r.get("exit_waited_for_workers"),
                "worker_estimate_gb": r.get("worker_estimate_gb"), "gpu_memory": r.get("gpu_memory")}
    return out


def run(args) -> dict:
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="strata-startup-"))
    model = checkpoint(args)
    result = {"tree": git_tree(), "model": str(model) if args.model else f"q4-{args.layers}L 80B-A3B shape"
              + (" (tiny)" if args.tiny else ""), "machine": platform.node(), "tokens": args.tokens,
              "python": sys.executable, "runs": [], "skipped": []}
    import mlx.core as mx

    result["device"], result["mlx"] = str(mx.default_device()), mx.__version__

    def save():
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    def fits(what: str) -> bool:
        if time.perf_counter() - started < args.budget_seconds:
            return True
        result["skipped"].append(what)
        print(f"skipped (budget): {what}", flush=True)
        return False

    # One cache directory, as on a user's machine: the first process finds it empty, later ones
    # (either mode) find what earlier processes kept.
    shared = work / "cache"
    caches = {mode: shared for mode in MODES}
    if args.seed_kernels:  # a machine whose kernel cache already holds these (MLX's own) kernels
        from strata_cli.calibrate import backend_name
        from strata_cli.kernel_cache import default_kernel_dir

        target = default_kernel_dir(backend_name(), shared / "strata")
        shutil.copytree(args.seed_kernels, target)
        result["seeded_kernels"] = sum(1 for _ in target.rglob("*.ptx"))
    # A fresh machine with the kernel workers (strata's default) fills the shared directory the
    # later processes read; the fresh machine without them gets an empty directory of its own, last.
    fresh = {"parallel", "serial"} if args.fresh == "both" else {args.fresh}
    plan = [("cold", "serial", "parallel" in fresh, shared)]
    plan += [("later", mode, True, shared) for _ in range(args.later_runs) for mode in MODES]
    plan += [("phases", mode, True, shared) for mode in MODES]
    if fresh == {"parallel", "serial"}:
        plan.append(("cold", "serial", False, work / "cache-no-workers"))
    for phase, mode, parallel, cache in plan:
        label = f"{phase} {mode}" + ("" if phase != "cold" else " with kernel workers" if parallel else " without kernel workers")
        if not fits(label):
            continue
        if phase == "phases":
            p = phases_run(model, mode, cache, args)
            result.setdefault("later_phases", {})[mode] = p
            if not p.get("timed_out"):
                top = sorted(p["phases_s"].items(), key=lambda kv: -kv[1])[:4]
                print(f"phases {mode:6}: first token {p['ttft_s']:.1f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in top)
                      + f"; mx.compile traces {p['compile_traces']['count']} ({p['compile_traces']['seconds']:.1f} s)",
                      flush=True)
            save()
            continue
        r = generate_run(model, mode, cache, args, parallel=parallel)
        r["phase"], r["parallel_warm"], r["shared_cache"] = phase, parallel, cache == shared
        r["kept_modules_after"] = kept_modules(cache)
        r["kept_by_strata_after"] = kept_by_strata(cache)
        if r.get("timed_out"):
            result["runs"].append({k: v for k, v in r.items() if k != "token_ids"})
            print(f"{label}: no first token within {args.process_timeout:.0f} s "
                  f"({r['kept_modules_after']} kernel modules kept)", flush=True)
            save()
            continue
        result["runs"].append({k: v for k, v in r.items() if k != "token_ids"} | {"tokens_head": r["token_ids"][:8]})
        result.setdefault("token_ids", []).append((phase, r["token_ids"]))
        print(f"{label}: first token {r['ttft_s']:.1f} s (process {r['process_s']:.1f} s, "
              f"{r['kernel_workers']} kernel workers, load warm-up {r['load_warmup_s']:.1f} s), "
              f"{r['steady_tokens_per_s']:.1f} tok/s, window median {r['median_window_ms']:.2f} ms, "
              f"max {r['max_window_ms_after_first_token']:.2f} ms, drafts offered {r['drafts_offered']}"
              + memory_note(r), flush=True)
        save()
    result["fresh_machine"] = fresh_machine(result["runs"])
    result.update(agreement(result.pop("token_ids", [])))
    for mode in MODES:
        result[mode] = summarize(result["runs"], mode)
    if result["serial"].get("steady_tokens_per_s") and result["auto"].get("steady_tokens_per_s"):
        result["auto_over_serial_steady"] = result["auto"]["steady_tokens_per_s"] / result["serial"]["steady_tokens_per_s"]
    if result["serial"].get("later_steady_tokens_per_s") and result["auto"].get("later_steady_tokens_per_s"):
        result["auto_over_serial_later"] = (result["auto"]["later_steady_tokens_per_s"]
                                            / result["serial"]["later_steady_tokens_per_s"])  # like with like
    save()

    # Where the time goes: every shape warmed at load, per row count, cold and warm kernel cache.
    probes = [("warm cache, padded", caches["serial"], True), ("cold cache, padded", work / "cache-probe", True),
              ("warm cache, unpadded", caches["serial"], False)]
    result["shapes"] = []
    for label, cache, pad in probes:
        if not fits(f"shape probe: {label}"):
            continue
        probe = {"label": label, **shapes_probe(model, cache, pad, args)}
        result["shapes"].append(probe)
        if probe.get("timed_out"):
            print(f"shapes ({label}): not ready within {args.process_timeout:.0f} s", flush=True)
            save()
            continue
        rows = ", ".join(f"{k}: {v:.2f}" for k, v in probe["warmup_by_rows_s"].items())
        kernels = ", ".join(f"{k} {v:.1f}" for k, v in probe["kernel_probes_s"].items())
        pre = probe["precompiled"]
        print(f"shapes ({label}): strata's compile {'on' if pre['active'] else 'off (' + str(pre['reason']) + ')'}, "
              f"{pre['compiled']} compiled, {pre['from_disk']} read back, {pre['mlx_calls']} calls on MLX's build, "
              f"same as MLX's: {probe['precompiled_same_as_mlx']}, errors {pre['errors'][:2]}", flush=True)
        print(f"shapes ({label}): kernel probes (s) {kernels}; ready in {probe['process_to_ready_s']:.1f} s, "
              f"warm-up {probe['warmup_s']:.1f} s "
              f"by rows (s) {rows}; again {probe['second_warm_up_s']:.2f} s", flush=True)
        save()
    result["kept_modules"] = {"serial": kept_modules(caches["serial"]), "auto": kept_modules(caches["auto"])}
    result["kept_by_strata"] = kept_by_strata(caches["serial"])
    result["seconds"] = time.perf_counter() - started
    save()
    shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: build the 80B-A3B shape)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few tokens: a CPU check of the script")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--later-runs", type=int, default=1, help="later processes per mode (median)")
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--budget-seconds", type=float, default=300.0,
                        help="start no phase after this many seconds (the checkpoint build included)")
    parser.add_argument("--process-timeout", type=float, default=300.0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-compare",
                        help="where a built checkpoint is kept (compare_mlx_lm's default: shared with it)")
    parser.add_argument("--seed-kernels", type=Path, default=None,
                        help="copy this directory's compiled kernels into the cache before the first process "
                             "(its run is then not a fresh machine's)")
    parser.add_argument("--fresh", choices=("both", "parallel", "serial"), default="both",
                        help="fresh-machine runs: with the kernel workers (then the later runs), without them "
                             "(last, its own empty cache), or both")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.tokens, args.later_runs = 2, 12, 1
        args.max_context = args.max_context or 256
    args.prompt = PROMPT_FILE.read_text()
    result = run(args)
    print(json.dumps({k: result[k] for k in ("tree", "model", "serial", "auto")}, indent=1))
    if args.out:
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
