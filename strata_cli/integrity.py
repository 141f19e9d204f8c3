"""Weight checksums: what a checkpoint's files must hash to, and a memory of files already hashed.

A checkpoint says what its files hash to in one of two ways:

- `checksums.json`, which `strata convert` writes (and the embedded demo model ships):
  {"format": "strata-checksums", "version": 1, "algorithm": "sha256",
   "files": {"model.safetensors": "<sha256>", "experts/index.json": "<sha256>", ...}}
- a Hugging Face hub cache, where `snapshots/<rev>/<file>` links to `blobs/<sha256>` for every
  LFS file (safetensors shards): the blob's name is its content's sha256.

Anything else is "unverified": it loads, with a note. The digest of every weight file is computed
either way, because a model's identity (the key of its session files) is derived from them.

Hashing a large model takes seconds to minutes, so the digest of a file of `CACHE_MIN_BYTES` or more
is remembered in the user cache directory (`$XDG_CACHE_HOME/strata/digests.json`, else
`~/.cache/strata/`), keyed by its real path, size, mtime, ctime and inode: a file rewritten in place
changes its mtime or ctime (ctime cannot be set back), so it is hashed again. `strata verify`
ignores the memory and hashes everything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import safe_files

CHECKSUMS_NAME = "checksums.json"
FORMAT = "strata-checksums"
VERSION = 1
CACHE_MIN_BYTES = 64 << 20  # smaller files hash in well under 0.1 s: not worth remembering
CACHE_MAX_ENTRIES = 4096
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20

log = logging.getLogger(__name__)


class IntegrityError(Exception):
    """A file whose content does not match its recorded checksum; the message names the file."""


@dataclass(frozen=True)
class Verification:
    """What loading found out about a checkpoint's files.

    Attributes:
        digests: file name (relative to the checkpoint) -> its sha256.
        source: what the digests were checked against ("checksums.json", "hub cache"), or ""
            when nothing was: then `is_verified` is False.
        expert_records: a streamed checkpoint's expert records whose crc32 `strata verify`
            checked against experts/index.json (0 when none were: loading checks each as it
            reads it).
    """

    digests: dict[str, str] = field(default_factory=dict)
    source: str = ""
    expert_records: int = 0

    @property
    def is_verified(self) -> bool:
        return bool(self.source)

    @property
    def note(self) -> str:
        records = f"; {self.expert_records} expert records match their crc32 in experts/index.json"
        if self.is_verified:
            return f"weights verified against {self.source}" + (records if self.expert_records else "")
        return ("weights unverified (no checksums.json and not a hub cache: a corrupt file would go unnoticed)"
                + (records if self.expert_records else ""))


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata" / "digests.json"


def sha256_file(path: str | Path, *, use_cache: bool = True) -> str:
    """The sha256 of a file's content, remembered for large files (see the module docstring)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    is_cached = st.st_size >= CACHE_MIN_BYTES
    if is_cached and use_cache:
        entry = _read_cache().get(real)
        if isinstance(entry, list) and entry[:4] == key and len(entry) == 5:
            return entry[4]
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    if is_cached:
        _remember(real, key + [hexdigest])
    return hexdigest


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if isinstance(data, dict) and data.get("version") == VERSION else {}


def _remember(real: str, entry: list) -> None:
    files = _read_cache()
    files.pop(real, None)
    files[real] = entry
    while len(files) > CACHE_MAX_ENTRIES:  # oldest first: dicts keep insertion order
        files.pop(next(iter(files)))
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        safe_files.write_text(path, json.dumps({"version": VERSION, "files": files}))
    except OSError as e:  # a read-only home only costs the next load a re-hash
        log.debug("cannot remember digests in %s: %s", path, e)


def read_checksums(directory: str | Path) -> dict[str, str] | None:
    """`checksums.json`'s file -> sha256 map, or None when the checkpoint has none.

    Raises:
        IntegrityError: the file exists but is not a valid checksums file.
    """
    path = Path(directory) / CHECKSUMS_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path}: not valid JSON ({e})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict) or data.get("format") != FORMAT or data.get("algorithm") != "sha256"
        or not isinstance(files, dict)
        or not all(isinstance(v, str) and _SHA256.match(v) for v in files.values())
    ):
        raise IntegrityError(f"{path}: not a {FORMAT} file (format, algorithm sha256, files: name -> sha256)")
    if data.get("version") != VERSION:
        raise IntegrityError(f"{path}: version {data.get('version')!r}, this strata reads {VERSION}")
    return dict(files)


def write_checksums(directory: str | Path, names: list[str]) -> dict[str, str]:
    """Hash `names` (relative to `directory`) and write them to `directory/checksums.json`."""
    directory = Path(directory)
    files = {name: sha256_file(directory / name, use_cache=False) for name in sorted(names)}
    data = {"format": FORMAT, "version": VERSION, "algorithm": "sha256", "files": files}
    safe_files.write_text(directory / CHECKSUMS_NAME, json.dumps(data, indent=1) + "\n")
    return files


def hub_digest(path: str | Path) -> str | None:
    """The sha256 a Hugging Face hub cache file carries in its blob's name, if it is one."""
    path = Path(path)
    if not path.is_symlink():
        return None
    target = path.resolve()
    return target.name if target.parent.name == "blobs" and _SHA256.match(target.name) else None


def verify_files(directory: str | Path, names: list[str], *, force: bool = False) -> Verification:
    """Hash `names` (relative to `directory`) and check each against what the checkpoint records.

    Args:
        directory: the checkpoint directory.
        names: the files to hash (the weight shards).
        force: hash every file even if its digest is remembered (`strata verify`).

    Raises:
        IntegrityError: a file whose sha256 differs from its record, or one checksums.json leaves out.
    """
    directory = Path(directory)
    listed = read_checksums(directory)
    digests, is_hub = {}, True
    for name in names:
        file = directory / name
        if listed is not None:
            if name not in listed:
                raise IntegrityError(f"{file}: not listed in {directory / CHECKSUMS_NAME}")
            expected, source = listed[name], CHECKSUMS_NAME
        else:
            expected, source = hub_digest(file), "its hub-cache blob name"
            is_hub = is_hub and expected is not None
        digests[name] = sha256_file(file, use_cache=not force)
        if expected is not None and digests[name] != expected:
            raise IntegrityError(
                f"{file}: sha256 {digests[name][:16]}... differs from {source} ({expected[:16]}...): "
                "the file is corrupt or was changed after it was recorded"
            )
    if listed is not None:
        return Verification(digests, CHECKSUMS_NAME)
    return Verification(digests, "hub cache" if is_hub and names else "")


def check_bytes(directory: str | Path, name: str, data: bytes) -> str:
    """The sha256 of `data`, the content of `directory/name`, checked against checksums.json
    when that lists it.

    Raises:
        IntegrityError: a mismatch, or a checksums.json that leaves the file out.
    """
    digest = hashlib.sha256(data).hexdigest()
    listed = read_checksums(directory)
    if listed is not None:
        file = Path(directory) / name
        if name not in listed:
            raise IntegrityError(f"{file}: not listed in {Path(directory) / CHECKSUMS_NAME}")
        if listed[name] != digest:
            raise IntegrityError(
                f"{file}: sha256 {digest[:16]}... differs from {CHECKSUMS_NAME} ({listed[name][:16]}...): "
                "the file is corrupt or was changed after it was recorded"
            )
    return digest
