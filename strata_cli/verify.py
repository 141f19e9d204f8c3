"""`strata verify MODEL`: check everything loading a checkpoint reads. Every weight file is hashed
again and checked, ignoring the remembered digests (integrity.py); a streamed checkpoint's
experts/index.json is checked (its sha256 and every field, as loading checks it) and so is every
expert record (its crc32, as each read checks it, experts/store.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .experts.store import (
    INDEX_NAME,
    STREAM_DIR,
    BlockLayout,
    ExpertStoreError,
    corrupt_records,
    is_streamed,
    read_index,
)
from .integrity import IntegrityError, Verification, verify_files
from .model.loader import ModelLoadError, weight_files

SHOWN_EXPERTS = 8  # corrupt experts named per file; the rest are counted


def verify_checkpoint(path: str | Path) -> Verification:
    """Hash and check every weight file of the checkpoint at `path`, and a streamed checkpoint's
    experts/index.json and expert records.

    Returns:
        The digests, what they were checked against ("" when nothing: unverified) and how many
        expert records were checked.

    Raises:
        ModelLoadError: a missing directory or weight file, a file whose sha256 differs, an index
            that loading would refuse, or expert records that are missing or fail their crc32
            (naming each file, layer and expert).
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is not a directory")
    names = [str(f.relative_to(path)) for f in weight_files(path)]
    try:
        verification = verify_files(path, names, force=True)
    except (IntegrityError, OSError) as e:
        raise ModelLoadError(str(e)) from None
    if not is_streamed(path):
        return verification
    try:
        _, blocks = read_index(path)  # checks its sha256 against checksums.json and every field
        bad = [(block, corrupt_records(block)) for block in blocks]
    except ExpertStoreError as e:
        raise ModelLoadError(str(e)) from None
    except OSError as e:
        raise ModelLoadError(f"{e.filename}: cannot read it ({e.strerror})") from None
    problems = [_describe(block, experts) for block, experts in bad if experts]
    if problems:
        raise ModelLoadError(
            "; ".join(problems) + ": the expert records are corrupt or were changed after convert wrote them"
        )
    verification.digests[f"{STREAM_DIR}/{INDEX_NAME}"] = _sha256(path / STREAM_DIR / INDEX_NAME)
    return dataclasses.replace(verification, expert_records=sum(b.num_experts for b in blocks))


def _describe(block: BlockLayout, experts: list[int]) -> str:
    shown = ", ".join(str(e) for e in experts[:SHOWN_EXPERTS]) + (", ..." if len(experts) > SHOWN_EXPERTS else "")
    noun = "expert" if len(experts) == 1 else "experts"
    return (f"{block.file}: crc32 mismatch in layer {block.layer} ({block.path}) {noun} {shown} "
            f"({len(experts)} of {block.num_experts})")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
