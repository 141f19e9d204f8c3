"""Session files: committed-state checkpoints on disk, for `serve-stdio --session FILE`.

A session file is a safetensors file. Its tensors are each checkpoint's token ids (`tokens.<c>`)
and every distinct array of the engine snapshots (`array.<k>`); its metadata names the format and
version, the model's identity, the compute dtype, the layer-state layout, each checkpoint's
length and slots (which array, int or null fills each slot of each layer's snapshot), and a
SHA-256 checksum over all of that and every tensor's bytes. A file that fails any check is
refused with a `SessionError` that says why; it is never partly used. Writes go through
safe_files.py: an exclusively created temporary file in the same directory, synced, then renamed
over the target, so a link planted at either name is never followed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from ..engine.window import Snapshot
from ..safe_files import atomic_writer
from .checkpoints import Checkpoint

FORMAT = "strata-session"
VERSION = 1


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
    with atomic_writer(file) as f:
        mx.save_safetensors(f, arrays, metadata=metadata)


def load_session(
    file: str | Path, *, identity: str, dtype: str, layout: Sequence[str], max_context: int, vocab_size: int
) -> list[Checkpoint]:
    """Read and check a session file written by `save_session`.

    Args:
        file: the session file.
        identity, dtype, layout: what the running engine has; each must match the file's.
        max_context: the engine's context; a longer state is refused.
        vocab_size: token ids must lie below it.

    Returns:
        The checkpoints, in the order they were saved.

    Raises:
        SessionError: unreadable, another format or version, a checksum mismatch, another model,
            dtype or layer layout, or token ids that do not fit.
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
        checkpoints = []
        for c, entry in enumerate(json.loads(metadata["checkpoints"])):
            tokens = tuple(arrays[f"tokens.{c}"].tolist())
            checkpoints.append(Checkpoint(tokens, _unflatten(entry["slots"], arrays, int(entry["length"]))))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise SessionError(f"session {file}: malformed state ({type(e).__name__}: {e})") from None
    for checkpoint in checkpoints:
        tokens = checkpoint.tokens
        if checkpoint.snapshot.length != len(tokens) or not 0 < len(tokens) <= max_context:
            raise SessionError(
                f"session {file}: holds {len(tokens)} tokens for {checkpoint.snapshot.length} positions "
                f"(the context holds {max_context})"
            )
        if not all(0 <= t < vocab_size for t in tokens):
            raise SessionError(f"session {file}: token ids outside the vocabulary of {vocab_size}")
    return checkpoints


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


def _unflatten(slots: list[list], arrays: dict[str, mx.array], length: int) -> Snapshot:
    def slot(value):
        if value is None:
            return None
        return arrays[value["array"]] if "array" in value else int(value["int"])

    return Snapshot(length, tuple(tuple(slot(v) for v in layer) for layer in slots))


def _checksum(metadata: dict[str, str], arrays: dict[str, mx.array]) -> str:
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        digest.update(memoryview(a).tobytes())
    return digest.hexdigest()
