"""`--model owner/name`: a Hugging Face repo id, found in the local hub cache, offline."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from strata_cli import integrity
from strata_cli.hub import is_repo_id
from strata_cli.runtime import embedded_model_path

REPO = "strata-test/demo-4bit"


def hub_cache(cache, repo_id, source):
    """`source` laid out as huggingface_hub caches a download of `repo_id` under `cache`:
    refs/main names a snapshot whose files link to blobs named by their sha256."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    blobs, snap = root / "blobs", root / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abcd")
    for f in source.iterdir():
        if f.is_file() and f.name != "checksums.json":
            digest = integrity.sha256_file(f, use_cache=False)
            shutil.copy(f, blobs / digest)
            (snap / f.name).symlink_to(os.path.relpath(blobs / digest, snap))
    return snap


def strata(*args, cache):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "hf")}
    return subprocess.run([sys.executable, "-m", "strata_cli.cli", *args], capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub") / "hub"
    hub_cache(cache, REPO, embedded_model_path())
    return cache


def test_repo_ids_are_told_from_paths():
    assert is_repo_id("mlx-community/Qwen3-30B-A3B-4bit") and is_repo_id(REPO)
    for path in ("./models/x", "~/models/x", "/abs/path", "models", "a/b/c", "demo"):
        assert not is_repo_id(path), path


def test_a_cached_repo_id_loads_and_verifies_against_its_blobs(cache):
    by_id = strata("generate", "def f(x):", "-n", "8", "--json", "--model", REPO, cache=cache)
    assert by_id.returncode == 0, by_id.stderr
    demo = strata("generate", "def f(x):", "-n", "8", "--json", cache=cache)
    record, reference = json.loads(by_id.stdout), json.loads(demo.stdout)
    assert record["token_ids"] == reference["token_ids"]
    assert record["weights"] == "verified"  # the hub cache's blob names are the files' sha256


def test_a_repo_id_not_in_the_cache_says_what_to_run(cache):
    proc = strata("generate", "x", "--model", "mlx-community/Not-Cached-4bit", cache=cache)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "not in the Hugging Face cache" in line and "--download" in line
    assert "hf download mlx-community/Not-Cached-4bit --local-dir ~/models/not-cached-4bit" in line


def test_download_offline_fails_in_one_line(cache):
    proc = strata("generate", "x", "--download", "--model", "mlx-community/Not-Cached-4bit", cache=cache)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "download failed" in line and "hf download mlx-community/Not-Cached-4bit" in line


def test_a_missing_directory_that_is_no_repo_id_is_still_a_path_error(cache, tmp_path):
    proc = strata("generate", "x", "--model", str(tmp_path / "nope"), cache=cache)
    assert proc.returncode == 1 and "does not exist" in proc.stderr
