"""`strata convert`: any checkpoint strata reads -> strata's own on-disk format.

The output is a directory with config.json (marked `strata_format`, with `quantization` and
`quantization_config` blocks when quantized, and every hyperparameter strata read at the top level),
the sanitized parameters in mlx-lm's layout (model/layout.py `to_mlx_layout`) in one or more
safetensors shards (with model.safetensors.index.json when sharded), and the tokenizer files: what
mlx-lm's own converter writes, so mlx-lm loads it too. strata's loader only renames and reshapes
it back (`from_mlx_layout`), so nothing (Qwen3-Next's 1 + w norms, say) is ever applied twice.

Writing is atomic: everything goes into a hidden sibling directory (`.DST.partial-<pid>-<tag>`)
that is renamed into place only when complete, so an interrupted convert never leaves a destination
that loads. `--force` swaps it with the old DST in one step where the OS can (Linux
`renameat2(RENAME_EXCHANGE)`); elsewhere the old DST is first renamed to `.DST.old-<pid>-<tag>`,
and a convert killed between the two renames leaves that directory, which the next convert into the
same parent renames back. That next convert also removes the `.partial-`/`.old-` directories of
processes that are no longer running. The shards and experts/index.json get sha256s in
checksums.json (integrity.py), which loading checks. A write that fails (a full disk) is one
`ConvertWriteError` naming the destination's file and the cause, and leaves DST as it was.

A convert never writes a checkpoint that does not load: SRC must have a readable tokenizer.json
(checked before anything is written). A streamed SRC (`convert --stream`'s output) is read whole:
its experts come back from `experts/*.bin` (each record's crc32 checked), so it converts like any
other checkpoint, back to safetensors or streamed again.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import re
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tqdm import tqdm

from . import safe_files
from .experts.store import (
    INDEX_NAME,
    STREAM_DIR,
    ExpertStore,
    ExpertStoreError,
    expert_blocks,
    is_streamed,
    write_streamed_experts,
)
from .integrity import write_checksums
from .model.layout import to_mlx_layout
from .model.loader import (
    FORMAT_KEY,
    FORMAT_VERSION,
    ModelLoadError,
    load_model,
    read_config,
    read_header,
    weight_files,
)
from .model.quant import Quantization, quantize, recorded_quantization
from .options import ConvertOptions
from .tokenizer import Tokenizer

MAX_SHARD_BYTES = 2 << 30
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)
# safetensors header dtype -> strata dtype name, for "keep the checkpoint's dtype".
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ConvertError(Exception):
    """A conversion strata refuses before writing anything; the message says why."""


class ConvertWriteError(ConvertError, OSError):
    """A file of DST could not be written (a full disk); the message names it and the cause, and
    DST is as it was. An OSError too, with the failed write's `errno`."""

    def __init__(self, message: str, errno_: int | None):
        super().__init__(message)
        self.errno = errno_


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
    require_tokenizer: bool = True,
) -> ConvertResult:
    """Convert the checkpoint at `src` into strata's format at `dst`.

    Args:
        src: a checkpoint directory in any layout the loader reads, streamed or not.
        dst: the directory to create; it must not exist unless `options.force`.
        options: bits, group size, dtype, force (see `ConvertOptions`).
        max_shard_bytes: start a new safetensors shard beyond this size (default 2 GiB).
        show_progress: draw a tqdm bar over tensors on stderr (default False).
        require_tokenizer: refuse a SRC without a readable tokenizer.json (default True); False
            writes a model-only checkpoint, which `load_checkpoint` opens but `generate` cannot.

    Raises:
        ConvertError: DST exists (without force), is SRC or holds it, SRC is already quantized
            or has no readable tokenizer.json, or `options.stream` and SRC has no MoE experts
            (a dense model); or, as `ConvertWriteError`, a file of DST
            cannot be written (DST is left as it was).
        ModelLoadError: SRC cannot be read.
    """
    src, dst = Path(src), Path(dst)
    params = read_config(src)
    _check_destination(src, dst, force=options.force)
    if options.bits is not None and "quantization" in params:
        raise ConvertError(
            f"{src} is already quantized ({params['quantization']}); convert the unquantized checkpoint instead"
        )
    if require_tokenizer:
        _check_tokenizer(src, dst)
    dtype = options.dtype or stored_dtype_name(src)
    model = read_source(src, dtype=dtype)
    if options.stream and not expert_blocks(model):  # a dense model
        raise ConvertError(f"--stream: {src} ({params.get('model_type')}) has no MoE experts to stream; "
                           "convert it without --stream")
    # A source quantized outside MLX's block (GPT-OSS's published mxfp4 experts) is described
    # from its loaded layers, so the output's block names them.
    quantization = (_quantize(model, options) if options.bits is not None
                    else params.get("quantization") or recorded_quantization(model))

    dst.parent.mkdir(parents=True, exist_ok=True)
    repair_parent(dst.parent)
    staging = _sibling(dst, "partial")
    staging.mkdir()  # beside dst, so the final rename stays on one filesystem
    is_writing = True
    try:
        if options.stream:  # the experts go to experts/ and leave the model: the shards hold the rest
            with _writing(staging / STREAM_DIR):
                write_streamed_experts(model, staging)
        shards = _write_shards(model, staging, max_shard_bytes=max_shard_bytes, show_progress=show_progress)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                with _writing(staging / name):
                    shutil.copy2(src / name, staging / name)
        names = list(shards) + ([f"{STREAM_DIR}/{INDEX_NAME}"] if options.stream else [])
        write_checksums(staging, names)
        # config.json last: until it exists, not even the staging directory looks like a model.
        _write_config(staging, output_config(params, model.config, dtype=dtype, quantization=quantization))
        is_writing = False
        _move_into_place(staging, dst)
    except BaseException as e:
        failure = _write_failure(e, staging, dst) if isinstance(e, OSError) and is_writing else None
        shutil.rmtree(staging, ignore_errors=True)  # after the failure is described: its free space
        if failure is not None:
            raise failure from None
        raise
    return ConvertResult(
        path=dst,
        num_tensors=sum(len(names) for names in shards.values()),
        num_shards=len(shards),
        total_bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")),
        dtype=dtype,
        quantization=quantization,
    )


def read_source(src: Path, *, dtype: str):
    """The model in checkpoint `src`, whole: a streamed checkpoint's routed experts are read back
    from `experts/` and load as if its shards held them, so the model is the one its converter
    wrote (quantized experts included).

    Raises:
        ModelLoadError: SRC cannot be read (an expert record that fails its crc32 included).
    """
    if not is_streamed(src):
        return load_model(src, dtype=dtype)

    def experts() -> tuple[dict[str, mx.array], dict[str, Path]]:
        tensors, files = {}, {}
        try:
            with ExpertStore(src, io="buffered") as store:
                for path, block in store.blocks.items():
                    for name, stacked in _stacked_experts(store, path).items():
                        tensors[f"{path}.{name}"], files[f"{path}.{name}"] = stacked, block.file
        except ExpertStoreError as e:
            raise ModelLoadError(str(e)) from None
        return tensors, files

    return load_model(src, dtype=dtype, more_weights=experts)


def _stacked_experts(store: ExpertStore, path: str) -> dict[str, mx.array]:
    """Block `path`'s record tensors, each stacked over the experts: (E, ...), as stored."""
    block = store.blocks[path]
    buf = store.pools[block.stride].take()
    try:
        records = [store.to_arrays(path, store.read(path, e, buf), {}) for e in range(block.num_experts)]
    finally:
        store.pools[block.stride].give(buf)
    return {t.name: mx.stack([r[t.name] for r in records]) for t in block.tensors}


def _check_tokenizer(src: Path, dst: Path) -> None:
    """Refuse, before writing, a SRC whose DST would not load: generate needs tokenizer.json."""
    try:
        Tokenizer(src)
    except ModelLoadError as e:
        raise ConvertError(f"{e}; {dst} would not load without it, so nothing was written") from None


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Name `path` in an OSError that does not name its file (a failed write(2) does not); for a
    directory, the newest file in it: the one being written."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else []
            e.filename = str(max(files, key=lambda f: f.stat().st_mtime_ns) if files else path)
        raise


_SHARD = re.compile(r"shard-(\d{5})\.safetensors")


def _write_failure(e: OSError, staging: Path, dst: Path) -> ConvertWriteError:
    """"cannot write DST/config.json: no space left on device (0.0 MB free); DST was left as it
    was": the file by the name DST gives it (shards are named at the end), and the errno's text."""
    failed = Path(e.filename or staging)
    if not failed.is_relative_to(staging):
        where = str(failed)
    elif shard := _SHARD.fullmatch(failed.name):
        where = f"weight shard {int(shard[1]) + 1} of {dst}"
    else:
        where = str(dst / failed.relative_to(staging))
    cause = str(e)
    if e.errno is not None:
        cause = os.strerror(e.errno)
        cause = cause[:1].lower() + cause[1:]
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        cause += f" ({shutil.disk_usage(dst.parent).free / 1e6:.1f} MB free)"
    return ConvertWriteError(f"cannot write {where}: {cause}; {dst} was left as it was", e.errno)


def stored_dtype_name(path: Path) -> str:
    """The floating dtype most of a checkpoint's tensors are stored in, from the file headers."""
    counts = Counter()
    for f in weight_files(path):
        for name, entry in read_header(f).items():
            if name != "__metadata__" and entry.get("dtype") in STORED_DTYPES:
                counts[STORED_DTYPES[entry["dtype"]]] += 1
    return counts.most_common(1)[0][0] if counts else "float32"


def output_config(params: dict, model_config, *, dtype: str, quantization: dict | None) -> dict:
    """SRC's config.json with every field strata parsed (`model_config`) at the top level, where
    mlx-lm reads them (transformers 5 nests rope_theta in rope_parameters, for one), but for the
    config's `INTERNAL_FIELDS` (Nemotron-H's `layer_types`, pattern characters transformers and
    mlx-lm refuse there), its `WRITTEN_DEFAULTS` where SRC lacks them (GLM's `rope_scaling`, which
    mlx-lm requires and transformers 5 no longer writes), and the quantization recorded under
    both keys mlx-lm writes."""
    config = {k: v for k, v in params.items() if k not in ("quantization", "quantization_config", "torch_dtype")}
    internal = getattr(model_config, "INTERNAL_FIELDS", ())  # parsed into strata's own spelling: SRC's stays
    config.update({k: v for k, v in dataclasses.asdict(model_config).items() if v is not None and k not in internal})
    for key, value in getattr(model_config, "WRITTEN_DEFAULTS", {}).items():  # keys mlx-lm requires, if SRC lacks them
        config.setdefault(key, value)
    config.update({FORMAT_KEY: FORMAT_VERSION, "dtype": dtype})
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
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
    params = list(to_mlx_layout(dict(tree_flatten(model.parameters()))).items())
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
    # Through a Python file: MLX's own writer says only "[write] Unable to write N bytes to file."
    with _writing(path), open(path, "xb") as f:
        mx.save_safetensors(f, tensors, metadata={"format": "mlx", FORMAT_KEY: str(FORMAT_VERSION)})


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
        with _writing(out / "model.safetensors.index.json"):
            safe_files.write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    return shards


def _write_config(out: Path, config: dict) -> None:
    with _writing(out / "config.json"):
        safe_files.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")


def _move_into_place(staging: Path, dst: Path) -> None:
    """Put `staging` at `dst`; an existing `dst` is swapped out and removed after.

    With an atomic exchange there is no moment without a DST. Without one, a kill between the two
    renames leaves `.DST.old-<pid>-*` and no DST, which `repair_parent` renames back.
    """
    if not dst.exists():
        os.rename(staging, dst)
    elif exchange(staging, dst):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old DST
    else:
        old = _sibling(dst, "old")
        os.rename(dst, old)
        try:
            os.rename(staging, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        shutil.rmtree(old, ignore_errors=True)
    safe_files.sync_directory(dst.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS or the
    file system cannot, and then nothing has moved."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc before 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


_LEFTOVER = re.compile(r"^\.(?P<dst>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _sibling(dst: Path, kind: str) -> Path:
    """A hidden directory name beside `dst` that records this process, so a later convert can
    tell a dead run's leftovers from a running one's."""
    return dst.with_name(f".{dst.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def repair_parent(parent: Path) -> list[Path]:
    """Undo what killed converts left in `parent`: an `.X.old-*` whose X is missing is renamed back
    to X (the swap stopped halfway), every other `.partial-*`/`.old-*` of a process that is no
    longer running is removed. Returns the directories removed or restored."""
    touched = []
    for entry in sorted(parent.iterdir()):
        match = _LEFTOVER.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir() or _is_running(int(match["pid"])):
            continue
        target = parent / match["dst"]
        if match["kind"] == "old" and not target.exists() and not target.is_symlink():
            os.rename(entry, target)
        else:
            shutil.rmtree(entry, ignore_errors=True)
        touched.append(entry)
    return touched


def _is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
