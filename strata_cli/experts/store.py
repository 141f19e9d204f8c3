"""The streaming layout: routed experts on disk, one aligned record per expert, and its reader.

A streamed checkpoint is an ordinary strata checkpoint (config.json, dense safetensors) whose MoE
blocks keep their routed experts in `experts/` instead:

    experts/index.json         the layout, below
    experts/layer_003.bin      block 3's experts: record e at offset e * stride

Every record holds one expert's tensors back to back, as the model stores them (plain float, or
quantized `weight` + `scales` (+ `biases` in affine mode; mxfp4 has none), and a `bias` row per
projection where the experts have one), each at a 64-byte-aligned offset inside the record;
records start on `alignment`-byte boundaries (4096 by default) and are padded to a whole `stride`,
so a record is one O_DIRECT read. index.json:

    {"format": "strata-experts", "version": 2, "alignment": 4096, "checksum": "crc32",
     "num_experts": E,
     "blocks": [{"path": "model.layers.3.mlp.switch_mlp", "layer": 3, "file": "layer_003.bin",
                 "kind": "glu", "record_bytes": R, "stride": S,
                 "tensors": [{"name": "gate_proj.weight", "dtype": "uint32", "shape": [I, H/8],
                              "offset": 0, "nbytes": n}, ...],
                 "quantization": {"gate_proj": {"group_size": 64, "bits": 4, "mode": "affine"}, ...},
                 "records": [[offset, length, crc32], ...]}, ...]}

`crc32` covers a record's `length` payload bytes (not its padding).

`kind` names the experts' form, and so the projections a record holds (`KINDS`): "glu"
(SwiGLU or GPT-OSS's clamped form: `gate_proj`, `up_proj`, `down_proj`, a plain projection named
bare, `SwitchGLU`'s stacks, or `<proj>.weight`, biased experts' modules) or "relu2"
(down(relu²(up(x))): `fc1`, `fc2`, a plain projection named `<proj>.weight`, mlx-lm's
`SwitchMLP` names); a quantized projection is `<proj>.weight`/`.scales`/`.biases` in both, and
any projection may add its bias rows as `<proj>.bias`. Version 1 indexes have no `kind`: every
block is "glu".
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import safe_files
from ..integrity import IntegrityError, check_bytes

FORMAT = "strata-experts"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: written before record kinds, every block "glu"
STREAM_DIR = "experts"
INDEX_NAME = "index.json"
DEFAULT_ALIGNMENT = 4096  # a page and the usual logical block size: what O_DIRECT needs
TENSOR_ALIGN = 64  # tensors inside a record start on a cache line
IO_MODES = ("auto", "direct", "buffered")
GLU = ("gate_proj", "up_proj", "down_proj")
RELU2 = ("fc1", "fc2")
# record kind -> (its projections, the names a plain (unquantized) projection's tensor may take)
KINDS = {"glu": (GLU, ("{}", "{}.weight")), "relu2": (RELU2, ("{}.weight",))}

# dtype name -> (numpy dtype of the same width for the raw bytes, MLX dtype)
DTYPES = {
    "float32": (np.float32, mx.float32),
    "float16": (np.float16, mx.float16),
    "bfloat16": (np.uint16, mx.bfloat16),
    "uint32": (np.uint32, mx.uint32),
    "uint8": (np.uint8, mx.uint8),
    "int8": (np.int8, mx.int8),
}
_RAW_VIEW = {4: mx.uint32, 2: mx.uint16, 1: mx.uint8}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertStoreError(Exception):
    """A streamed-expert layout that cannot be used; the message names the file."""


class ExpertReadError(ExpertStoreError):
    """Reading one expert record failed (I/O error, short read, checksum); names file and expert."""


@dataclass(frozen=True)
class TensorSpec:
    name: str  # "gate_proj" (plain) or "gate_proj.weight" / ".scales" / ".biases" (quantized)
    dtype: str
    shape: tuple[int, ...]  # one expert's shape
    offset: int  # inside the record
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """One MoE block's records: same tensor layout for every expert."""

    path: str  # the expert stack's module path, e.g. "model.layers.3.mlp.switch_mlp"
    layer: int
    file: Path
    tensors: tuple[TensorSpec, ...]
    quantization: dict  # projection -> {"group_size", "bits", "mode"}; empty when plain float
    record_bytes: int
    stride: int
    records: tuple[tuple[int, int, int], ...]  # (offset, length, crc32) per expert
    kind: str = "glu"  # a key of KINDS

    @property
    def num_experts(self) -> int:
        return len(self.records)

    @property
    def projections(self) -> tuple[str, ...]:
        return KINDS[self.kind][0]

    def plain_name(self, proj: str) -> str:
        """The record tensor of unquantized projection `proj`: the name its kind allows that the
        record holds ("gate_proj", biased experts' "gate_proj.weight", "fc1.weight")."""
        names = [form.format(proj) for form in KINDS[self.kind][1]]
        return next((n for n in names if any(t.name == n for t in self.tensors)), names[0])


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _dtype_name(dtype: mx.Dtype) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise ExpertStoreError(f"expert tensors of dtype {name} are not supported ({', '.join(DTYPES)})")
    return name


def _host_bytes(array: mx.array) -> np.ndarray:
    """The raw bytes of an MLX array as a numpy array of the same shape (bfloat16 as uint16)."""
    return np.array(array.view(_RAW_VIEW[array.dtype.size]))


# -- writing ---------------------------------------------------------------------------------


class ExpertLayoutWriter:
    """Writes `experts/` one MoE block at a time (so a large model never sits in memory whole).

    Args:
        directory: the checkpoint directory; `experts/` is created inside it.
        num_experts: E, the same for every block.
        alignment: record alignment in bytes (default 4096; a power of two, at least 512).
    """

    def __init__(self, directory: str | Path, *, num_experts: int, alignment: int = DEFAULT_ALIGNMENT):
        if alignment < 512 or alignment & (alignment - 1):
            raise ExpertStoreError(f"alignment must be a power of two >= 512, got {alignment}")
        self.root = Path(directory) / STREAM_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_experts, self.alignment = num_experts, alignment
        self.blocks: list[dict] = []

    def add_block(
        self,
        path: str,
        tensors: Mapping[str, mx.array | np.ndarray],
        *,
        quantization: dict | None = None,
        layer: int | None = None,
        kind: str = "glu",
    ) -> None:
        """Write one block's experts.

        Args:
            path: the expert stack's module path the loader will replace.
            tensors: record tensor name -> (E, ...) array, in record order (MLX or numpy).
            quantization: projection -> {"group_size", "bits", "mode"} for quantized projections.
            layer: decoder layer index (default: read from `path`, "...layers.<i>...").
            kind: the experts' form, a key of KINDS (default "glu").
        """
        if kind not in KINDS:
            raise ExpertStoreError(f"{path}: unknown expert kind {kind!r} (known: {', '.join(KINDS)})")
        layer = layer_of(path) if layer is None else layer
        if layer < 0:
            raise ExpertStoreError(f"cannot tell the layer of {path!r}; pass layer=")
        specs, host, offset = [], [], 0
        for name, value in tensors.items():
            if value.shape[0] != self.num_experts:
                raise ExpertStoreError(f"{path}.{name} has {value.shape[0]} experts, expected {self.num_experts}")
            if isinstance(value, mx.array):
                dtype, raw = _dtype_name(value.dtype), _host_bytes(value)
            else:
                dtype = np.dtype(value.dtype).name
                if dtype not in DTYPES or dtype == "bfloat16":
                    raise ExpertStoreError(f"{path}.{name}: numpy dtype {dtype} is not supported")
                raw = np.ascontiguousarray(value)
            offset = _round_up(offset, TENSOR_ALIGN)
            nbytes = raw[0].nbytes
            specs.append(TensorSpec(name, dtype, tuple(value.shape[1:]), offset, nbytes))
            host.append(raw.reshape(self.num_experts, -1).view(np.uint8))
            offset += nbytes
        record_bytes = offset
        stride = _round_up(record_bytes, self.alignment)
        file_name = f"layer_{layer:03d}.bin"
        records = []
        record = np.zeros(stride, np.uint8)
        with open(self.root / file_name, "wb") as f:
            for e in range(self.num_experts):
                for spec, raw in zip(specs, host):
                    record[spec.offset : spec.offset + spec.nbytes] = raw[e]
                payload = memoryview(record)[:record_bytes]
                records.append([e * stride, record_bytes, zlib.crc32(payload)])
                f.write(record)
        self.blocks.append(
            {
                "path": path,
                "layer": layer,
                "file": file_name,
                "kind": kind,
                "record_bytes": record_bytes,
                "stride": stride,
                "tensors": [
                    {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
                    for s in specs
                ],
                "quantization": quantization or {},
                "records": records,
            }
        )

    def finish(self) -> Path:
        """Write index.json (blocks in layer order) and return its path."""
        index = {
            "format": FORMAT,
            "version": VERSION,
            "alignment": self.alignment,
            "checksum": "crc32",
            "num_experts": self.num_experts,
            "blocks": sorted(self.blocks, key=lambda b: b["layer"]),
        }
        path = self.root / INDEX_NAME
        safe_files.write_text(path, json.dumps(index, indent=1))
        return path


def expert_kind(module) -> str | None:
    """The record kind of a resident expert stack (its class's `expert_kind`: "glu" for
    `SwitchGLU` and GPT-OSS's biased experts, "relu2" for Nemotron-H's `SwitchMLP`), None for
    anything else."""
    kind = getattr(type(module), "expert_kind", None)
    return kind if kind in KINDS else None


def expert_blocks(model) -> list[tuple[str, object]]:
    """(path, expert stack) for every MoE block's routed experts, in layer order: the blocks say
    where theirs sit (`experts_attribute`), the stack is of a kind the layout stores."""
    found = [(f"{name}.{m.experts_attribute}", m[m.experts_attribute]) for name, m in model.named_modules()
             if getattr(type(m), "experts_attribute", None) and expert_kind(m[m.experts_attribute]) is not None]
    return sorted(found, key=lambda item: layer_of(item[0]))


def layer_of(path: str) -> int:
    """The decoder layer index in a module path ("model.layers.3.mlp" -> 3), -1 if none."""
    match = _LAYER.search(path + ".")
    return int(match.group(1)) if match else -1


def write_streamed_experts(model, directory: str | Path, *, alignment: int = DEFAULT_ALIGNMENT) -> Path:
    """Write every MoE block's routed experts of a loaded model into `directory/experts/`, and
    take them out of the model, so that its remaining parameters are the dense checkpoint.

    Experts are written as the model holds them: plain float, or quantized (`QuantizedSwitchGLU`,
    or `SwitchMLP` of `QuantizedExperts`: packed weight, scales and biases per projection;
    GPT-OSS's mxfp4 experts: weight and scales), with their bias rows where they have them, each
    block under its stack's record kind. The caller saves
    `model.parameters()` afterwards, in strata's format (config.json marked `strata_format`).

    Args:
        model: a loaded strata model (after sanitize and quantization); its expert stacks
            are replaced by empty modules.
        directory: the output checkpoint directory.
        alignment: record alignment in bytes (default 4096).

    Returns:
        The path of the written index.json.

    Raises:
        ExpertStoreError: the model has no MoE block, or an unsupported expert dtype.
    """
    blocks = expert_blocks(model)
    if not blocks:
        raise ExpertStoreError("the model has no MoE block: nothing to stream")
    writer = None
    for path, glu in blocks:
        tensors = dict(tree_flatten(glu.parameters()))
        if writer is None:
            num_experts = next(iter(tensors.values())).shape[0]
            writer = ExpertLayoutWriter(directory, num_experts=num_experts, alignment=alignment)
        kind = expert_kind(glu)
        quantization = {}
        for proj in KINDS[kind][0]:
            module = glu[proj]
            if hasattr(module, "group_size"):  # QuantizedExperts
                quantization[proj] = {"group_size": module.group_size, "bits": module.bits, "mode": module.mode}
        writer.add_block(path, tensors, quantization=quantization, kind=kind)
    modules = dict(model.named_modules())
    for path, _ in blocks:
        block, name = path.rsplit(".", 1)
        setattr(modules[block], name, nn.Module())  # the experts now live on disk
    return writer.finish()


# -- reading ---------------------------------------------------------------------------------


def is_streamed(path: str | Path) -> bool:
    """True when a checkpoint directory keeps its experts in the streaming layout."""
    return (Path(path) / STREAM_DIR / INDEX_NAME).is_file()


def read_index(directory: str | Path) -> tuple[dict, list[BlockLayout]]:
    """Parse and check `experts/index.json` against checksums.json, the record files' sizes and
    config.json's dtype (not the records' bytes: their crc32 is checked at each read).

    Raises:
        ExpertStoreError: naming the file and the field that is wrong.
    """
    root = Path(directory) / STREAM_DIR
    index_path = root / INDEX_NAME
    try:
        raw = index_path.read_bytes()
        check_bytes(directory, f"{STREAM_DIR}/{INDEX_NAME}", raw)
        index = json.loads(raw)
    except FileNotFoundError:
        raise ExpertStoreError(f"{index_path}: missing (not a streamed checkpoint)") from None
    except IntegrityError as e:
        raise ExpertStoreError(str(e)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExpertStoreError(f"{index_path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ExpertStoreError(f"{index_path}: not a {FORMAT} index")
    version = index.get("version")
    if version not in READABLE_VERSIONS:
        raise ExpertStoreError(f"{index_path}: version {version!r}, this strata reads "
                               f"{' and '.join(str(v) for v in READABLE_VERSIONS)}")
    try:
        blocks = [
            BlockLayout(
                path=b["path"],
                layer=int(b["layer"]),
                file=root / b["file"],
                tensors=tuple(
                    TensorSpec(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]), int(t["offset"]),
                               int(t["nbytes"]))
                    for t in b["tensors"]
                ),
                quantization=dict(b.get("quantization") or {}),
                record_bytes=int(b["record_bytes"]),
                stride=int(b["stride"]),
                records=tuple((int(o), int(n), int(c)) for o, n, c in b["records"]),
                kind=b["kind"] if version >= 2 else b.get("kind", "glu"),
            )
            for b in index["blocks"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ExpertStoreError(f"{index_path}: malformed ({type(e).__name__}: {e})") from None
    check_layout_sanity(index_path, index, blocks, stored_dtype=_config_dtype(directory))
    return index, blocks


def _config_dtype(directory: str | Path) -> str | None:
    """config.json's `dtype` (strata convert records the dtype it stored), if it has one."""
    try:
        value = json.loads((Path(directory) / "config.json").read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if value in DTYPES else None


def check_layout_sanity(index_path: Path, index: dict, blocks: list[BlockLayout], *, stored_dtype: str | None) -> None:
    """Every number in the index agrees with every other and with the config, so a record that is
    read is exactly the bytes its tensors say, interpreted as they were written (whether the
    records fit their files is checked when the files are opened).

    Raises:
        ExpertStoreError: naming `index_path`, the block and the field.
    """
    def bad(where: str, message: str) -> ExpertStoreError:
        return ExpertStoreError(f"{index_path}: {where}: {message}")

    alignment, num_experts = index.get("alignment"), index.get("num_experts")
    if not isinstance(alignment, int) or alignment < TENSOR_ALIGN or alignment & (alignment - 1):
        raise bad("alignment", f"{alignment!r} is not a power of two of at least {TENSOR_ALIGN}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise bad("num_experts", f"{num_experts!r} is not a positive integer")
    seen_files = set()
    for block in blocks:
        name = block.path
        if block.file.parent != index_path.parent or block.file.name in ("", ".", "..", INDEX_NAME):
            raise bad(f"{name}.file", f"{block.file.name!r} is not a file name inside {STREAM_DIR}/")
        if block.file in seen_files:
            raise bad(f"{name}.file", f"{block.file.name} is already another block's file")
        seen_files.add(block.file)
        if block.kind not in KINDS or (index.get("version") == 1 and block.kind != "glu"):
            raise bad(f"{name}.kind", f"{block.kind!r} is not a record kind of version {index.get('version')} "
                                      f"(known: {', '.join(KINDS)})")
        check_record_tensors(block, bad)
        if block.stride < block.record_bytes or block.stride % alignment:
            raise bad(f"{name}.stride", f"{block.stride} must be a multiple of {alignment} and hold "
                                        f"record_bytes {block.record_bytes}")
        end = 0
        for t in sorted(block.tensors, key=lambda t: t.offset):
            where = f"{name}.tensors[{t.name}]"
            if t.dtype not in DTYPES:
                raise bad(f"{where}.dtype", f"unsupported dtype {t.dtype}")
            if any(d < 0 for d in t.shape):
                raise bad(f"{where}.shape", f"{list(t.shape)} has a negative dimension")
            itemsize = np.dtype(DTYPES[t.dtype][0]).itemsize
            if t.nbytes != math.prod(t.shape) * itemsize:
                raise bad(f"{where}.nbytes", f"{t.nbytes}, but {t.dtype} x {list(t.shape)} is "
                                             f"{math.prod(t.shape) * itemsize} bytes")
            if t.offset % TENSOR_ALIGN or t.offset < end:
                raise bad(f"{where}.offset", f"{t.offset} is not {TENSOR_ALIGN}-byte aligned after the previous "
                                             f"tensor's end ({end})")
            end = t.offset + t.nbytes
            if end > block.record_bytes:
                raise bad(f"{where}.offset", f"{t.offset} + {t.nbytes} bytes lies outside the record "
                                             f"({block.record_bytes} bytes)")
            expected = _expected_dtype(t.name, block.quantization, stored_dtype)
            if expected is not None and t.dtype != expected:
                raise bad(f"{where}.dtype", f"{t.dtype}, but the checkpoint stores {expected} (config.json dtype "
                                            f"{stored_dtype})")
        if len(block.records) != num_experts:
            raise bad(f"{name}.records", f"{len(block.records)} records, num_experts is {num_experts}")
        offsets = sorted((o, e) for e, (o, _, _) in enumerate(block.records))
        for (o, e), (o_next, _) in zip(offsets, offsets[1:] + [(None, None)]):
            where = f"{name}.records[{e}]"
            if o < 0 or o % alignment:
                raise bad(where, f"offset {o} is not a multiple of the alignment {alignment}")
            if o_next is not None and o + block.stride > o_next:
                raise bad(where, f"offset {o} overlaps the next record at {o_next} (stride {block.stride})")
        for e, (o, length, _) in enumerate(block.records):
            if length != block.record_bytes:
                raise bad(f"{name}.records[{e}]", f"length {length}, record_bytes is {block.record_bytes}")


def check_record_tensors(block: BlockLayout, bad) -> None:
    """The record holds exactly its kind's projections: each plain, or quantized (weight and
    scales, biases where the mode has them), as `quantization` says, with or without its bias
    rows; `bad(where, message)` builds the error."""
    want, may = set(), set()
    for proj in block.projections:
        q = block.quantization.get(proj)
        want |= {f"{proj}.weight", f"{proj}.scales"} if q else {block.plain_name(proj)}
        may |= {f"{proj}.biases", f"{proj}.bias"} if q else {f"{proj}.bias"}
    unknown = sorted(set(block.quantization) - set(block.projections))
    if unknown:
        raise bad(f"{block.path}.quantization", f"{unknown[0]} is not a projection of a {block.kind} record")
    have = {t.name for t in block.tensors}
    missing, extra = sorted(want - have), sorted(have - want - may)
    if missing or extra:
        raise bad(f"{block.path}.tensors", f"a {block.kind} record needs {sorted(want)}" +
                  (f"; {missing[0]} is missing" if missing else "") + (f"; {extra[0]} is not one" if extra else ""))


def check_file_size(block: BlockLayout) -> None:
    """The block's file exists and holds every record the index places in it.

    Raises:
        ExpertStoreError: missing, or truncated (naming the first expert cut off).
    """
    try:
        size = block.file.stat().st_size
    except FileNotFoundError:
        raise ExpertStoreError(f"{block.file}: missing (listed in {STREAM_DIR}/{INDEX_NAME})") from None
    need = max(o + block.stride for o, _, _ in block.records)
    if size < need:
        first_bad = next(e for e, (o, _, _) in enumerate(block.records) if o + block.stride > size)
        raise ExpertStoreError(
            f"{block.file}: truncated ({size} bytes, the index needs {need}); "
            f"expert {first_bad} of {block.path} and later are cut off"
        )


def corrupt_records(block: BlockLayout) -> list[int]:
    """The experts of `block` whose payload's crc32 differs from the index's: every record read
    once, in file order, and checked as `ExpertStore.read` checks it (`strata verify`).

    Raises:
        ExpertStoreError: the file is missing or truncated.
        OSError: it cannot be read.
    """
    check_file_size(block)
    bad = []
    with open(block.file, "rb") as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for offset, e in sorted((o, e) for e, (o, _, _) in enumerate(block.records)):
            _, length, crc = block.records[e]
            f.seek(offset)
            if zlib.crc32(f.read(length)) != crc:
                bad.append(e)
    return sorted(bad)


def _expected_dtype(tensor: str, quantization: dict, stored_dtype: str | None) -> str | None:
    proj, _, part = tensor.partition(".")
    if proj in quantization and part == "weight":
        return "uint32"
    if proj in quantization and part == "scales" and quantization[proj].get("mode") == "mxfp4":
        return "uint8"  # a power-of-two exponent per group
    return stored_dtype


class BufferPool:
    """Page-aligned read buffers (anonymous mmaps, as O_DIRECT needs), reused across reads."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)


class ExpertStore:
    """Reads expert records of a streamed checkpoint with `os.preadv` (thread-safe).

    Args:
        directory: the checkpoint directory (holding `experts/index.json`).
        io: "auto" (default: O_DIRECT where the file system allows it, else the page cache),
            "direct" (O_DIRECT or an error) or "buffered" (the page cache).
        verify: check each record's crc32 after reading it (default True).
        holds: which blocks (by module path) to open and serve; default None: every block. A
            pipeline stage (distributed.py) opens only the blocks of its own layers.

    Raises:
        ExpertStoreError: a malformed index, a missing or truncated record file, or O_DIRECT
            refused with io="direct".
    """

    def __init__(self, directory: str | Path, *, io: str = "auto", verify: bool = True,
                 holds: Callable[[str], bool] | None = None):
        if io not in IO_MODES:
            raise ExpertStoreError(f"io must be one of {IO_MODES}, got {io!r}")
        self.root = Path(directory) / STREAM_DIR
        self.index, blocks = read_index(directory)
        if holds is not None:
            blocks = [b for b in blocks if holds(b.path)]
        self.alignment = int(self.index["alignment"])
        self.num_experts = int(self.index["num_experts"])
        self.blocks = {b.path: b for b in blocks}
        self.verify = verify
        self._fds: dict[str, int] = {}
        self._direct: dict[str, bool] = {}
        self._lock = threading.Lock()
        self.pools = {}
        try:
            for b in blocks:
                self._open(b, io)
                self.pools.setdefault(b.stride, BufferPool(b.stride))
        except BaseException:
            self.close()
            raise

    @property
    def io_mode(self) -> str:
        """"direct", "buffered", or "mixed" (some files refused O_DIRECT)."""
        modes = set(self._direct.values())
        return "mixed" if len(modes) > 1 else ("direct" if modes == {True} else "buffered")

    def _open(self, block: BlockLayout, io: str) -> None:
        check_file_size(block)
        fd, direct = None, False
        can_direct = hasattr(os, "O_DIRECT") and self.alignment % 512 == 0
        if io in ("auto", "direct") and can_direct:
            try:
                fd, direct = os.open(block.file, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if io == "direct":
                    raise ExpertStoreError(f"{block.file}: O_DIRECT refused ({e.strerror})") from None
        elif io == "direct":
            raise ExpertStoreError(f"{block.file}: O_DIRECT is not available on this system")
        if fd is None:
            fd = self._open_buffered(block.file)
        self._fds[block.path], self._direct[block.path] = fd, direct

    @staticmethod
    def _open_buffered(file: Path) -> int:
        fd = os.open(file, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # expert reads are random: kernel read-ahead only wastes
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def read(self, path: str, expert: int, buf: mmap.mmap) -> memoryview:
        """Read expert `expert` of block `path` into `buf` (a buffer of the block's stride).

        Returns:
            A view of the record's payload bytes inside `buf`.

        Raises:
            ExpertReadError: an I/O error, a short read or a checksum mismatch, naming the file
                and the expert.
        """
        block = self.blocks[path]
        offset, length, crc = block.records[expert]
        view = memoryview(buf)[: block.stride]
        try:
            got = os.preadv(self._fds[path], [view], offset)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EFAULT) and self._direct[path]:
                # accepted at open, refused at read: some file systems (EINVAL), or a buffer the
                # kernel cannot pin for DMA, as CUDA managed memory may be (EFAULT)
                self._fallback_buffered(block)
                return self.read(path, expert, buf)
            raise ExpertReadError(
                f"{block.file}: read of expert {expert} of {block.path} failed ({e.strerror or e})"
            ) from None
        if got < length:
            raise ExpertReadError(
                f"{block.file}: short read of expert {expert} of {block.path}: "
                f"{got} of {length} bytes at offset {offset}"
            )
        payload = view[:length]
        if self.verify and zlib.crc32(payload) != crc:
            raise ExpertReadError(
                f"{block.file}: checksum mismatch in expert {expert} of {block.path} "
                f"(crc32 {zlib.crc32(payload):#010x}, the index says {crc:#010x})"
            )
        return payload

    def _fallback_buffered(self, block: BlockLayout) -> None:
        with self._lock:
            if self._direct[block.path]:
                old = self._fds[block.path]
                self._fds[block.path], self._direct[block.path] = self._open_buffered(block.file), False
                os.close(old)

    def to_arrays(self, path: str, payload: memoryview, dtypes: Mapping[str, mx.Dtype]) -> dict[str, mx.array]:
        """One record's tensors as MLX arrays (copied out of `payload` at once), cast to `dtypes[name]`."""
        return self.tensor_views(path, mx.array(np.frombuffer(payload, dtype=np.uint8)), dtypes)

    def tensor_views(self, path: str, record: mx.array, dtypes: Mapping[str, mx.Dtype]) -> dict[str, mx.array]:
        """One record's tensors as views of `record` (the record's bytes as an MLX uint8 array,
        experts/staging.py, or `to_arrays`' copy of a payload), cast to `dtypes[name]`."""
        out = {}
        for t in self.blocks[path].tensors:
            mx_dtype = DTYPES[t.dtype][1]
            array = record[t.offset : t.offset + t.nbytes].view(mx_dtype).reshape(t.shape)
            want = dtypes.get(t.name, mx_dtype)
            out[t.name] = array if want == mx_dtype else array.astype(want)
        return out

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

