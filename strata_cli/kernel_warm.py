"""A fresh GPU machine's kernels, compiled in parallel once: the plan, and the parent's side.

MLX's CUDA backend builds each of its own modules (quantized matmul tiles, gathers, the fused
kernels of `mx.compile`) through NVRTC one at a time inside a process, so a fresh machine's first
process waits minutes before its first token (docs/benchmarks.md, "Start-up on the H200"). Every
module lands in `MLX_PTX_CACHE_DIR` (kernel_cache.py) and later processes read it back, so
separate processes can build different modules at the same time.

When `open_model` finds that this model has not been warmed for this MLX version and GPU (no
marker in strata's kernel directory), it splits the warm-up into disjoint *units* (`plan_units`:
one layer of each kind, and the head, at each window shape the engine warms and at the prompt
sizes), launches worker processes (`python -m strata_cli.kernel_warm_worker`) that each load
only the layers their units need and run them on scratch state, waits for them, then goes on.

The parent waits only for what a first token needs: the units of every window shape and of
window-sized prompt chunks (`Unit.first`). Until the rest (the prompt path's quantized-matmul
tiles, 22-44 s of NVRTC each on the H200) is compiled by the workers left running in the
background, the engine runs prompts in window-sized chunks (`WindowEngine.cap_prompt_chunks`),
so no window and no prompt of this process waits on those compiles; the process waits for
the background workers before it exits, so their modules are kept.

Each worker compiles into a private directory, seeded with hard links to what is kept already;
the parent moves a worker's new modules into the kept directory only after that worker exited
0, each file renamed into place and the `.ptx` last, because MLX writes its files in place and
reads a `.ptx` as complete (a worker killed mid-write must never leave half a module).
A worker's failure or the timeout is a warning: the parent compiles what is left itself, as
before. CUDA only. On by default (a fresh H200's first token: 53 s with 15 workers, 243 s
without): one core left to the parent, and only as many workers as half the free GPU memory and
half the available host memory hold, each counted at the weights of every piece it might load
plus WORKER_OVERHEAD_BYTES (`worker_count`); where memory rules them all out, one line says so.
`STRATA_PARALLEL_WARM=0` turns it off, `=N` launches N whatever the memory.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from metal_shaders import kept
from metal_shaders.precompiled import available_cores

from . import cuda_driver

ENV = "STRATA_PARALLEL_WARM"  # unset or "auto": cores - 1 that fit in memory; "0": off; a number: that many
# A worker's own use beside the weights it loads (its CUDA context, MLX's buffers, the
# interpreter): an estimate, until the GPU has measured it.
WORKER_OVERHEAD_BYTES = 1 << 30
MEMORY_SHARE = 0.5  # of the free GPU memory and the available host memory the workers take together
TIMEOUT_ENV = "STRATA_PARALLEL_WARM_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
MARKERS = "warmed"
WORKER_MODULE = "strata_cli.kernel_warm_worker"
# MLX 0.32 builds a quantized matmul per row tile, clamp(next power of 2 of the rows, 16, 64)
# (make_cta_tiler in mlx/backend/cuda/quantized/qmm/), so prompts of up to 16, up to 32 and
# more rows each need their own modules; 256 stands for a typical prompt besides the full chunk.
PROMPT_ROWS = (16, 32, 256)
HEAD = "head"
LAYER = "layer"


@dataclass(frozen=True, order=True)
class Unit:
    """One piece of the warm-up a worker runs on scratch state.

    Attributes:
        piece: "layer" (one decoder layer, `layer`) or "head" (embedding, final norm, logits).
        layer: the index of the layer that stands for its kind (piece "layer"), else -1.
        rows: the rows of the call.
        prompt: a prompt chunk (`WindowEngine.prefill`) rather than a window (`WindowEngine.warm`).
    """

    piece: str
    layer: int
    rows: int
    prompt: bool

    @property
    def first(self) -> bool:
        """Whether a first token needs it: a window, or a prompt chunk no larger than one (the
        prompt's chunks while the background workers compile the rest)."""
        return not self.prompt or self.rows <= first_prompt_rows()

    @property
    def name(self) -> str:
        where = f"layer{self.layer}" if self.piece == LAYER else self.piece
        return f"{where}:{'prompt' if self.prompt else 'window'}{self.rows}"


def splits_by_layer(model) -> bool:
    """Whether `model`'s forward pass is embed, run_layers, head (the pipeline's contract), so
    one layer can run alone."""
    return all(callable(getattr(model, name, None)) for name in ("embed", "run_layers", "head"))


def layer_signature(model, index: int) -> str:
    """What decides a layer's kernels: its class, its state kinds and every parameter's name,
    shape and dtype (two layers alike in these build the same modules)."""
    from mlx.utils import tree_flatten

    layer = model.layers[index]
    params = [(name, tuple(v.shape), str(v.dtype)) for name, v in tree_flatten(layer.parameters())]
    kinds = model.state_kinds[model.state_span(index, index + 1)]
    return kept.digest({"class": type(layer).__name__, "states": kinds, "params": params})


def layer_kinds(model) -> dict[int, list[int]]:
    """The first layer of each kind -> every layer of that kind, in layer order."""
    first: dict[str, int] = {}
    kinds: dict[int, list[int]] = {}
    for i in range(len(model.layers)):
        rep = first.setdefault(layer_signature(model, i), i)
        kinds.setdefault(rep, []).append(i)
    return kinds


def first_prompt_rows() -> int:
    """A prompt chunk's rows while the background workers compile: the largest window bucket,
    whose kernels the windows need anyway."""
    from .engine.window import WINDOW_BUCKETS

    return max(WINDOW_BUCKETS)


def prompt_shapes(engine, chunk: int | None = None) -> list[int]:
    """The prompt rows warmed: PROMPT_ROWS, a window-sized chunk and the engine's prefill chunk,
    within its context."""
    from .engine.window import default_prefill_chunk

    chunk = chunk or default_prefill_chunk()
    return sorted({engine.prompt_rows(min(r, chunk)) for r in (first_prompt_rows(), *PROMPT_ROWS, chunk)})


def plan_units(model, engine, *, max_T: int, chunk: int | None = None) -> list[Unit]:
    """Every unit of the warm-up, each (piece, rows, prompt) once: per layer kind and the head,
    every prompt shape and every window shape of T = 1..max_T. None for a family whose forward
    pass is not embed, layers, head (DeepSeek-V4): a worker would need the whole model."""
    if not splits_by_layer(model):
        return []  # each worker would hold the whole model: no parallel warm-up
    shapes = [(rows, True) for rows in prompt_shapes(engine, chunk)]
    shapes += [(rows, False) for rows in engine.window_shapes(max_T)]
    pieces = [(LAYER, i) for i in layer_kinds(model)] + [(HEAD, -1)]
    return [Unit(piece, layer, rows, prompt) for piece, layer in pieces for rows, prompt in shapes]


def assign(units: list[Unit], workers: int) -> list[list[Unit]]:
    """`units` split into `workers` contiguous groups of near-equal size, in plan order (a
    piece's shapes stay together, so a worker loads few layers and builds a shared module once)."""
    workers = max(1, min(workers, len(units)))
    size, extra = divmod(len(units), workers)
    groups, start = [], 0
    for w in range(workers):
        stop = start + size + (w < extra)
        groups.append(units[start:stop])
        start = stop
    return groups


def worker_count(num_units: int, env: str | None = None, *, per_worker: int = 0,
                 free: tuple[int | None, ...] = ()) -> int:
    """Workers to launch, by `STRATA_PARALLEL_WARM`: a number, that many (at most one a unit);
    "auto" or unset (the default), one core left to the parent (min(cores - 1, units)) and no
    more than MEMORY_SHARE of each memory in `free` (bytes: the GPU's free memory, the host's
    available memory) holds at `per_worker` bytes each; anything else, none. A memory the
    machine cannot tell (None) keeps the default off, where "auto" goes by the cores."""
    env = setting(env)
    if env.isdigit():
        return min(int(env), num_units)
    if turned_off(env):
        return 0
    workers = max(0, min(available_cores() - 1, num_units))
    for known in free:
        if known is None:
            if not env:
                return 0  # not filled blind
            continue
        workers = min(workers, int(known * MEMORY_SHARE) // max(per_worker, 1))
    return workers


def setting(env: str | None = None) -> str:
    """`STRATA_PARALLEL_WARM` as given (`env`, else the environment), stripped."""
    return (os.environ.get(ENV, "") if env is None else env).strip()


def turned_off(env: str | None = None) -> bool:
    """Whether `STRATA_PARALLEL_WARM` rules workers out whatever the machine ("0", or a word
    other than "auto")."""
    env = setting(env)
    return env == "0" if env.isdigit() else env not in ("", "auto")


def worker_bytes(model, units: list[Unit]) -> int:
    """What one worker may hold: the weights of every piece `units` name (each worker loads only
    its own: an upper bound) and WORKER_OVERHEAD_BYTES."""
    from mlx.utils import tree_flatten

    def nbytes(tree) -> int:
        return sum(v.nbytes for _, v in tree_flatten(tree))

    layers = {u.layer for u in units if u.piece == LAYER}
    total = sum(nbytes(model.layers[i].parameters()) for i in layers)
    if any(u.piece == HEAD for u in units):  # the embedding, final norm and logits: all but the layers
        total += nbytes(model.parameters()) - sum(nbytes(layer.parameters()) for layer in model.layers)
    return total + WORKER_OVERHEAD_BYTES


def host_available() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def signature(path: Path, dtype: str, units: list[Unit], options: dict) -> dict:
    """The keys of a model's marker: its config, dtype, units and engine options, and the
    sources that shape its kernels (metal_shaders, model/, engine/): a change to any of them
    may need modules the marker's run never built."""
    from metal_shaders.probe import sources_digest

    here = Path(__file__).parent
    code = {str(p.relative_to(here)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted([*here.glob("model/*.py"), *here.glob("engine/*.py")])}
    return {"config": hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest(), "dtype": dtype,
            "units": [u.name for u in units], "options": options, "kernels": sources_digest(),
            "code": kept.digest(code)}


def is_warmed(keys: dict) -> bool:
    return kept.read(MARKERS, "model", keys) is not None


# -- the kept directory --------------------------------------------------------------------------

def seed(private: Path, kept_dir: Path, skip: Path | None) -> None:
    """Hard links (copies across file systems) in `private` to every file kept in `kept_dir`
    (not `skip`, strata's own directory), so a worker builds only what is missing."""
    for file in kept_dir.rglob("*"):
        relative = file.relative_to(kept_dir)
        hidden = any(part.startswith(".") for part in relative.parts)  # workers' and writers' scratch
        if hidden or not file.is_file() or (skip is not None and skip in file.parents):
            continue
        target = private / file.relative_to(kept_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(file, target)
        except OSError:
            shutil.copy2(file, target)


def publish(private: Path, kept_dir: Path) -> int:
    """Move every module `private` holds that `kept_dir` lacks into `kept_dir`, each file renamed
    into place and a module's `.ptx` after its `.txt` and `.cu` (MLX reads a `.ptx` as the sign of
    a whole module). Returns the modules moved."""
    files = sorted((f for f in private.rglob("*") if f.is_file()), key=lambda f: (f.suffix == ".ptx", str(f)))
    moved = 0
    for file in files:
        target = kept_dir / file.relative_to(private)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
        shutil.copy2(file, tmp)
        os.replace(tmp, target)
        moved += file.suffix == ".ptx"
    return moved


def remove_stale(kernel_dir: Path) -> None:
    """Remove the scratch directories of parents that are gone (killed while their workers ran)."""
    for scratch in kernel_dir.glob(".warm-*"):
        pid = scratch.name.removeprefix(".warm-")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(scratch, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


# -- the parent ----------------------------------------------------------------------------------

@dataclass
class WarmReport:
    """What the parallel warm-up did: workers launched, units run, seconds (the parent's wait),
    modules kept; of them, what the background workers did (`background_*`, filled when they end)."""

    workers: int
    units: int
    done: int = 0
    seconds: float = 0.0
    modules_kept: int = 0
    failed: list[str] = field(default_factory=list)
    timed_out: bool = False
    background_workers: int = 0
    background_units: int = 0
    background_seconds: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background workers (at once when there are none); whether all ended."""
        thread = getattr(self, "_background", None)  # not a field: as_dict leaves it out
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()


def worker_command(path: Path, dtype: str | None, options: dict, units: list[Unit]) -> list[str]:
    cmd = [sys.executable, "-m", WORKER_MODULE, "--model", str(path), "--options", json.dumps(options),
           "--units", json.dumps([asdict(u) for u in units]), "--parent", str(os.getpid())]
    return cmd + (["--dtype", dtype] if dtype else [])


def engine_options(engine) -> dict:
    """The options a worker's engines need to run the parent's shapes: fold, partial mode,
    the context, compressed tails."""
    o = engine.options
    return {"fold": o.fold, "partial": o.partial, "max_context": engine.max_context,
            "compressed_rollback": o.compressed_rollback}


def split_groups(units: list[Unit], workers: int) -> tuple[list[list[Unit]], list[list[Unit]]]:
    """The first units' groups (`Unit.first`) and the rest's, `workers` groups in all, shared in
    proportion to the units; everything first with one worker or nothing to leave for later."""
    first = [u for u in units if u.first]
    later = [u for u in units if not u.first]
    if workers < 2 or not first or not later:
        return assign(units, workers), []
    n_first = max(1, min(workers - 1, round(workers * len(first) / len(units))))
    return assign(first, n_first), assign(later, workers - n_first)


def warm_in_parallel(path: Path, dtype: str | None, model, engine, kernel_dir: Path | None, *,
                     max_T: int, announce: Callable[[str], None] | None = None,
                     timeout: float | None = None, explain_refusal: bool = True) -> WarmReport | None:
    """Compile this model's kernels in worker processes when this machine has not yet (see the
    module docstring); None when nothing was launched (not CUDA, off, warmed already, streamed
    experts, a model that does not split by layer, fewer than one worker).

    Returns once the first units' workers ended; the others go on in the background, the engine's
    prompt chunks capped at a window's rows until they end (and this process's exit waits for them).

    Args:
        path: the checkpoint directory; dtype: the `--dtype` the parent loaded with.
        model, engine: the parent's model and window engine (the plan's layers and shapes).
        kernel_dir: MLX's kept module directory (`KernelCache.path`), None off CUDA.
        max_T: the largest window warmed.
        announce: called with the one line before the workers start, and with each warning.
        timeout: seconds to wait for every worker (default `STRATA_PARALLEL_WARM_TIMEOUT`, else 600).
        explain_refusal: announce why no worker starts where memory rules them out (the CLI:
            on a machine whose kernel cache was empty, where this process then compiles).
    """
    if kernel_dir is None or turned_off() or engine.expert_cache is not None:
        return None  # no plan, no hashing of sources
    units = plan_units(model, engine, max_T=max_T)
    options = engine_options(engine)
    keys = signature(path, str(dtype), units, options)
    if not units or is_warmed(keys):
        return None
    say = announce or (lambda line: None)
    per_worker = worker_bytes(model, units)
    free = (cuda_driver.free_memory(), host_available())
    workers = worker_count(len(units), per_worker=per_worker, free=free)
    if workers < 1:
        if explain_refusal and available_cores() > 1:  # memory ruled them out: say so, and the way round
            said = ", ".join(f"{where} {'unknown' if b is None else f'{b / 1e9:.1f} GB'}"
                             for where, b in zip(("GPU", "host"), free))
            say(f"strata: compiling GPU kernels in this process: a kernel worker needs up to {per_worker / 1e9:.1f} GB "
                f"and free memory is {said} ({ENV}=N launches N workers anyway)")
        return None
    say(f"strata: compiling GPU kernels for this machine, once: {workers} workers of up to "
        f"{per_worker / 1e9:.1f} GB each (kept in {kernel_dir})")
    timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S) if timeout is None else timeout
    report = WarmReport(workers=workers, units=len(units))
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    remove_stale(kernel_dir)
    scratch = kernel_dir / f".warm-{os.getpid()}"
    first, later = split_groups(units, workers)
    background = None
    try:
        if later:  # launched first: they run longest
            background = WorkerSet(path, dtype, options, later, kernel_dir, scratch, first_index=len(first))
        foreground = WorkerSet(path, dtype, options, first, kernel_dir, scratch)
    except OSError as e:  # an unwritable kernel directory, no interpreter to start: the old path
        if background is not None:
            background.kill()
        shutil.rmtree(scratch, ignore_errors=True)
        report.failed.append(f"{type(e).__name__}: {e}")
        say(f"strata: warning: kernel workers could not start ({e}); kernels compile in this process")
        return report
    foreground.collect(deadline, timeout, report, say, show=sys.stderr.isatty())
    report.seconds = time.perf_counter() - start
    if background is None:
        _finish(scratch, keys, report)
        return report
    report.background_workers, report.background_units = len(later), sum(map(len, later))
    engine.cap_prompt_chunks(first_prompt_rows())

    def finish_background() -> None:
        try:
            background.collect(deadline, timeout, report, say, show=False)
            report.background_seconds = time.perf_counter() - start
        finally:
            engine.cap_prompt_chunks(None)  # the prompt path's modules are kept now (or compile here)
            _finish(scratch, keys, report)

    thread = report._background = threading.Thread(target=finish_background, name="strata-kernel-workers",
                                                   daemon=True)
    thread.start()
    atexit.register(_await, thread, say)
    return report


def _finish(scratch: Path, keys: dict, report: WarmReport) -> None:
    """Every worker ended: remove the scratch and, unless one ran out of time, mark the model
    warmed (what failed, the parent builds itself and MLX keeps)."""
    shutil.rmtree(scratch, ignore_errors=True)
    if not report.timed_out:
        kept.write(MARKERS, "model", keys, {"report": report.as_dict()})


def _await(thread: threading.Thread, say: Callable[[str], None]) -> None:
    """At exit: wait for the background workers, so that what they compile is kept."""
    if thread.is_alive():
        say("strata: waiting for the kernel workers to finish (once per machine; stopping them now "
            "leaves the rest to the next run)")
        thread.join()


class WorkerSet:
    """Worker processes, one per group of units, each compiling into its own directory under
    `scratch` (`first_index` numbers them apart from another set's)."""

    def __init__(self, path: Path, dtype: str | None, options: dict, groups: list[list[Unit]], kernel_dir: Path,
                 scratch: Path, *, first_index: int = 0):
        env = {**os.environ, ENV: "0"}
        self.kernel_dir, self.scratch = kernel_dir, scratch
        self.lines: queue.Queue = queue.Queue()
        self.procs: list[tuple[int, subprocess.Popen, Path]] = []
        self.readers: list[threading.Thread] = []
        try:
            for i, group in enumerate(groups, first_index):
                private = scratch / str(i)
                private.mkdir(parents=True)
                seed(private, kernel_dir, kept.directory())
                with open(scratch / f"{i}.stderr", "w") as err:  # a file: a full pipe would stall the worker
                    proc = subprocess.Popen(worker_command(path, dtype, options, group),
                                            env={**env, "MLX_PTX_CACHE_DIR": str(private)}, stdout=subprocess.PIPE,
                                            stderr=err, text=True)
                self.readers.append(threading.Thread(target=self._read, args=(proc,), daemon=True))
                self.readers[-1].start()
                self.procs.append((i, proc, private))
        except OSError:
            self.kill()  # the ones started: none left compiling for a set that is given up
            raise

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put(line)

    def kill(self) -> None:
        for _, proc, _ in self.procs:
            proc.kill()
            proc.wait()

    def collect(self, deadline: float, timeout: float, report: WarmReport, say: Callable[[str], None], *,
                show: bool) -> None:
        """Wait until every worker ended or `deadline` (time.monotonic, `timeout` s after the start), counting units done on
        `report` (a units-done line on stderr with `show`); publish what each worker that exited 0
        compiled; a failure or the deadline is a warning through `say`."""
        procs = [proc for _, proc, _ in self.procs]
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            try:
                self.lines.get(timeout=0.5)
                report.done += 1
            except queue.Empty:
                pass
            if show:
                print(f"\rstrata: GPU kernels: {report.done}/{report.units} units", end="", file=sys.stderr, flush=True)
        for proc, reader in zip(procs, self.readers):
            if proc.poll() is not None:
                reader.join(timeout=5)  # its last lines, read to the end of its output
        while not self.lines.empty():
            self.lines.get()
            report.done += 1
        if show:
            print(f"\rstrata: GPU kernels: {report.done}/{report.units} units", file=sys.stderr, flush=True)
        for i, proc, private in self.procs:
            if proc.poll() is None:
                report.timed_out = True
                proc.kill()
                proc.wait()
                report.failed.append(f"worker {i}: no answer within {timeout:.0f} s")
                say(f"strata: warning: kernel worker {i} gave no answer within {timeout:.0f} s; "
                    "the rest compiles in this process")
                continue
            if proc.returncode != 0:
                tail = (self.scratch / f"{i}.stderr").read_text(errors="replace").strip().splitlines()[-1:] or ["no message"]
                report.failed.append(f"worker {i}: exit {proc.returncode}: {tail[0][:300]}")
                say(f"strata: warning: kernel worker {i} failed (exit {proc.returncode}: {tail[0][:300]}); "
                    "the rest compiles in this process")
                continue
            report.modules_kept += publish(private, self.kernel_dir)
