"""Issue 31, item 5: files that hold user text (session files: prompts and answers as token ids
and states) are created 0600 and keep an existing file's mode; every other file strata writes
(converted checkpoints, checksums, the digest cache, bench results) gets the umask's mode, as
`open` would give it."""

import json
import os
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from strata_cli import integrity, safe_files
from strata_cli.cli import cli
from strata_cli.serve.session import save_session

SERVE = [sys.executable, "-m", "strata_cli.cli", "serve-stdio"]
UMASK_MODE = 0o666 & ~safe_files._UMASK


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def serve(session, prompt):
    line = json.dumps({"prompt": prompt, "max_tokens": 2}).encode() + b"\n"
    proc = subprocess.run([*SERVE, "--session", str(session)], input=line, capture_output=True, timeout=180,
                          check=False, env={**os.environ, "STRATA_RAISE_ERRORS": ""})
    assert proc.returncode == 0, proc.stderr.decode()


def test_serve_stdio_creates_a_session_private_and_keeps_its_mode(tmp_path):
    session = tmp_path / "s.st"
    serve(session, "x")
    assert mode(session) == 0o600
    os.chmod(session, 0o640)  # the user shares it with a group
    serve(session, "y")
    assert mode(session) == 0o640
    os.chmod(session, 0o600)  # the repro: 0600 came back 0644
    serve(session, "z")
    assert mode(session) == 0o600


def test_save_session_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        session = tmp_path / "new.session"
        save_session(session, [], identity="x", dtype="float32", layout=["kv"])
        assert mode(session) == 0o600
    finally:
        os.umask(old)


def test_a_link_at_the_session_path_gives_a_private_file_not_the_targets_mode(tmp_path):
    target = tmp_path / "public.txt"
    target.write_text("x")
    os.chmod(target, 0o644)
    session = tmp_path / "s.session"
    session.symlink_to(target)
    save_session(session, [], identity="x", dtype="float32", layout=["kv"])
    assert not session.is_symlink() and mode(session) == 0o600 and mode(target) == 0o644


def test_private_writes_keep_an_existing_mode_and_strip_special_bits(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    os.chmod(path, 0o4640)
    safe_files.write_text(path, "new", private=True)
    assert path.read_text() == "new" and mode(path) == 0o640


@pytest.mark.parametrize("existing", [None, 0o600])
def test_files_without_user_text_get_the_umask_mode(tmp_path, existing):
    path = tmp_path / "model" / "checksums.json"
    path.parent.mkdir()
    (path.parent / "w.bin").write_bytes(b"w")
    if existing is not None:
        path.write_text("{}")
        os.chmod(path, existing)
    integrity.write_checksums(path.parent, ["w.bin"])
    assert mode(path) == UMASK_MODE


def test_converted_checkpoints_and_the_digest_cache_get_the_umask_mode(tmp_path, monkeypatch):
    dst = tmp_path / "demo-stream"
    assert CliRunner().invoke(cli, ["convert", "demo", str(dst), "--stream"]).exit_code == 0
    for name in ("config.json", "checksums.json", "model.safetensors", "experts/index.json"):
        assert mode(dst / name) == UMASK_MODE, name
    monkeypatch.setattr(integrity, "CACHE_MIN_BYTES", 1)
    integrity.sha256_file(dst / "config.json")
    assert mode(integrity.cache_path()) == UMASK_MODE


def test_bench_results_hold_no_prompt_text_and_get_the_umask_mode(tmp_path):
    (tmp_path / "p.txt").write_text("name: p\ncategory: prose\n---\nSECRET-PROMPT once upon a time\n")
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    result = CliRunner().invoke(cli, ["bench", "--workloads-dir", str(tmp_path), "-n", "2", "-r", "1", "--warmup",
                                      "0", "--modes", "serial", "--no-peers", "--out", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    for path in (out, md):
        assert "SECRET" not in path.read_text() and mode(path) == UMASK_MODE
