"""Hugging Face repo ids as `--model` values: found in the local hub cache, or downloaded when asked.

A value that is not an existing directory but reads as `owner/name` is looked up in the hub
cache (`HF_HUB_CACHE`, `HF_HOME`, default `~/.cache/huggingface/hub`) through huggingface_hub, as
mlx-lm does. With `--download` a repo not in the cache is fetched (the files strata loads only);
otherwise the error says exactly what to run.
"""

from __future__ import annotations

import re
from pathlib import Path

from .model.loader import ModelLoadError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What loading reads: config, weights (and the shard index), tokenizer files, chat template,
# checksums, a streamed checkpoint's experts.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "experts/*"]


def is_repo_id(value: str) -> bool:
    """Whether `value` reads as a Hugging Face repo id (`owner/name`) rather than a path."""
    return bool(REPO_ID.match(value)) and not value.startswith((".", "~"))


def local_dir_hint(repo_id: str) -> str:
    return f"~/models/{repo_id.split('/', 1)[1].lower()}"


def resolve_repo(repo_id: str, *, download: bool = False) -> Path:
    """The local snapshot directory of `repo_id`.

    Raises:
        ModelLoadError: huggingface_hub is missing, the repo is not cached and `download` is off,
            or the download failed (offline, no such repo, no access) — each with what to do.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelLoadError(
            f"'{repo_id}' is not a directory; to use Hugging Face repo ids install huggingface_hub "
            f"(pip install huggingface_hub), or download it and pass the directory"
        ) from None
    fetch = f"hf download {repo_id} --local-dir {local_dir_hint(repo_id)}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download:
            raise ModelLoadError(
                f"model '{repo_id}' is not a directory and not in the Hugging Face cache; "
                f"pass --download to fetch it, or run: {fetch} (then --model {local_dir_hint(repo_id)})"
            ) from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model '{repo_id}': the Hugging Face cache cannot be read ({e})") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    except (OSError, ValueError) as e:  # offline, unknown or gated repo, disk full: the hub's errors are OSErrors
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"model '{repo_id}': download failed ({reason}); try: {fetch}") from None
