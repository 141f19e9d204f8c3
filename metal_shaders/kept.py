"""What strata's kernels keep across processes: compiled kernel binaries and probe verdicts,
each a file named by the hash of everything it depends on.

The directory is set by the program (`configure`, strata_cli/kernel_cache.py: the user cache,
one directory per MLX version and GPU); unset (tests, scripts), nothing is kept and every
process compiles and probes as before. A file's own record of its keys is compared with the
asked keys on every read, so a hash collision or a stale file is a miss, never a wrong answer;
writes go to a temporary file renamed into place, so a reader never sees half a file, and a
maker may hold the file's lock (`held`) so that concurrent processes make it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

_directory: Path | None = None


def configure(directory: Path | None) -> None:
    """Keep files under `directory` from now on (None: keep nothing)."""
    global _directory
    _directory = None if directory is None else Path(directory)


def directory() -> Path | None:
    return _directory


def digest(keys: dict) -> str:
    """The hex SHA-256 of `keys` (JSON, sorted)."""
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()


def _path(kind: str, stem: str, keys: dict) -> Path | None:
    if _directory is None:
        return None
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in stem)[:80]
    return _directory / kind / f"{safe}-{digest(keys)[:24]}"


def read(kind: str, stem: str, keys: dict) -> tuple[dict, bytes] | None:
    """(the record, the payload) kept for exactly `keys`, else None."""
    path = _path(kind, stem, keys)
    if path is None:
        return None
    try:
        record = json.loads(path.with_suffix(".json").read_text())
        payload = path.with_suffix(".bin").read_bytes() if record.get("payload_sha256") else b""
    except (OSError, ValueError):
        return None
    if record.get("keys") != json.loads(json.dumps(keys, sort_keys=True, default=str)):
        return None
    if payload and hashlib.sha256(payload).hexdigest() != record["payload_sha256"]:
        return None  # a damaged file: compile again rather than load it
    return record, payload


def write(kind: str, stem: str, keys: dict, record: dict, payload: bytes = b"") -> bool:
    """Keep `record` (JSON) and `payload` for `keys`; False where nothing could be written."""
    path = _path(kind, stem, keys)
    if path is None:
        return False
    full = {**record, "keys": keys, "payload_sha256": hashlib.sha256(payload).hexdigest() if payload else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if payload:
            atomic_write(path.with_suffix(".bin"), payload)
        atomic_write(path.with_suffix(".json"), json.dumps(full, sort_keys=True, default=str).encode())
    except OSError:
        return False
    return True


@contextmanager
def held(kind: str, stem: str, keys: dict):
    """Hold the lock of `keys`' file while making it, so that processes (or threads) making the
    same file at once make it once: the others wait, then read it. No lock where nothing is
    kept, or the platform has no `flock`; the system drops it when its holder ends."""
    path = _path(kind, stem, keys)
    if path is None or fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
