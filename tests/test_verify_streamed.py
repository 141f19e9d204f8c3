"""Issue 31, item 3: `strata verify` checks everything loading reads, a streamed checkpoint's expert
records too (their crc32 in experts/index.json, as experts/store.py checks each read), and names a
corrupt record's file, layer and expert with a non-zero exit."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from strata_cli.cli import cli
from strata_cli.model.loader import ModelLoadError
from strata_cli.verify import verify_checkpoint


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    dst = tmp_path_factory.mktemp("verify") / "demo-stream"
    result = CliRunner().invoke(cli, ["convert", "demo", str(dst), "--stream"])
    assert result.exit_code == 0, result.output
    return dst


@pytest.fixture
def copy(streamed, tmp_path):
    dst = tmp_path / "demo-stream"
    shutil.copytree(streamed, dst)
    return dst


@pytest.fixture(autouse=True)
def _errors_render(monkeypatch):
    monkeypatch.delenv("STRATA_RAISE_ERRORS", raising=False)


def records(path, file="layer_005.bin"):
    index = json.loads((path / "experts" / "index.json").read_text())
    return next(b for b in index["blocks"] if b["file"] == file)["records"]


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def verify(path, *args):
    return CliRunner().invoke(cli, ["verify", str(path), *args])


def test_a_good_streamed_checkpoint_verifies_every_record(copy):
    result = verify(copy)
    assert result.exit_code == 0, result.output
    num_records = sum(len(b["records"]) for b in json.loads((copy / "experts/index.json").read_text())["blocks"])
    assert f"{num_records} expert records" in result.output
    data = json.loads(verify(copy, "--json").output)
    assert data["status"] == "verified" and data["expert_records"] == num_records


def test_a_byte_flipped_in_every_record_of_one_file_is_refused(copy):
    for offset, length, _ in records(copy):
        flip(copy / "experts" / "layer_005.bin", offset + length // 2)
    result = verify(copy)
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "experts/layer_005.bin" in line and "layer 5" in line
    assert "experts 0, 1, 2" in line and "48 of 48" in line
    assert "verified" not in line


def test_one_corrupt_record_is_named_by_expert(copy):
    offset, length, _ = records(copy, "layer_002.bin")[17]
    flip(copy / "experts" / "layer_002.bin", offset + length - 1)  # the payload's last byte
    with pytest.raises(ModelLoadError, match=r"experts/layer_002\.bin: .*layer 2 .*expert 17 \(1 of 48\)"):
        verify_checkpoint(copy)


def test_padding_is_not_a_record(copy):
    offset, length, _ = records(copy)[3]
    flip(copy / "experts" / "layer_005.bin", offset + length)  # the first padding byte: never used
    assert verify(copy).exit_code == 0


def test_a_truncated_or_missing_expert_file_is_refused(copy):
    file = copy / "experts" / "layer_004.bin"
    offset, _, _ = records(copy, "layer_004.bin")[40]
    os.truncate(file, offset + 10)
    result = verify(copy)
    assert result.exit_code == 1 and "layer_004.bin: truncated" in result.output and "expert 40" in result.output
    file.unlink()
    result = verify(copy)
    assert result.exit_code == 1 and "layer_004.bin: missing" in result.output


def test_an_index_without_checksums_is_still_checked_field_by_field(copy):
    index_path = copy / "experts" / "index.json"
    index = json.loads(index_path.read_text())
    index["blocks"][1]["tensors"][1]["offset"] += 64
    index_path.write_text(json.dumps(index))
    (copy / "checksums.json").unlink()
    result = verify(copy)
    assert result.exit_code == 1 and "index.json: model.layers.1.mlp.switch_mlp.tensors" in result.output
