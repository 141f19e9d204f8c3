"""Load a checkpoint directory: config.json, safetensors, tokenizer.json.

Reads the Hugging Face layout, the MLX-community layout (quantized or not) and strata's own
(`strata convert`); see model/layout.py. Every problem becomes one `ModelLoadError` naming the
file and what was expected.
"""

from __future__ import annotations

import importlib
import json
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..integrity import IntegrityError, verify_files
from .config import DTYPES, ConfigError
from .layers import stack_rows
from .layout import LayoutError, from_mlx_layout
from .quant import (
    DEQUANTIZE_DENSE_MAX_BYTES,
    Quantization,
    apply_to_load,
    dense_bytes,
    dequantize_dense,
)

# model_type -> module in strata_cli.model
ARCHITECTURES = {"qwen3_next": "qwen3_next", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
                 "nemotron_h": "nemotron_h", "granitemoehybrid": "granitemoehybrid", "glm4_moe": "glm4_moe",
                 "gpt_oss": "gpt_oss", "deepseek_v4": "deepseek_v4", "deepseek_v3": "deepseek_v3",
                 "kimi_linear": "kimi_linear",
                 "kimi_k2": "deepseek_v3"}  # Kimi-K2's config.json names DeepSeek-V3's architecture so
# Qwen3.5 / 3.6, dense and MoE: the multimodal checkpoints' model_type and transformers' text-only ones.
ARCHITECTURES.update(dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "qwen3_5"))
# config.json key that marks strata's own layout (already sanitized), and its version:
# 2 stores the tensors in mlx-lm's layout (layout.to_mlx_layout), so mlx-lm loads them too;
# 1 stores the modules' parameters as they are (conv1d (C, K), bare expert stacks), read too.
FORMAT_KEY = "strata_format"
FORMAT_VERSION = 2
MAX_HEADER_BYTES = 100_000_000  # a safetensors JSON header; larger means a corrupt length prefix


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


def read_header(path: Path) -> dict:
    """A safetensors file's header, checked against the file's size (catches truncation)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(
                f"{path}: not a safetensors file ({size} bytes, expected an 8-byte header length first)"
            )
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ModelLoadError(f"{path}: corrupt safetensors header (says {length} bytes of header, file has {size})")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    data = size - 8 - length
    if max(ends, default=0) > data:
        raise ModelLoadError(
            f"{path}: truncated safetensors file (its header needs {max(ends)} bytes of tensor data, "
            f"the file holds {data})"
        )
    return header


def load_weights(files: list[Path]) -> tuple[dict[str, mx.array], dict[str, Path]]:
    """Every tensor of every file, and the file each came from."""
    weights, sources = {}, {}
    for f in files:
        read_header(f)
        try:
            tensors = mx.load(str(f))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        weights.update(tensors)
        sources.update(dict.fromkeys(tensors, f))
    return weights, sources


def stored_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype most floating-point tensors are stored in (a few norms may differ)."""
    counts = Counter(v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating))
    return counts.most_common(1)[0][0] if counts else mx.float32


def compute_dtype(model) -> mx.Dtype:
    """The floating dtype most of a loaded model's parameters have: the dtype it computes in
    (quantized weights are integers, their scales floating)."""
    return stored_dtype(dict(tree_flatten(model.parameters())))


def choose_dtype(requested: str | None, stored: mx.Dtype) -> mx.Dtype:
    if requested is not None:
        return DTYPES[requested]
    # Half-precision matmuls are slow on the CPU backend and its gather_mm takes float32 only.
    if mx.default_device() == mx.cpu:
        return mx.float32
    return stored


def check_weights(model, weights: dict[str, mx.array], sources: dict[str, Path], path: Path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    files = set(sources.values())
    source = files.pop() if len(files) == 1 else path
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise ModelLoadError(f"{source}: missing tensors {_some(missing)}")
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensors {_some(unexpected)}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise ModelLoadError(
                f"{_origin(name, sources, path)}: tensor {name} has shape {tuple(value.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )


def _origin(name: str, sources: dict[str, Path], path: Path) -> Path:
    """The file a (possibly stacked or renamed) tensor came from, else the directory."""
    for key in (name, f"{name}.weight"):
        if key in sources:
            return sources[key]
    block = name.split(".switch_mlp.")[0] + "."
    files = {f for k, f in sources.items() if k.startswith(block)}
    return files.pop() if len(files) == 1 else path


def read_quantization(params: dict) -> Quantization | None:
    """The MLX `quantization` block, if any; other quantization schemes are refused."""
    if "quantization" in params:
        return Quantization.from_config(params["quantization"])
    foreign = params.get("quantization_config")
    if foreign:
        method = foreign.get("quant_method") if isinstance(foreign, dict) else foreign
        raise ConfigError(
            f"quantization_config (quant_method {method!r}) is not supported: strata reads "
            "unquantized checkpoints and MLX affine ones (a 'quantization' block)"
        )
    return None


def strata_format(params: dict) -> int | None:
    """The format version of a checkpoint `strata convert` wrote (its tensors need no sanitizing),
    None for any other checkpoint."""
    version = params.get(FORMAT_KEY)
    if version is None:
        return None
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise ConfigError(f"{FORMAT_KEY} {version!r} is not one this strata reads (1..{FORMAT_VERSION})")
    return version


def _dtype_of(model, name: str, target: mx.Dtype) -> mx.Dtype:
    """float32 for the parameters a family keeps in float32 whatever it computes in (`FLOAT32_PARAMETERS`,
    name suffixes: routers, as the references keep them), else `target`."""
    return mx.float32 if name.endswith(getattr(model, "FLOAT32_PARAMETERS", ())) else target


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def should_dequantize_dense(model, requested: bool | None) -> bool:
    """`requested`, or by default: on the CPU, when the dense layers are small (quant.dequantize_dense)."""
    if requested is not None:
        return requested
    return mx.default_device() == mx.cpu and dense_bytes(model) <= DEQUANTIZE_DENSE_MAX_BYTES


def load_model(
    path: str | Path, *, dtype: str | None = None, before_weights: Callable[[object, mx.Dtype], None] | None = None,
    dequantize: bool | None = None,
    more_weights: Callable[[], tuple[dict[str, mx.array], dict[str, Path]]] | None = None,
    select: Callable[[object], Callable[[str], bool]] | None = None,
):
    """Build the model a checkpoint directory describes and load its weights.

    Args:
        path: directory with config.json and *.safetensors (sharded or not).
        dtype: "float32", "bfloat16", "float16", or None for the stored dtype (float32 on CPU).
        before_weights: called as `before_weights(model, compute_dtype)` once the model is built
            and before its weights are checked and loaded; the runtime attaches streamed experts
            there (runtime.py), which take the routed experts' parameters out of the model.
        dequantize: run a quantized checkpoint's dense layers dequantized (True), quantized
            (False), or None: dequantized on the CPU when they are small (`should_dequantize_dense`).
        more_weights: called once after the shards are read; returns more tensors, named as the
            model names its parameters, that load as if the shards held them, and the file each
            came from (convert.py reads a streamed checkpoint's experts back so).
        select: called as `select(model)` once the tensors are named as the model names them;
            it may replace modules this process does not hold with empty ones (a pipeline
            stage, distributed.py) and returns which tensor names to keep; the others are
            never read.

    Returns:
        The model, with `model.config` set and `model.verification` (integrity.py): each weight
        file's sha256 and what it was checked against (checksums.json, a hub cache, or nothing).

    Raises:
        ModelLoadError: missing or corrupt files (a sha256 that differs from checksums.json or the
            hub cache's blob name included), an unknown model_type, wrong tensor shapes.
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
        # A family whose published checkpoints quantize outside MLX's block (GPT-OSS's mxfp4
        # experts) says what that block means; any other is refused.
        foreign = getattr(model, "foreign_quantization", None)
        quantization = (foreign and foreign(params)) or read_quantization(params)
        if quantization is not None and hasattr(model, "sanitize_quantization"):
            quantization = model.sanitize_quantization(quantization)  # per-layer paths, as sanitize renames them
        version = strata_format(params)
    except (ConfigError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None

    files = weight_files(path)
    try:  # before any tensor is read: a corrupt byte must never become output
        verification = verify_files(path, [str(f.relative_to(path)) for f in files])
    except (IntegrityError, OSError) as e:
        raise ModelLoadError(str(e)) from None
    weights, sources = load_weights(files)
    stored = stored_dtype(weights)
    try:
        if version is None:
            weights = model.sanitize(weights)
        elif version >= 2:
            weights = from_mlx_layout(weights)
        if hasattr(model, "fit_to_checkpoint"):  # parts whose presence only the tensors tell (MTP layers)
            model.fit_to_checkpoint(weights)
        if more_weights is not None:
            more, more_sources = more_weights()
            weights.update(more)
            sources.update(more_sources)
        if quantization is not None:
            apply_to_load(model, quantization, weights)
    except LayoutError as e:
        raise ModelLoadError(f"{sources.get(e.tensor, path)}: {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if select is not None:
        keep = select(model)
        weights = {k: v for k, v in weights.items() if keep(k)}
    target = choose_dtype(dtype, stored)
    if before_weights is not None:
        before_weights(model, target)
    check_weights(model, weights, sources, path)
    weights = {k: v.astype(_dtype_of(model, k, target)) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    if quantization is not None and should_dequantize_dense(model, dequantize):
        dequantize_dense(model, target)
    stack_rows(model)  # linears that read one input, stacked in memory (never in the file)
    mx.eval(model.parameters())
    model.eval()
    model.verification = verification
    return model
