"""Issue 31 (smaller): a write that fails during `strata convert` (a full disk) is one line naming
the destination's file and the cause, "no space left on device", not `RuntimeError: [write]
Unable to write 650225 bytes to file.`; nothing is left behind and an existing DST is untouched."""

import errno
import os
import shutil
import subprocess

import mlx.core as mx
import pytest
from click.testing import CliRunner

import strata_cli.convert as convert_module
from strata_cli import safe_files
from strata_cli.cli import cli
from strata_cli.convert import ConvertError, convert
from strata_cli.experts import store
from strata_cli.options import ConvertOptions
from strata_cli.runtime import embedded_model_path


def full_disk():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def half_written_shard(file, tensors, metadata=None):
    file.write(b"\0" * 1000)
    full_disk()


def half_written_experts(self, path, tensors, **kwargs):
    (self.root / "layer_000.bin").write_bytes(b"\0" * 4096)
    full_disk()


def failing_copy(src, dst, **kwargs):
    if str(dst).endswith("tokenizer.json"):
        full_disk()
    return real_copy2(src, dst, **kwargs)


def failing_text(path, text, **kwargs):
    if str(path).endswith("config.json"):
        full_disk()
    return real_write_text(path, text, **kwargs)


real_copy2, real_write_text = shutil.copy2, safe_files.write_text


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("fault, stream, names", [
    ("shard", False, "weight shard 1 of {dst}"),
    ("experts", True, "{dst}/experts/layer_000.bin"),
    ("tokenizer", False, "{dst}/tokenizer.json"),
    ("config", False, "{dst}/config.json"),
])
@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_names_the_file_and_leaves_dst_as_it_was(tmp_path, monkeypatch, fault, stream, names, existing):
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "marker").write_text("the old checkpoint")
    patch = {"shard": (mx, "save_safetensors", half_written_shard),
             "experts": (store.ExpertLayoutWriter, "add_block", half_written_experts),
             "tokenizer": (convert_module.shutil, "copy2", failing_copy),
             "config": (convert_module.safe_files, "write_text", failing_text)}[fault]
    monkeypatch.setattr(*patch)
    with pytest.raises(ConvertError) as error:
        convert(embedded_model_path(), dst, options=ConvertOptions(stream=stream, force=existing))
    message = str(error.value)
    assert isinstance(error.value, OSError) and error.value.errno == errno.ENOSPC
    where = names.format(dst=dst)
    assert message.startswith(f"cannot write {where}: no space left on device ("), message
    assert message.endswith(f"MB free); {dst} was left as it was") and "\n" not in message
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])
    if existing:
        assert [p.name for p in dst.iterdir()] == ["marker"]


def test_the_cli_says_one_line_and_exits_1(tmp_path, monkeypatch):
    monkeypatch.setattr(mx, "save_safetensors", half_written_shard)
    result = CliRunner().invoke(cli, ["convert", "demo", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot write weight shard 1 of {tmp_path / 'out'}: "
                                                   "no space left on device")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (the demo model needs 23 MB), where this process may mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_really_full_disk(small_disk, stream):
    dst = small_disk / "out"
    with pytest.raises(ConvertError, match=r"^cannot write .*: no space left on device \(0\.\d MB free\); "):
        convert(embedded_model_path(), dst, options=ConvertOptions(stream=stream))
    assert list(small_disk.iterdir()) == []
