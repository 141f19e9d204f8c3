"""`strata verify` on a checkpoint with nothing to check against says so, and can record its digests."""

import json
import shutil

from click.testing import CliRunner

from strata_cli.cli import cli
from strata_cli.runtime import embedded_model_path


def plain_copy(tmp_path):
    copy = tmp_path / "plain"
    shutil.copytree(embedded_model_path(), copy)
    (copy / "checksums.json").unlink()  # as a hf download --local-dir has it
    return copy


def test_unverified_says_what_to_run_and_write_checksums_makes_it_verified(tmp_path):
    copy = plain_copy(tmp_path)
    first = CliRunner().invoke(cli, ["verify", str(copy)])
    assert first.exit_code == 0 and "weights unverified" in first.stdout
    assert f"'strata verify {copy} --write-checksums'" in first.stderr
    wrote = CliRunner().invoke(cli, ["verify", str(copy), "--write-checksums", "--json"])
    assert json.loads(wrote.stdout)["wrote"] == str(copy / "checksums.json")
    again = CliRunner().invoke(cli, ["verify", str(copy), "--json"])
    assert json.loads(again.stdout)["status"] == "verified"
    twice = CliRunner().invoke(cli, ["verify", str(copy), "--write-checksums"])
    assert twice.exit_code == 1 and "already verified against checksums.json" in twice.output


def test_a_flipped_byte_after_write_checksums_is_caught(tmp_path):
    copy = plain_copy(tmp_path)
    CliRunner().invoke(cli, ["verify", str(copy), "--write-checksums"])
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    bad = CliRunner().invoke(cli, ["verify", str(copy)])
    assert bad.exit_code == 1 and shard.name in bad.output
