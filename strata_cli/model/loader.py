"""Load a Hugging Face-format checkpoint directory: config.json, safetensors, tokenizer.json."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import ConfigError

# model_type -> module in strata_cli.model
ARCHITECTURES = {"qwen3_next": "qwen3_next"}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class ModelLoadError(Exception):
    """A checkpoint that cannot be used; the message names the file and what was expected."""


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: missing (a model directory needs config.json)")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from None


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (listed in {index.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def load_weights(files: list[Path]) -> dict[str, mx.array]:
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    return weights


def stored_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype most floating-point tensors are stored in (a few norms may differ)."""
    counts = Counter(v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating))
    return counts.most_common(1)[0][0] if counts else mx.float32


def choose_dtype(requested: str | None, stored: mx.Dtype) -> mx.Dtype:
    if requested is not None:
        return DTYPES[requested]
    # Half-precision matmuls are slow on the CPU backend and its gather_mm takes float32 only.
    if mx.default_device() == mx.cpu:
        return mx.float32
    return stored


def check_weights(model, weights: dict[str, mx.array], source: Path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise ModelLoadError(f"{source}: missing tensors {_some(missing)}")
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensors {_some(unexpected)}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(value.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_model(path: str | Path, *, dtype: str | None = None):
    """Build the model a checkpoint directory describes and load its weights.

    Args:
        path: directory with config.json and *.safetensors (sharded or not).
        dtype: "float32", "bfloat16", "float16", or None for the stored dtype (float32 on CPU).

    Returns:
        The model, with `model.config` set.

    Raises:
        ModelLoadError: missing or corrupt files, an unknown model_type, wrong tensor shapes.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path '{path}' does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is not a directory")
    params = read_config(path)
    model_type = params.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path / 'config.json'}: unknown model_type {model_type!r} "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    arch = importlib.import_module(f"{__package__}.{ARCHITECTURES[model_type]}")
    try:
        config = arch.Config.from_dict(params)
        model = arch.Model(config)
    except (ConfigError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None

    files = weight_files(path)
    weights = load_weights(files)
    stored = stored_dtype(weights)
    weights = model.sanitize(weights)
    check_weights(model, weights, files[0] if len(files) == 1 else path)
    target = choose_dtype(dtype, stored)
    weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model
