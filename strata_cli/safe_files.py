"""Writing files so that a reader never sees half of one and a planted link is never followed.

Every file strata writes (sessions, converted checkpoints, the verification cache) goes through
here: a temporary file created exclusively in the destination's own directory (`mkstemp` opens
with O_CREAT|O_EXCL and O_NOFOLLOW where the OS has it, under a random name), written, synced,
then renamed over the destination. A rename replaces a symlink at the destination instead of
writing through it, so a link planted at either name cannot redirect the write.

A finished file gets the mode `open` would have given it (0666 less the umask), except a
`private` one, a file that holds user text (a session file: prompts and answers): that is
created 0600 and keeps the mode of the regular file it replaces, so a file the user made
0600 (or shared with a group) stays so.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# mkstemp creates files 0600; a finished file gets the mode `open` would have given it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
PRIVATE_MODE = 0o600


def file_mode(path: str | Path, *, private: bool) -> int:
    """The mode a write of `path` leaves: the umask's, or for a private file the mode of the
    regular file already there (less set-id and sticky bits), else `PRIVATE_MODE`. A link at
    `path` is replaced, not followed, so its target's mode is not taken."""
    if not private:
        return 0o666 & ~_UMASK
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return PRIVATE_MODE
    return stat.S_IMODE(st.st_mode) & 0o777 if stat.S_ISREG(st.st_mode) else PRIVATE_MODE


@contextmanager
def atomic_writer(path: str | Path, *, private: bool = False) -> Iterator[BinaryIO]:
    """A binary file object whose contents replace `path` atomically when the block ends.

    Args:
        path: the file to replace (or create).
        private: the file holds user text: 0600 when new, else the existing file's mode
            (default False: the umask's mode).

    If the block raises, `path` is left as it was and the temporary file is removed.
    """
    path = Path(path)
    mode = file_mode(path, private=private)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def write_bytes(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Replace `path` with `data`, atomically (`private`: as `atomic_writer`)."""
    with atomic_writer(path, private=private) as f:
        f.write(data)


def write_text(path: str | Path, text: str, *, private: bool = False) -> None:
    """Replace `path` with `text` (UTF-8), atomically (`private`: as `atomic_writer`)."""
    write_bytes(path, text.encode(), private=private)


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
