"""Opening a checkpoint: the one way every command gets a model, its tokenizer and an engine.

`open_model(LoadOptions(...), EngineOptions(...))` resolves "demo" to the embedded checkpoint,
loads any layout model/loader.py reads (Hugging Face, MLX, strata's own), serves the routed
experts of a streamed checkpoint from disk (experts/), and builds the window engine. `generate`,
`serve-stdio`, `bench` and the scripts all open models here, so they take the same options.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import mlx.core as mx

from .engine.window import WindowEngine
from .experts.store import ExpertStoreError, is_streamed
from .experts.switch import attach_streamed_experts
from .model.config import ConfigError, dtype_name
from .model.loader import ModelLoadError, compute_dtype, load_model
from .options import DEMO_MODEL, EngineOptions, LoadOptions, MoceOptions, StreamOptions
from .tokenizer import Tokenizer


def embedded_model_path() -> Path:
    """The checkpoint directory of the embedded demo model."""
    return Path(str(files("strata_cli") / "assets" / "demo"))


def resolve_model_path(model: str | Path) -> Path:
    """A `--model` value as a directory: "demo" is the embedded model, anything else a path."""
    return embedded_model_path() if str(model) == DEMO_MODEL else Path(model)


def model_identity(path: str | Path) -> str:
    """SHA-256 over config.json's bytes and every weight file's name and size.

    Hashing the weights themselves would cost a full read of the checkpoint at every start; names
    and sizes catch a swapped or re-quantized model, and config.json catches another architecture.
    """
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    return digest.hexdigest()


def load_checkpoint(path: str | Path, *, dtype: str | None = None, stream: StreamOptions | None = None,
                    moce: MoceOptions | None = None):
    """The model in checkpoint directory `path`, its routed experts streamed from disk when the
    checkpoint keeps them in the streaming layout (`strata convert --stream`).

    Args:
        path: the checkpoint directory.
        dtype: "float32", "bfloat16", "float16", or None for the checkpoint's own.
        stream: expert cache options (default `StreamOptions()`); non-default ones need a
            streamed checkpoint.
        moce: cache-aware routing (default off); on, it needs a streamed checkpoint.

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
                attach_streamed_experts(model, path, dtype=compute, options=stream, moce=moce)
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
    return load_model(path, dtype=dtype, before_weights=attach)


@dataclass
class Runtime:
    """An opened checkpoint, ready to decode.

    Attributes:
        path: the checkpoint directory.
        model: the MLX model (its `expert_cache` set when experts stream).
        tokenizer: text <-> ids, with the checkpoint's end-of-sequence ids.
        engine: the window engine that owns every per-request state.
        identity: `model_identity(path)`, which session files are keyed by.
        dtype: the compute dtype.
    """

    path: Path
    model: object
    tokenizer: Tokenizer
    engine: WindowEngine
    identity: str
    dtype: mx.Dtype

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def open_model(load: LoadOptions | None = None, engine: EngineOptions | None = None) -> Runtime:
    """Open the checkpoint `load.model` names and build its engine.

    Args:
        load: which checkpoint, dtype and expert streaming (default: the demo model).
        engine: fold, partial mode and context limit (default `EngineOptions()`).

    Raises:
        ModelLoadError, ConfigError: as `load_checkpoint`, plus a missing or unreadable tokenizer.
    """
    load = load or LoadOptions()
    path = resolve_model_path(load.model)
    model = load_checkpoint(path, dtype=load.dtype, stream=load.stream, moce=load.moce)
    tokenizer = Tokenizer(path)
    return Runtime(
        path=path, model=model, tokenizer=tokenizer, engine=WindowEngine(model, engine),
        identity=model_identity(path), dtype=compute_dtype(model),
    )
