"""`strata convert`: converted checkpoints load and give the source's logits; quantized ones equal
mlx-lm's conversion of the same source; DST is never overwritten without --force and never left
half-written."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_checkpoints import (
    FAMILIES,
    checkpoint_root,
    hf_checkpoint,
    mlx_checkpoint,
    prompt_text,
    tokenizer_dir,
)
from mlx.utils import tree_flatten

import strata_cli.convert as convert_module
from strata_cli.cli import cli
from strata_cli.convert import ConvertError, convert
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model, qwen3_next
from strata_cli.model.loader import FORMAT_VERSION, read_header
from strata_cli.options import ConfigError, ConvertOptions
from strata_cli.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def ids(root):
    return Tokenizer(tokenizer_dir(root)).encode(prompt_text())[:80]


def logits(path, ids) -> np.ndarray:
    return np.array(WindowEngine(load_model(path)).run(ids, 0).logits)


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("family", FAMILIES)
def test_unquantized_convert_gives_the_source_logits(root, ids, tmp_path, family):
    src = hf_checkpoint(root, family)
    result = convert(src, tmp_path / "out", options=ConvertOptions())
    out = result.path
    config = json.loads((out / "config.json").read_text())
    assert config["strata_format"] == FORMAT_VERSION and config["dtype"] == "float32" and "quantization" not in config
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # Exactly equal: the same float32 parameters, and no transform applied twice (Qwen3-Next's
    # 1 + w norms would be off by one).
    np.testing.assert_array_equal(logits(out, ids), logits(src, ids))
    assert Tokenizer(out).encode("def f(x):") == Tokenizer(src).encode("def f(x):")


def test_converted_checkpoint_is_not_sanitized_again(root, tmp_path, monkeypatch):
    """The strata_format marker, not luck, keeps the loader from re-applying HF transforms (a
    Qwen3-Next checkpoint without experts could not be told apart from a raw HF one)."""
    src = hf_checkpoint(root, "qwen3_next")
    out = convert(src, tmp_path / "out", options=ConvertOptions()).path

    def refuse(self, weights):
        raise AssertionError("sanitize called")

    monkeypatch.setattr(qwen3_next.Model, "sanitize", refuse)
    load_model(out)
    with pytest.raises(AssertionError, match="sanitize called"):
        load_model(src)


@pytest.mark.parametrize("bits", [None, 8])
def test_format_1_checkpoints_still_load(root, ids, tmp_path, bits):
    """Version 1 stored the modules' parameters as they are (conv1d (C, K), bare expert stacks)."""
    out = convert(hf_checkpoint(root, "qwen3_next"), tmp_path / "v2", options=ConvertOptions(bits=bits)).path
    params = dict(tree_flatten(load_model(out, dequantize=False).parameters()))
    assert params["model.layers.0.linear_attn.conv1d.weight"].ndim == 2
    old = tmp_path / "v1"
    old.mkdir()
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (old / "config.json").write_text(json.dumps({**config, "strata_format": 1}))
    mx.save_safetensors(str(old / "model.safetensors"), params)
    np.testing.assert_array_equal(logits(old, ids), logits(out, ids))


@pytest.mark.parametrize("family, bits", [(f, 4) for f in FAMILIES] + [("qwen3_next", 8)])
def test_quantized_convert_equals_mlx_lm_conversion(root, ids, tmp_path, family, bits):
    result = convert(hf_checkpoint(root, family), tmp_path / "out", options=ConvertOptions(bits=bits))
    reference = mlx_checkpoint(root, family, bits)
    expected = json.loads((reference / "config.json").read_text())["quantization"]
    assert result.quantization == expected  # the same layers at the same widths (routers at 8 bits)
    assert json.loads((result.path / "config.json").read_text())["quantization"] == expected
    np.testing.assert_allclose(logits(result.path, ids), logits(reference, ids), rtol=0, atol=1e-5)


def test_sharded_output_and_dtype(root, ids, tmp_path):
    src = hf_checkpoint(root, "qwen3_next")
    result = convert(src, tmp_path / "out", options=ConvertOptions(dtype="bfloat16"), max_shard_bytes=100_000)
    out = result.path
    shards = sorted(out.glob("model-*.safetensors"))
    assert result.num_shards == len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    dtypes = {entry["dtype"] for s in shards for k, entry in read_header(s).items() if k != "__metadata__"}
    assert dtypes == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    rounded, exact = logits(out, ids), logits(src, ids)
    row_diff = np.abs(rounded - exact).max(axis=-1)
    # bfloat16 rounding, nothing worse: small on a typical row (a rare row may flip an expert).
    assert 0 < np.median(row_diff) < 0.2
    assert (rounded.argmax(-1) == exact.argmax(-1)).mean() >= 0.9


def test_quantized_mlx_source_converts_without_requantizing(root, ids, tmp_path):
    src = mlx_checkpoint(root, "mixtral", 4)
    result = convert(src, tmp_path / "out", options=ConvertOptions())
    assert result.quantization == json.loads((src / "config.json").read_text())["quantization"]
    np.testing.assert_array_equal(logits(result.path, ids), logits(src, ids))
    with pytest.raises(ConvertError, match="already quantized"):
        convert(src, tmp_path / "again", options=ConvertOptions(bits=8))


def test_refuses_to_overwrite_without_force(root, tmp_path):
    src = hf_checkpoint(root, "mixtral")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="already exists; pass --force"):
        convert(src, dst, options=ConvertOptions())
    assert (dst / "keep.txt").read_text() == "mine"
    convert(src, dst, options=ConvertOptions(force=True))
    assert not (dst / "keep.txt").exists() and (dst / "config.json").exists()
    assert leftovers(tmp_path) == []


def test_refuses_source_as_destination(root, tmp_path):
    src = hf_checkpoint(root, "mixtral")
    for dst in (src, src.parent):
        with pytest.raises(ConvertError, match="source"):
            convert(src, dst, options=ConvertOptions(force=True))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConvertError, match="not a directory"):
        convert(src, tmp_path / "file", options=ConvertOptions(force=True))


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_interrupted_convert_leaves_nothing_that_loads(root, tmp_path, monkeypatch, error):
    src = hf_checkpoint(root, "qwen3_next")
    calls = []
    real_save = convert_module._save_shard

    def failing_save(path, tensors):
        calls.append(path)
        if len(calls) == 3:  # after two shards are on disk
            raise error
        real_save(path, tensors)

    monkeypatch.setattr(convert_module, "_save_shard", failing_save)
    with pytest.raises(type(error)):
        convert(src, tmp_path / "out", options=ConvertOptions(), max_shard_bytes=100_000)
    assert len(calls) == 3
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []  # the staging directory is gone too


def test_interrupted_forced_convert_keeps_the_old_destination(root, ids, tmp_path, monkeypatch):
    src = hf_checkpoint(root, "mixtral")
    dst = convert(src, tmp_path / "out", options=ConvertOptions()).path
    before = logits(dst, ids)

    def failing_config(out, config):
        raise OSError("interrupted while writing config.json")

    monkeypatch.setattr(convert_module, "_write_config", failing_config)
    with pytest.raises(OSError, match="interrupted"):
        convert(src, dst, options=ConvertOptions(bits=4, force=True))
    np.testing.assert_array_equal(logits(dst, ids), before)  # still the old, complete model
    assert "quantization" not in json.loads((dst / "config.json").read_text())
    assert leftovers(tmp_path) == []


def test_cli_convert(root, tmp_path):
    src = hf_checkpoint(root, "qwen3_moe")
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(src), str(tmp_path / "q8")], env={"STRATA_BITS": "8"})
    assert result.exit_code == 0, result.output
    assert "8-bit, group size 64" in result.stdout
    assert "\r" not in result.stderr and "converting" not in result.stderr  # no tqdm bar off a terminal
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8

    again = runner.invoke(cli, ["convert", str(src), str(tmp_path / "q8"), "--bits", "4"])
    assert again.exit_code == 1 and "--force" in again.output
    forced = runner.invoke(cli, ["convert", str(src), str(tmp_path / "q8"), "--bits", "4", "--group-size", "32",
                                 "--force"])
    assert forced.exit_code == 0, forced.output
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["group_size"] == 32

    generated = runner.invoke(cli, ["generate", "--model", str(tmp_path / "q8"), "def f(x):", "-n", "5", "--json"])
    assert generated.exit_code == 0, generated.output
    assert len(json.loads(generated.stdout)["token_ids"]) <= 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-size", "32"], "--group-size applies only with --bits"),
        (["--bits", "3"], "--bits"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_cli_convert_bad_options(root, tmp_path, args, message):
    result = CliRunner().invoke(cli, ["convert", str(hf_checkpoint(root, "mixtral")), str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "o").exists()


def test_cli_convert_missing_source(tmp_path):
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "nope"), str(tmp_path / "o")])
    assert result.exit_code == 1 and str(tmp_path / "nope" / "config.json") in result.output


def test_convert_options_are_checked():
    with pytest.raises(ConfigError, match="bits"):
        ConvertOptions(bits=3)
    with pytest.raises(ConfigError, match="group_size"):
        ConvertOptions(bits=4, group_size=48)
    with pytest.raises(ConfigError, match="only with bits"):
        ConvertOptions(group_size=32)
