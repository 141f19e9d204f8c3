"""`strata verify MODEL`: hash every weight file of a checkpoint and check it, ignoring the
remembered digests (integrity.py), plus a streamed checkpoint's experts/index.json."""

from __future__ import annotations

from pathlib import Path

from .experts.store import (
    INDEX_NAME,
    STREAM_DIR,
    ExpertStoreError,
    is_streamed,
    read_index,
)
from .integrity import IntegrityError, Verification, verify_files
from .model.loader import ModelLoadError, weight_files


def verify_checkpoint(path: str | Path) -> Verification:
    """Hash and check every weight file of the checkpoint at `path` (and experts/index.json).

    Returns:
        The digests and what they were checked against ("" when nothing: unverified).

    Raises:
        ModelLoadError: a missing directory or weight file, or a file whose sha256 differs.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is not a directory")
    names = [str(f.relative_to(path)) for f in weight_files(path)]
    try:
        verification = verify_files(path, names, force=True)
    except (IntegrityError, OSError) as e:
        raise ModelLoadError(str(e)) from None
    if is_streamed(path):
        try:
            read_index(path)  # checks its sha256 against checksums.json and every field
        except ExpertStoreError as e:
            raise ModelLoadError(str(e)) from None
        verification.digests[f"{STREAM_DIR}/{INDEX_NAME}"] = _sha256(path / STREAM_DIR / INDEX_NAME)
    return verification


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
