"""Opening a checkpoint: the one way every command gets a model, its tokenizer and an engine.

`open_model(LoadOptions(...), EngineOptions(...))` resolves "demo" to the embedded checkpoint,
loads any layout model/loader.py reads (Hugging Face, MLX, strata's own), serves the routed
experts of a streamed checkpoint from disk (experts/), and builds the window engine. `generate`,
`serve-stdio`, `bench` and the scripts all open models here, so they take the same options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .calibrate import device_cost_prior
from .distributed import Link, PipelineModel, Stage, StageFollower, barrier, find_group
from .engine.window import WindowEngine
from .experts.store import INDEX_NAME, STREAM_DIR, ExpertStoreError, is_streamed
from .experts.switch import attach_streamed_experts
from .hub import is_repo_id, resolve_repo
from .integrity import Verification
from .kernel_cache import KernelCache, prepare_kernel_cache
from .kernel_warm import WarmReport, warm_in_parallel
from .model.config import ConfigError, dtype_name
from .model.loader import ModelLoadError, compute_dtype, load_model
from .options import (
    DEMO_MODEL,
    MAX_SUFFIX_DRAFT,
    EngineOptions,
    LoadOptions,
    MoceOptions,
    SpecOptions,
    StreamOptions,
)
from .speculative.controller import CostPrior
from .tokenizer import Tokenizer


def embedded_model_path() -> Path:
    """The checkpoint directory of the embedded demo model."""
    return Path(str(files("strata_cli") / "assets" / "demo"))


def resolve_model_path(model: str | Path, *, download: bool = False) -> Path:
    """A `--model` value as a directory: "demo" is the embedded model; a path that does not exist
    but reads as `owner/name` is a Hugging Face repo id, found in the hub cache (or downloaded,
    with `download`: hub.py); anything else a path."""
    if str(model) == DEMO_MODEL:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists() and is_repo_id(str(model)):
        return resolve_repo(str(model), download=download)
    return path


def model_identity(path: str | Path, verification: Verification) -> str:
    """SHA-256 over config.json's bytes, every weight file's name and content sha256 (as loading
    computed or verified them) and, for a streamed checkpoint, experts/index.json's bytes (whose
    per-record crc32s cover the expert files).

    Keyed by content, so a session saved with other weights of the same shapes is refused.
    """
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for name, sha in sorted(verification.digests.items()):
        digest.update(f"\0{name}\0{sha}".encode())
    index = path / STREAM_DIR / INDEX_NAME
    if index.is_file():
        digest.update(b"\0" + index.read_bytes())
    return digest.hexdigest()


def load_checkpoint(path: str | Path, *, dtype: str | None = None, stream: StreamOptions | None = None,
                    moce: MoceOptions | None = None, stage: Stage | None = None):
    """The model in checkpoint directory `path`, its routed experts streamed from disk when the
    checkpoint keeps them in the streaming layout (`strata convert --stream`).

    Args:
        path: the checkpoint directory.
        dtype: "float32", "bfloat16", "float16", or None for the checkpoint's own.
        stream: expert cache options (default `StreamOptions()`); non-default ones need a
            streamed checkpoint.
        moce: cache-aware routing (default off); on, it needs a streamed checkpoint.
        stage: load only this pipeline stage's layers (distributed.py), and stream only their
            experts; None = the whole model.

    Raises:
        ModelLoadError: missing or corrupt files, an unusable expert layout.
        ConfigError: expert options for a checkpoint that does not stream, or a budget below
            one expert per block, or MoCE options for a checkpoint that does not stream.
    """
    path = Path(path)
    stream = stream or StreamOptions()
    moce = moce or MoceOptions()
    attach = None
    if path.is_dir() and is_streamed(path):
        def attach(model, compute: mx.Dtype) -> None:
            try:
                attach_streamed_experts(model, path, dtype=compute, options=stream, moce=moce,
                                        holds=None if stage is None else stage.holds)
            except ExpertStoreError as e:
                raise ModelLoadError(str(e)) from None
    elif path.is_dir() and not stream.is_default:
        raise ConfigError(
            f"expert cache options apply to a streamed checkpoint (strata convert --stream); "
            f"{path} keeps its experts in safetensors"
        )
    elif path.is_dir() and moce.is_enabled:
        raise ConfigError(
            f"cache-aware routing (--moce-protect) applies to a streamed checkpoint (strata convert --stream); "
            f"{path} keeps its experts in safetensors"
        )
    return load_model(path, dtype=dtype, before_weights=attach, select=stage.select if stage else None)


@dataclass
class Runtime:
    """An opened checkpoint, ready to decode.

    Attributes:
        path: the checkpoint directory.
        model: the MLX model (its `expert_cache` set when experts stream).
        tokenizer: text <-> ids, with the checkpoint's end-of-sequence ids.
        engine: the window engine that owns every per-request state.
        identity: `model_identity(path, ...)`, which session files are keyed by.
        verification: each weight file's sha256 and what it was checked against.
        dtype: the compute dtype.
        warmup_seconds: load time spent warming window shapes, the kernel workers' time included
            (0.0 when nothing was warmed at load).
        warmup_by_rows: the seconds of each window row count warmed at load.
        kernel_cache: where compiled GPU kernels are kept across processes, and whether this
            process found it empty (kernel_cache.py).
        kernel_workers: what the parallel kernel warm-up of a fresh GPU machine did (kernel_warm.py),
            None when none ran.
        calibration_seconds: load time spent measuring the device's cost curve (0.0 when none
            was measured, or the cache had it).
        stage: this rank's pipeline stage under `mlx.launch` (None: one process holds it all).
        follower: on ranks after the first, what serves rank 0's windows (`engine` is None there).
    """

    path: Path
    model: object
    tokenizer: Tokenizer
    engine: WindowEngine
    identity: str
    dtype: mx.Dtype
    verification: Verification
    warmup_seconds: float = 0.0
    calibration_seconds: float = 0.0
    warmup_by_rows: dict[int, float] = dataclasses.field(default_factory=dict)
    kernel_cache: KernelCache | None = None
    kernel_workers: WarmReport | None = None
    stage: Stage | None = None
    follower: StageFollower | None = None
    _device_prior: CostPrior | None = dataclasses.field(default=None, repr=False)

    @property
    def load_notes(self) -> list[str]:
        """What loading did besides building the text model, one line each (a family's
        `load_notes`: parts of a published checkpoint kept aside or left out, never silently)."""
        return list(getattr(self.model, "load_notes", ()))

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def spec_for(self, spec: SpecOptions) -> SpecOptions:
        """`spec` with the device's own cost prior when it is `auto` without a curve of its own.

        The curve (`calibrate.device_cost_prior`) is read from the user cache or measured once
        per Runtime (about a second, T = 1..MAX_SUFFIX_DRAFT+1, on a scratch state).
        """
        if not spec.auto or spec.cost_prior is not None:
            return spec
        if self._device_prior is None:
            identity = self.identity
            if self.stage is not None:  # a pipeline's windows cost what its split makes them cost
                identity += f":ranks={self.stage.summary()['layers']}"
            self._device_prior, self.calibration_seconds = device_cost_prior(
                self.engine, identity=identity, dtype=self.dtype_name, max_T=MAX_SUFFIX_DRAFT + 1)
        return dataclasses.replace(spec, cost_prior=self._device_prior)


def open_model(load: LoadOptions | None = None, engine: EngineOptions | None = None, *,
               announce: Callable[[str], None] | None = None,
               warm_progress: Callable[[int, int], None] | None = None) -> Runtime:
    """Open the checkpoint `load.model` names and build its engine.

    On a CUDA backend, compiled kernels are kept in the user cache (kernel_cache.py) unless
    `MLX_PTX_CACHE_DIR` says where. Window shapes are warmed (`WindowEngine.warm_up`) at load
    with `engine.warm_shapes`; by default each is warmed before its first window instead, except
    that a process that finds the kernel cache empty warms the one-row shape here, after
    `announce` told the user why it waits.

    Args:
        load: which checkpoint, dtype and expert streaming (default: the demo model).
        engine: fold, partial mode, context limit, padding and shape warm-up (default
            `EngineOptions()`).
        announce: called with one line before a cold kernel cache's first compile (CLI: stderr).
        warm_progress: `warm_progress(done, total)` before the first and after each shape warmed
            at load.

    Raises:
        ModelLoadError, ConfigError: as `load_checkpoint`, plus a missing or unreadable tokenizer.
    """
    kernels = prepare_kernel_cache()  # before anything compiles: MLX reads the variable once
    if kernels.notice and announce:
        announce(kernels.notice)
    load = load or LoadOptions()
    path = resolve_model_path(load.model, download=load.download)
    group = find_group()
    stage = None if group is None else Stage(group.rank(), group.size(), split=load.pipeline.split, path=path)
    model = load_checkpoint(path, dtype=load.dtype, stream=load.stream, moce=load.moce, stage=stage)
    tokenizer = Tokenizer(path)
    identity = model_identity(path, model.verification)
    if stage is not None:
        barrier(group, stage.rank)
        if not stage.is_first:  # this rank serves rank 0's windows on its layers (runtime.follower)
            follower = StageFollower(model, stage, group, engine or EngineOptions(), load.pipeline.timeout)
            return Runtime(path=path, model=model, tokenizer=tokenizer, engine=None, identity=identity,
                           dtype=compute_dtype(model), verification=model.verification, stage=stage,
                           follower=follower)
        link = Link(group, stage, model.config.hidden_size, load.pipeline.timeout)
        model = PipelineModel(model, stage, link)
    window_engine = WindowEngine(model, engine)
    start = time.perf_counter()
    workers = None
    if stage is None:  # a fresh GPU machine: build this model's kernels in worker processes first
        workers = warm_in_parallel(path, load.dtype, model, window_engine, kernels.path,
                                   max_T=MAX_SUFFIX_DRAFT + 1, announce=announce, explain_refusal=kernels.cold)
    if should_warm_shapes(window_engine.options):
        warmup_by_rows = window_engine.warm_up(MAX_SUFFIX_DRAFT + 1, progress=warm_progress)
    elif kernels.cold and window_engine.warms_on_first_use:
        if warm_progress:
            warm_progress(0, 1)
        warmup_by_rows = {1: window_engine.warm(1)}  # what the first token needs, shown as progress
        if warm_progress:
            warm_progress(1, 1)
    else:
        warmup_by_rows = {}
    warmup_seconds = time.perf_counter() - start if warmup_by_rows or workers else 0.0
    return Runtime(
        path=path, model=model, tokenizer=tokenizer, engine=window_engine, identity=identity,
        dtype=compute_dtype(model if stage is None else model.model), verification=model.verification,
        warmup_seconds=warmup_seconds, warmup_by_rows=warmup_by_rows, kernel_cache=kernels, stage=stage,
        kernel_workers=workers,
    )


def should_warm_shapes(options: EngineOptions) -> bool:
    """Whether every window shape is warmed at load: only with `options.warm_shapes` True (by
    default GPU backends warm each shape before its first window, `WindowEngine.ensure_warm`)."""
    return options.warm_shapes is True
