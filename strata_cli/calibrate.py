"""The device's own window-cost curve for `--suffix-draft auto`, measured once and cached.

The controller's built-in cost prior is a shape (a window of T rows costs 1 + 0.3·(T-1) one-row
windows) that fits MLX's CPU backend; on a GPU a window of 4 rows costs about 1.3 one-row
windows, so that prior declines drafts that pay. When `auto` runs without `--draft-cost`,
`device_cost_prior` measures the curve on the model, backend and dtype in use: forced-acceptance
windows of T = 1..max_T rows (as scripts/bench/window_cost.py does, a few per T, on a scratch state),
median per T. The curve is cached as JSON in the user cache directory (`$XDG_CACHE_HOME/strata`,
else `~/.cache/strata`), keyed by model identity, backend, dtype, MLX version and whether windows
are padded to row buckets, and reused; the online estimate refines it while decoding. Each T's
first window is not timed: it may build the shape's kernels.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx

from .engine.window import WindowEngine
from .speculative.controller import CostCurveError, CostPrior

CURVE_VERSION = 1
CALIBRATION_CONTEXT = 64  # prefilled positions every T starts from
CALIBRATION_WINDOWS = 5  # windows per T: the first untimed (a new shape), the median of the rest


def cache_dir() -> Path:
    """Where strata caches what it measured: `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata"


def backend_name() -> str:
    """The default device's backend, with the device's name where MLX reports one ("gpu:NVIDIA
    H200"), so a curve measured on one GPU is not reused on another."""
    device = mx.default_device()
    name = device.type.name
    if device.type != mx.cpu:
        try:
            model = mx.device_info().get("device_name")
        except (AttributeError, RuntimeError):
            model = None
        if model:
            name += f":{model}"
    return name


def curve_path(identity: str, backend: str, dtype: str, directory: Path | None = None) -> Path:
    safe_backend = "".join(c if c.isalnum() else "-" for c in backend)
    return (directory or cache_dir()) / "cost-curves" / f"{identity[:16]}-{safe_backend}-{dtype}.json"


def measure_curve(engine: WindowEngine, max_T: int, *, windows: int = CALIBRATION_WINDOWS,
                  context: int = CALIBRATION_CONTEXT, seed: int = 0) -> list[float]:
    """Median seconds of a forced-acceptance window of T = 1..max_T rows.

    Each T restores the same prefilled scratch state and runs `windows` windows of random
    tokens, committing every row; the first is not timed. The engine's committed state is
    restored afterwards, so nothing leaks into a request. With streamed experts, the time spent
    reading the experts the drafts need beyond the root's is left out, as the decode loop
    leaves it out of the controller's samples (`extra_seconds`): the controller predicts it
    apart (`DraftReadCost`).
    """
    if windows < 2:
        raise ValueError(f"calibration needs at least 2 windows per T, got {windows}")
    saved = engine.snapshot()
    context = max(1, min(context, engine.max_context - max_T * windows))
    if context + max_T * windows > engine.max_context:
        raise ValueError(f"the context ({engine.max_context}) is too short to calibrate windows of {max_T}")
    rng = random.Random(seed)
    engine.reset()
    engine.prefill([rng.randrange(engine.vocab_size) for _ in range(context)])
    start_state = engine.snapshot()
    curve = []
    for T in range(1, max_T + 1):
        engine.restore(start_state)
        seconds = []
        for _ in range(windows):
            tokens = [rng.randrange(engine.vocab_size) for _ in range(T)]
            start = time.perf_counter()
            engine.run(tokens, engine.length)
            engine.commit(T)  # forced acceptance; a lazy fold joins the next window, as in decoding
            experts = engine.last_window_experts()
            reads = experts.draft_read_seconds if experts is not None else 0.0
            seconds.append(max(time.perf_counter() - start - reads, 1e-9))
        curve.append(statistics.median(seconds[1:]))
    engine.reset()
    engine.restore(saved)
    return curve


def read_curve(path: Path, key: dict, max_T: int) -> list[float] | None:
    """The cached curve at `path` when it was measured for `key` and covers T = 1..max_T, else None
    (a missing, unreadable or stale file is measured again)."""
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or any(record.get(k) != v for k, v in key.items()):
            return None
        seconds = [float(s) for s in record["seconds"]]
        CostPrior.from_seconds(seconds)  # positive and finite
    except (OSError, ValueError, KeyError, TypeError, CostCurveError):
        return None
    return seconds if len(seconds) >= max_T else None


def write_curve(path: Path, record: dict) -> None:
    """Write `record` to `path` atomically: a temp file in the same directory, then a rename, so
    a reader never sees half a file and two processes never mix theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def device_cost_prior(engine: WindowEngine, *, identity: str, dtype: str, max_T: int,
                      directory: Path | None = None) -> tuple[CostPrior, float]:
    """The cost prior of this model on this device: cached, or measured now and cached.

    Returns:
        (prior, seconds spent measuring: 0.0 when the cache answered). The prior's `source` is
        "cached" or "calibrated"; "builtin" (the linear shape) when the engine's context is too
        short to measure T = 1..max_T. An unwritable cache directory only costs the reuse.
    """
    backend = backend_name()
    key = {"version": CURVE_VERSION, "identity": identity, "backend": backend, "dtype": dtype,
           "mlx": mx.__version__, "padded": engine.pads_windows}  # padded windows cost their bucket
    path = curve_path(identity, backend, dtype, directory)
    seconds = read_curve(path, key, max_T)
    if seconds is not None:
        return CostPrior.from_seconds(seconds[:max_T], source="cached"), 0.0
    if CALIBRATION_WINDOWS * max_T + 1 > engine.max_context:
        return CostPrior.linear(), 0.0
    start = time.perf_counter()
    seconds = measure_curve(engine, max_T)
    spent = time.perf_counter() - start
    try:
        write_curve(path, {**key, "seconds": seconds, "calibration_seconds": spent,
                           "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    except OSError:
        pass  # a read-only home: calibrate again next time
    return CostPrior.from_seconds(seconds, source="calibrated"), spent
