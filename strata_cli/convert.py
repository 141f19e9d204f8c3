"""`strata convert`: any checkpoint strata reads -> strata's own on-disk format.

The output is a directory with config.json (marked `strata_format`, with a `quantization` block
when quantized), the sanitized parameters under the model's own names in one or more safetensors
shards (with model.safetensors.index.json when sharded), and the tokenizer files. The loader
applies no transform to it, so nothing (Qwen3-Next's 1 + w norms, say) is ever applied twice.

Writing is atomic: everything goes into a hidden sibling directory that is renamed into place
only when complete, so an interrupted convert never leaves a destination that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tqdm import tqdm

from .experts.store import write_streamed_experts
from .model.loader import (
    FORMAT_KEY,
    FORMAT_VERSION,
    load_model,
    read_config,
    read_header,
    weight_files,
)
from .model.quant import Quantization, quantize
from .options import ConvertOptions

MAX_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)
# safetensors header dtype -> strata dtype name, for "keep the checkpoint's dtype".
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ConvertError(Exception):
    """A conversion strata refuses before writing anything; the message says why."""


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    num_tensors: int
    num_shards: int
    total_bytes: int
    dtype: str
    quantization: dict | None


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    options: ConvertOptions,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    show_progress: bool = False,
) -> ConvertResult:
    """Convert the checkpoint at `src` into strata's format at `dst`.

    Args:
        src: a checkpoint directory in any layout the loader reads.
        dst: the directory to create; it must not exist unless `options.force`.
        options: bits, group size, dtype, force (see `ConvertOptions`).
        max_shard_bytes: start a new safetensors shard beyond this size (default 2 GiB).
        show_progress: draw a tqdm bar over tensors on stderr (default False).

    Raises:
        ConvertError: DST exists (without force), is SRC or holds it, or SRC is already quantized.
        ModelLoadError: SRC cannot be read.
    """
    src, dst = Path(src), Path(dst)
    params = read_config(src)
    _check_destination(src, dst, force=options.force)
    if options.bits is not None and "quantization" in params:
        raise ConvertError(
            f"{src} is already quantized ({params['quantization']}); convert the unquantized checkpoint instead"
        )
    dtype = options.dtype or stored_dtype_name(src)
    model = load_model(src, dtype=dtype)
    quantization = _quantize(model, options) if options.bits is not None else params.get("quantization")

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(f".{dst.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir()  # beside dst, so the final rename stays on one filesystem
    try:
        if options.stream:  # the experts go to experts/ and leave the model: the shards hold the rest
            write_streamed_experts(model, staging)
        shards = _write_shards(model, staging, max_shard_bytes=max_shard_bytes, show_progress=show_progress)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, staging / name)
        # config.json last: until it exists, not even the staging directory looks like a model.
        _write_config(staging, output_config(params, dtype=dtype, quantization=quantization))
        _move_into_place(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConvertResult(
        path=dst,
        num_tensors=sum(len(names) for names in shards.values()),
        num_shards=len(shards),
        total_bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")),
        dtype=dtype,
        quantization=quantization,
    )


def stored_dtype_name(path: Path) -> str:
    """The floating dtype most of a checkpoint's tensors are stored in, from the file headers."""
    counts = Counter()
    for f in weight_files(path):
        for name, entry in read_header(f).items():
            if name != "__metadata__" and entry.get("dtype") in STORED_DTYPES:
                counts[STORED_DTYPES[entry["dtype"]]] += 1
    return counts.most_common(1)[0][0] if counts else "float32"


def output_config(params: dict, *, dtype: str, quantization: dict | None) -> dict:
    config = {k: v for k, v in params.items() if k not in ("quantization", "quantization_config", "torch_dtype")}
    config.update({FORMAT_KEY: FORMAT_VERSION, "dtype": dtype})
    if quantization is not None:
        config["quantization"] = quantization
    return dict(sorted(config.items()))


def _check_destination(src: Path, dst: Path, *, force: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ConvertError(f"destination {dst} is the source checkpoint; choose another directory")
    if dst.resolve() in src.resolve().parents:
        raise ConvertError(f"destination {dst} contains the source checkpoint {src}; choose another directory")
    if dst.exists() or dst.is_symlink():
        if not force:
            raise ConvertError(f"destination {dst} already exists; pass --force to replace it")
        if not dst.is_dir() or dst.is_symlink():
            raise ConvertError(f"destination {dst} exists and is not a directory; remove it first")


def _quantize(model, options: ConvertOptions) -> dict:
    overrides = model.quant_overrides(options.group_size) if hasattr(model, "quant_overrides") else None
    quantization: Quantization = quantize(model, group_size=options.group_size, bits=options.bits, overrides=overrides)
    return quantization.to_config()


def _write_shards(model, out: Path, *, max_shard_bytes: int, show_progress: bool) -> dict[str, list[str]]:
    """Save every parameter, shard by shard; returns shard file name -> tensor names."""
    params = tree_flatten(model.parameters())
    pending: dict[str, mx.array] = {}
    written: list[list[str]] = []
    size = 0

    with tqdm(total=len(params), unit="tensor", desc="converting", file=sys.stderr, disable=not show_progress) as bar:
        for name, value in params:
            mx.eval(value)  # quantizing and casting happen here, one tensor at a time
            if pending and size + value.nbytes > max_shard_bytes:
                _save_shard(out / f"shard-{len(written):05d}.safetensors", pending)
                written.append(list(pending))
                pending, size = {}, 0
            pending[name] = value
            size += value.nbytes
            bar.update(1)
        _save_shard(out / f"shard-{len(written):05d}.safetensors", pending)
        written.append(list(pending))
    return _name_shards(out, written)


def _save_shard(path: Path, tensors: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx", FORMAT_KEY: str(FORMAT_VERSION)})


def _name_shards(out: Path, written: list[list[str]]) -> dict[str, list[str]]:
    n = len(written)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, name in enumerate(names):
        os.replace(out / f"shard-{i:05d}.safetensors", out / name)
    shards = dict(zip(names, written))
    if n > 1:
        index = {
            "metadata": {"total_size": sum((out / name).stat().st_size for name in names)},
            "weight_map": {tensor: name for name, tensors in shards.items() for tensor in tensors},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return shards


def _write_config(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _move_into_place(staging: Path, dst: Path) -> None:
    """Rename `staging` to `dst`; an existing `dst` is swapped out first and removed after."""
    if not dst.exists():
        os.replace(staging, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(dst, old)
    try:
        os.replace(staging, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
