"""Issue 17: no corruption a stored checksum covers can produce output; an index that lies is
refused naming the file and field; sessions are keyed by the weights' content; convert --force
never leaves no destination."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from click.testing import CliRunner
from stream_checkpoints import build_pair

from strata_cli import integrity
from strata_cli.cli import cli
from strata_cli.convert import convert, repair_parent
from strata_cli.experts.store import ExpertStoreError, read_index
from strata_cli.model.loader import ModelLoadError
from strata_cli.options import ConvertOptions, LoadOptions
from strata_cli.runtime import embedded_model_path, load_checkpoint, open_model
from strata_cli.serve.session import SessionError, load_session, save_session

SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def demo_copy(tmp_path):
    dst = tmp_path / "demo"
    shutil.copytree(embedded_model_path(), dst)
    return dst


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("integrity"))[1]


@pytest.fixture
def streamed_copy(streamed, tmp_path):
    dst = tmp_path / "streamed"
    shutil.copytree(streamed, dst)
    return dst


def flip_byte(path, at=-1000):
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


# -- 1. one flipped byte ------------------------------------------------------------------------

def test_demo_ships_checksums_and_loads_verified():
    model = load_checkpoint(embedded_model_path())
    assert model.verification.is_verified and model.verification.source == "checksums.json"


def test_a_flipped_byte_in_the_demo_weights_is_refused(demo_copy, monkeypatch):
    flip_byte(demo_copy / SHARD)
    with pytest.raises(ModelLoadError, match=rf"{SHARD}: sha256 .* differs from checksums.json"):
        load_checkpoint(demo_copy)
    monkeypatch.delenv("STRATA_RAISE_ERRORS", raising=False)
    result = CliRunner().invoke(cli, ["generate", "hello", "--model", str(demo_copy), "-n", "3"])
    assert result.exit_code == 1 and SHARD in result.output and "differs" in result.output


def test_a_flipped_byte_in_a_streamed_checkpoints_shard_is_refused(streamed_copy):
    flip_byte(streamed_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: sha256"):
        load_checkpoint(streamed_copy)


def test_convert_records_every_shard_and_the_index(streamed):
    listed = integrity.read_checksums(streamed)
    assert set(listed) == {"model.safetensors", "experts/index.json"}


def hub_cache(root, source):
    """A Hugging Face hub-cache layout of `source`: snapshots/<rev>/* link to blobs/<sha256>."""
    blobs, snap = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in source.iterdir():
        if f.name == "checksums.json":
            continue
        digest = integrity.sha256_file(f, use_cache=False)
        shutil.copy(f, blobs / digest)
        (snap / f.name).symlink_to(os.path.relpath(blobs / digest, snap))
    return snap


def test_a_hub_cache_checkpoint_is_verified_against_its_blob_names(tmp_path):
    snap = hub_cache(tmp_path / "hub", embedded_model_path())
    assert load_checkpoint(snap).verification.source == "hub cache"
    flip_byte((snap / SHARD).resolve())
    with pytest.raises(ModelLoadError, match=rf"{SHARD}: sha256 .* hub-cache blob name"):
        load_checkpoint(snap)


def test_a_checkpoint_without_checksums_loads_with_an_unverified_note(demo_copy, monkeypatch):
    (demo_copy / "checksums.json").unlink()
    assert not load_checkpoint(demo_copy).verification.is_verified
    result = CliRunner().invoke(cli, ["generate", "hi", "--model", str(demo_copy), "-n", "2", "--json"])
    assert json.loads(result.output)["weights"] == "unverified"
    result = CliRunner().invoke(cli, ["generate", "hi", "--model", str(demo_copy), "-n", "2", "--stats"])
    assert "weights unverified" in result.output


def test_large_files_are_hashed_once_and_again_after_a_change(demo_copy, monkeypatch):
    monkeypatch.setattr(integrity, "CACHE_MIN_BYTES", 0)
    file = demo_copy / SHARD
    first = integrity.sha256_file(file)
    assert integrity.cache_path().is_file()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
    assert integrity.sha256_file(file) == first and str(file) not in reads  # remembered
    monkeypatch.setattr("builtins.open", real_open)
    flip_byte(file)  # same size, same inode: mtime and ctime change
    assert integrity.sha256_file(file) != first
    with pytest.raises(ModelLoadError, match="differs"):
        load_checkpoint(demo_copy)


def test_verify_command_hashes_and_reports(demo_copy, monkeypatch):
    monkeypatch.delenv("STRATA_RAISE_ERRORS", raising=False)
    ok = CliRunner().invoke(cli, ["verify", str(demo_copy), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["status"] == "verified"
    flip_byte(demo_copy / SHARD)
    bad = CliRunner().invoke(cli, ["verify", str(demo_copy)])
    assert bad.exit_code == 1 and SHARD in bad.output


# -- 2. index.json edits --------------------------------------------------------------------------

def edit_index(path, change, *, keep_checksums):
    index_path = path / "experts" / "index.json"
    index = json.loads(index_path.read_text())
    change(index["blocks"][1])
    index_path.write_text(json.dumps(index, indent=1))
    if not keep_checksums:
        (path / "checksums.json").unlink()


def shift_offset(block):
    block["tensors"][1]["offset"] += 64


def to_float16(block):
    block["tensors"][0]["dtype"] = "float16"
    block["tensors"][0]["nbytes"] //= 2


def rotate_records(block):
    offsets = [r[0] for r in block["records"]]
    for r, o in zip(block["records"], offsets[1:] + offsets[:1]):
        r[0] = o


def bad_nbytes(block):
    block["tensors"][0]["nbytes"] -= 4


@pytest.mark.parametrize("change", [shift_offset, to_float16, rotate_records, bad_nbytes])
def test_an_edited_index_fails_its_checksum(streamed_copy, change):
    edit_index(streamed_copy, change, keep_checksums=True)
    with pytest.raises(ModelLoadError, match=r"experts/index\.json: sha256 .* differs"):
        load_checkpoint(streamed_copy)


@pytest.mark.parametrize("change, field", [
    (shift_offset, r"tensors\[\w+\]\.offset"),
    (to_float16, r"tensors\[\w+\]\.dtype: float16, but the checkpoint stores float32"),
    (bad_nbytes, r"tensors\[\w+\]\.nbytes"),
    (lambda b: b["records"][3].__setitem__(0, b["records"][3][0] + 8), r"records\[3\]: offset \d+ is not a multiple"),
    (lambda b: b["records"][3].__setitem__(0, b["records"][2][0]), r"records\[\d\]: offset \d+ overlaps"),
])
def test_an_index_without_checksums_is_checked_field_by_field(streamed_copy, change, field):
    edit_index(streamed_copy, change, keep_checksums=False)
    with pytest.raises(ExpertStoreError, match=rf"index\.json: model\.layers\.1\.mlp\.switch_mlp\.{field}"):
        read_index(streamed_copy)


# -- 3. session identity by content ---------------------------------------------------------------

def test_a_session_from_other_weights_of_the_same_shapes_is_refused(demo_copy, tmp_path):
    original = open_model(LoadOptions(model=str(demo_copy)))
    assert open_model(LoadOptions(model=str(demo_copy))).identity == original.identity
    # a "fine-tune" re-saved in place: same names, shapes and sizes, other values
    tensors = mx.load(str(demo_copy / SHARD))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    mx.save_safetensors(str(demo_copy / SHARD), tensors, metadata={"format": "mlx"})
    integrity.write_checksums(demo_copy, [SHARD, "model-00001-of-00002.safetensors"])
    tuned = open_model(LoadOptions(model=str(demo_copy)))
    assert tuned.identity != original.identity
    session = tmp_path / "chat.session"
    save_session(session, [], identity=original.identity, dtype="float32", layout=["kv"])
    with pytest.raises(SessionError, match="other weights"):
        load_session(session, identity=tuned.identity, dtype="float32", layout=["kv"], max_context=64,
                      vocab_size=100)


# -- 4. planted links -------------------------------------------------------------------------------

def test_a_link_planted_at_the_session_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's data")
    session = tmp_path / "chat.session"
    (tmp_path / f".{session.name}.tmp-{os.getpid()}").symlink_to(victim)  # the old predictable name
    save_session(session, [], identity="x", dtype="float32", layout=["kv"])
    assert victim.read_text() == "the user's data"
    assert session.is_file() and not session.is_symlink()


def test_a_link_at_the_session_path_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's data")
    session = tmp_path / "chat.session"
    session.symlink_to(victim)
    save_session(session, [], identity="x", dtype="float32", layout=["kv"])
    assert victim.read_text() == "the user's data" and not session.is_symlink()


# -- 5. convert --force -------------------------------------------------------------------------------

KILL_AFTER_FIRST_SWAP = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import strata_cli.convert as c
    from strata_cli.options import ConvertOptions
    dst = Path(sys.argv[2])
    if sys.argv[3] == "no-exchange":
        c.exchange = lambda a, b: False
    real_rename, real_exchange = os.rename, c.exchange
    def rename(a, b):
        real_rename(a, b)
        if Path(a) == dst or Path(b) == dst:
            os._exit(9)  # SIGKILL-like: no cleanup runs
    def exchange(a, b):
        ok = real_exchange(a, b)
        if ok:
            os._exit(9)
        return ok
    c.os.rename, c.exchange = rename, exchange
    c.convert(Path(sys.argv[1]), dst, options=ConvertOptions(force=True, dtype="float32"))
""")


@pytest.mark.parametrize("mode", ["exchange", "no-exchange"])
def test_convert_force_killed_mid_swap_keeps_a_destination_and_the_next_run_cleans_up(tmp_path, mode):
    src, dst = embedded_model_path(), tmp_path / "out"
    convert(src, dst, options=ConvertOptions(dtype="float32"))
    (dst / "marker").write_text("old")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_SWAP, str(src), str(dst), mode], env=env)
    assert run.returncode == 9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert leftovers, "the kill should leave a staging or old directory"
    if mode == "exchange":
        assert (dst / "config.json").is_file()  # never a moment without a DST
    repair_parent(tmp_path)  # what the next convert into this parent does first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert load_checkpoint(dst).verification.is_verified


def test_leftovers_of_running_processes_are_kept(tmp_path):
    mine = tmp_path / f".out.partial-{os.getpid()}-0123abcd"
    mine.mkdir()
    assert repair_parent(tmp_path) == [] and mine.is_dir()
