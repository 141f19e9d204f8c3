"""Writing files so that a reader never sees half of one and a planted link is never followed.

Every file strata writes (sessions, converted checkpoints, the verification cache) goes through
here: a temporary file created exclusively in the destination's own directory (`mkstemp` opens
with O_CREAT|O_EXCL and O_NOFOLLOW where the OS has it, under a random name), written, synced,
then renamed over the destination. A rename replaces a symlink at the destination instead of
writing through it, so a link planted at either name cannot redirect the write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# mkstemp creates files 0600; a finished file gets the mode `open` would have given it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file object whose contents replace `path` atomically when the block ends.

    If the block raises, `path` is left as it was and the temporary file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically."""
    with atomic_writer(path) as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8), atomically."""
    write_bytes(path, text.encode())


def sync_directory(path: str | Path) -> None:
    """fsync a directory, so that a rename inside it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
