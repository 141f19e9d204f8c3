"""Issue 32 item 3: `strata convert` never writes a checkpoint that does not load, and reads its own
output. A SRC without a readable tokenizer.json is refused before anything is written; a streamed
SRC (`convert --stream`) is read whole, experts from experts/*.bin, and converts like any other."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_checkpoints import checkpoint_root, hf_checkpoint, prompt_text, tokenizer_dir

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.engine.window import WindowEngine
from strata_cli.model import ModelLoadError, load_model
from strata_cli.options import ConvertOptions
from strata_cli.runtime import embedded_model_path, load_checkpoint
from strata_cli.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def demo_stream(tmp_path_factory):
    """The demo model converted with --stream, as the issue's user made it."""
    return convert(embedded_model_path(), tmp_path_factory.mktemp("src") / "demo-stream",
                   options=ConvertOptions(stream=True)).path


def tensors(path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def assert_same_tensors(a, b):
    a, b = tensors(a), tensors(b)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and mx.array_equal(a[name], b[name]).item(), name


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def greedy(model_path, *args) -> list[int]:
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "generate", "--model", str(model_path), "--json",
                           "--max-tokens", "24", "def fib(n):", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["token_ids"]


# -- a SRC whose DST would not load --------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "unreadable"])
def test_a_source_without_a_readable_tokenizer_is_refused_before_writing(tmp_path, damage):
    src = tmp_path / "src"
    shutil.copytree(embedded_model_path(), src)
    if damage == "missing":
        (src / "tokenizer.json").unlink()
    else:
        (src / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {src / 'tokenizer.json'}: "), lines
    assert ("missing" if damage == "missing" else "not a readable tokenizer") in lines[0]
    assert "would not load" in lines[0] and "nothing was written" in lines[0]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_model_only_checkpoint_is_still_written_when_asked(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(embedded_model_path(), src)
    (src / "tokenizer.json").unlink()
    out = convert(src, tmp_path / "out", options=ConvertOptions(), require_tokenizer=False).path
    load_checkpoint(out)  # the library opens it; `generate` would need a tokenizer
    with pytest.raises(ModelLoadError, match="tokenizer.json: missing"):
        Tokenizer(out)


# -- a streamed SRC ------------------------------------------------------------------------------


def test_the_demo_streamed_and_converted_back_is_the_demo(demo_stream, tmp_path):
    """The issue's round trip: demo -> --stream -> convert back: the same tensors as converting
    the demo directly, and the same greedy tokens as the demo."""
    back = convert(demo_stream, tmp_path / "back", options=ConvertOptions()).path
    plain = convert(embedded_model_path(), tmp_path / "plain", options=ConvertOptions()).path
    assert not (back / "experts").exists()
    assert_same_tensors(back, plain)
    assert greedy(back) == greedy("demo") == greedy(demo_stream)


def test_the_cli_converts_a_streamed_checkpoint(demo_stream, tmp_path):
    result = CliRunner().invoke(cli, ["convert", str(demo_stream), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {tmp_path / 'back'} (137 tensors")


def test_a_streamed_checkpoint_streams_again_byte_for_byte(demo_stream, tmp_path):
    again = convert(demo_stream, tmp_path / "again", options=ConvertOptions(stream=True)).path
    names = sorted(f.name for f in (demo_stream / "experts").iterdir())
    assert names == sorted(f.name for f in (again / "experts").iterdir())
    for name in names:
        assert (again / "experts" / name).read_bytes() == (demo_stream / "experts" / name).read_bytes(), name
    assert_same_tensors(again, demo_stream)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_moe", "mixtral"])
def test_a_streamed_float_checkpoint_quantizes_as_its_source_does(root, tmp_path, family):
    """`convert STREAMED DST --bits 4` (the issue's "missing tensors ... switch_mlp.down_proj")."""
    src = hf_checkpoint(root, family)
    streamed = convert(src, tmp_path / "streamed", options=ConvertOptions(stream=True)).path
    via_stream = convert(streamed, tmp_path / "q4-via-stream", options=ConvertOptions(bits=4)).path
    direct = convert(src, tmp_path / "q4", options=ConvertOptions(bits=4)).path
    assert_same_tensors(via_stream, direct)
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())[:40]

    def logits(path):
        return np.array(WindowEngine(load_model(path)).run(ids, 0).logits)

    np.testing.assert_array_equal(logits(via_stream), logits(direct))
    back = convert(streamed, tmp_path / "back", options=ConvertOptions()).path
    np.testing.assert_array_equal(logits(back), logits(src))


def test_a_corrupt_expert_record_is_refused_naming_it(demo_stream, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(demo_stream, src)
    index = json.loads((src / "experts" / "index.json").read_text())
    offset = index["blocks"][2]["records"][5][0]
    record_file = src / "experts" / index["blocks"][2]["file"]
    data = bytearray(record_file.read_bytes())
    data[offset + 100] ^= 0x10
    record_file.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as error:
        convert(src, tmp_path / "out", options=ConvertOptions())
    message = str(error.value)
    assert message.startswith(f"{record_file}: checksum mismatch in expert 5 of model.layers.2.mlp.switch_mlp")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_config_that_does_not_match_the_experts_is_refused(demo_stream, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(demo_stream, src)
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = 128  # the records hold 64-wide experts
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        convert(src, tmp_path / "out", options=ConvertOptions())
    assert str(error.value) == (f"{src / 'experts' / 'layer_000.bin'}: tensor model.layers.0.mlp.switch_mlp."
                                f"gate_proj.weight has shape (48, 64, 64), expected (48, 128, 64)")
    assert not (tmp_path / "out").exists()
