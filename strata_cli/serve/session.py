"""Session files: committed-state checkpoints on disk, for `serve-stdio --session FILE`.

A session file is a safetensors file. Its tensors are each checkpoint's token ids (`tokens.<c>`)
and every distinct array of the engine snapshots (`array.<k>`); its metadata names the format and
version, the model's identity, the compute dtype, the layer-state layout, each checkpoint's
length and slots (which array, int or null fills each slot of each layer's snapshot), and a
SHA-256 checksum over all of that and every tensor's bytes. The checksum catches corruption, not
forgery (anyone who can write the file can recompute it), so loading also checks every key, slot,
array shape and dtype against the model (`WindowEngine.check_snapshot`) before anything is used.
A file that fails any check is refused with a `SessionError` that says why; it is never partly
used. Writes go through safe_files.py: an exclusively created temporary file in the same
directory, synced, then renamed over the target, so a link planted at either name is never
followed; the file holds prompts and answers, so it is created 0600 and keeps an existing file's
mode.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

from ..engine.window import Snapshot
from ..safe_files import atomic_writer
from .checkpoints import Checkpoint

FORMAT = "strata-session"
VERSION = 1
METADATA_KEYS = frozenset({"format", "version", "model", "dtype", "layout", "checkpoints", "checksum"})


class SessionError(ValueError):
    """A session file that cannot be used (corrupt, another model, another format)."""


def save_session(
    file: str | Path, checkpoints: Sequence[Checkpoint], *, identity: str, dtype: str, layout: Sequence[str]
) -> None:
    """Write `checkpoints` to `file` atomically; an array several snapshots share is stored once.

    Args:
        file: the session file (any name; it is a safetensors file).
        checkpoints: committed states and the token ids each holds, least recently used first.
        identity: the identity of the model that computed the states (`Runtime.identity`).
        dtype: the compute dtype (state arrays are only valid in it).
        layout: the engine's per-layer state type names, in layer order.
    """
    file = Path(file)
    arrays: dict[str, mx.array] = {}
    index: dict[int, str] = {}  # id(array) -> tensor name
    entries = []
    for c, checkpoint in enumerate(checkpoints):
        arrays[f"tokens.{c}"] = mx.array(list(checkpoint.tokens), dtype=mx.int32)
        entries.append({"length": checkpoint.length, "slots": _flatten(checkpoint.snapshot, arrays, index)})
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "model": identity,
        "dtype": dtype,
        "layout": json.dumps(list(layout)),
        "checkpoints": json.dumps(entries),
    }
    metadata["checksum"] = _checksum(metadata, arrays)
    with atomic_writer(file, private=True) as f:  # prompts and answers: 0600, or the file's own mode
        mx.save_safetensors(f, arrays, metadata=metadata)


def load_session(
    file: str | Path,
    *,
    identity: str,
    dtype: str,
    layout: Sequence[str],
    max_context: int,
    vocab_size: int,
    check: Callable[[Snapshot], None] | None = None,
) -> list[Checkpoint]:
    """Read and check a session file written by `save_session`.

    Args:
        file: the session file.
        identity, dtype, layout: what the running engine has; each must match the file's.
        max_context: the engine's context; a longer state is refused.
        vocab_size: token ids must lie below it.
        check: the engine's `check_snapshot`, called on every checkpoint's state (raises
            `SnapshotError` or another ValueError for one the model cannot have made); default
            None checks the file's own structure only.

    Returns:
        The checkpoints, in the order they were saved.

    Raises:
        SessionError: unreadable, another format or version, a checksum mismatch, another model,
            dtype or layer layout, an unknown key, a tensor or slot of the wrong kind, shape or
            dtype, or token ids that do not fit.
    """
    file = Path(file)
    try:
        arrays, metadata = mx.load(str(file), format="safetensors", return_metadata=True)
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError, OSError) as e:
        raise SessionError(f"session {file}: not a readable session file ({e})") from None
    if metadata.get("format") != FORMAT:
        raise SessionError(f"session {file}: not a strata session file (format {metadata.get('format')!r})")
    if metadata.get("version") != str(VERSION):
        raise SessionError(
            f"session {file}: format version {metadata.get('version')!r}, this strata reads version {VERSION}"
        )
    if metadata.get("checksum") != _checksum({k: v for k, v in metadata.items() if k != "checksum"}, arrays):
        raise SessionError(f"session {file}: checksum mismatch (the file is corrupt)")
    saved_by = metadata.get("model", "")
    if saved_by != identity:
        raise SessionError(
            f"session {file}: saved by another model or other weights (identity {saved_by[:12]!r}, this model's "
            f"weights are {identity[:12]!r}); remove the file or pass another --session"
        )
    if metadata.get("dtype") != dtype:
        raise SessionError(f"session {file}: computed in {metadata.get('dtype')}, this engine runs {dtype}")
    if metadata.get("layout") != json.dumps(list(layout)):
        raise SessionError(f"session {file}: layer states {metadata.get('layout')} differ from this engine's {list(layout)}")
    try:
        checkpoints = _read_checkpoints(metadata, arrays)
    except _Malformed as e:
        raise SessionError(f"session {file}: {e}") from None
    for c, checkpoint in enumerate(checkpoints):
        tokens = checkpoint.tokens
        if checkpoint.snapshot.length != len(tokens) or not 0 < len(tokens) <= max_context:
            raise SessionError(
                f"session {file}: holds {len(tokens)} tokens for {checkpoint.snapshot.length} positions "
                f"(the context holds {max_context})"
            )
        if not all(0 <= t < vocab_size for t in tokens):
            raise SessionError(f"session {file}: token ids outside the vocabulary of {vocab_size}")
        if check is not None:
            try:
                check(checkpoint.snapshot)
            except ValueError as e:
                raise SessionError(f"session {file}: checkpoint {c} ({len(tokens)} tokens): {e}") from None
    return checkpoints


class _Malformed(Exception):
    """A key, tensor or slot of the wrong kind; the message says which."""


def _read_checkpoints(metadata: dict[str, str], arrays: dict[str, mx.array]) -> list[Checkpoint]:
    """The checkpoints the metadata lists, every tensor used by one and every key known (the
    states' layers and slots are the engine's to check: `WindowEngine.check_snapshot`).

    Raises:
        _Malformed: an unknown metadata key or tensor, a missing or odd tensor, or an entry or
            slot of the wrong form.
    """
    unknown = sorted(set(metadata) - METADATA_KEYS)
    if unknown:
        raise _Malformed(f"unknown metadata keys {unknown}")
    try:
        entries = json.loads(metadata["checkpoints"])
    except (KeyError, ValueError) as e:
        raise _Malformed(f"no readable checkpoint list ({type(e).__name__}: {e})") from None
    if not isinstance(entries, list):
        raise _Malformed("the checkpoint list is not a list")
    used: set[str] = set()
    checkpoints = []
    for c, entry in enumerate(entries):
        where = f"checkpoint {c}"
        if not isinstance(entry, dict) or set(entry) != {"length", "slots"}:
            fields = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise _Malformed(f"{where}: fields {fields}, a checkpoint has exactly length and slots")
        name = f"tokens.{c}"
        tokens = arrays.get(name)
        if tokens is None:
            raise _Malformed(f"{where}: no tensor {name}")
        if tokens.dtype != mx.int32 or tokens.ndim != 1:
            raise _Malformed(f"{name}: {str(tokens.dtype).rsplit('.', 1)[-1]} of shape {tuple(tokens.shape)}, "
                             "token ids are 1-D int32")
        used.add(name)
        length, slots = entry["length"], entry["slots"]
        if type(length) is not int:
            raise _Malformed(f"{where}: length {length!r} is not an integer")
        if not isinstance(slots, list) or not all(isinstance(layer, list) for layer in slots):
            raise _Malformed(f"{where}: slots are not a list of layers")
        states = tuple(
            tuple(_slot(value, arrays, used, f"{where} layer {i} slot {j}") for j, value in enumerate(layer))
            for i, layer in enumerate(slots)
        )
        checkpoints.append(Checkpoint(tuple(tokens.tolist()), Snapshot(length, states)))
    extra = sorted(set(arrays) - used)
    if extra:
        raise _Malformed(f"tensors no checkpoint uses: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
    return checkpoints


def _slot(value, arrays: dict[str, mx.array], used: set[str], where: str):
    """One slot's JSON form -> its value: {"array": "array.<k>"}, {"int": n} or null."""
    if value is None:
        return None
    if isinstance(value, dict) and len(value) == 1:
        (kind, v), = value.items()
        if kind == "array" and isinstance(v, str) and v.startswith("array.") and v in arrays:
            used.add(v)
            return arrays[v]
        if kind == "int" and type(v) is int:
            return v
    raise _Malformed(f"{where}: {json.dumps(value)[:80]} is not a slot "
                     '({"array": a stored array}, {"int": an integer} or null)')


def _flatten(snapshot: Snapshot, arrays: dict[str, mx.array], index: dict[int, str]) -> list[list]:
    """Snapshot -> per layer, each slot's JSON form: {"array": name}, {"int": n} or None."""
    slots = []
    for i, state in enumerate(snapshot.states):
        layer = []
        for j, value in enumerate(state):
            if isinstance(value, mx.array):
                if id(value) not in index:
                    index[id(value)] = f"array.{len(index)}"
                    arrays[index[id(value)]] = mx.contiguous(value)
                layer.append({"array": index[id(value)]})
            elif isinstance(value, int) and not isinstance(value, bool):
                layer.append({"int": value})
            elif value is None:
                layer.append(None)
            else:
                raise TypeError(f"layer {i} slot {j}: cannot save a {type(value).__name__}")
        slots.append(layer)
    return slots


def _checksum(metadata: dict[str, str], arrays: dict[str, mx.array]) -> str:
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        digest.update(memoryview(a).tobytes())
    return digest.hexdigest()
