"""Every way a checkpoint can be unusable ends in one ModelLoadError that names the file and what
was expected, and in one line on stderr with exit status 1 from the CLI."""

import json
import shutil

import pytest
from click.testing import CliRunner
from hf_checkpoints import checkpoint_root, hf_checkpoint

from strata_cli.cli import cli
from strata_cli.model import ModelLoadError, load_model


@pytest.fixture
def ckpt(tmp_path_factory, tmp_path):
    """A private copy of the sharded Hugging Face Qwen3-MoE checkpoint, free to break."""
    src = hf_checkpoint(checkpoint_root(tmp_path_factory), "qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def shard_holding(path, tensor):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def rewrite_shard(shard, change):
    """Load a shard with the safetensors library, change its dict, write it back."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard)


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    return str(info.value)


def blames(message: str, path) -> str:
    """Check that `message` starts by naming `path`; return what it says about it (the test
    folder names contain words like "truncated", so never search the whole message)."""
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: "):]


def test_the_intact_copy_loads(ckpt):
    assert load_model(ckpt).config.model_type == "qwen3_moe"


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="llama")
    said = blames(load_error(ckpt), ckpt / "config.json")
    assert "'llama'" in said and "qwen3_next" in said and "mixtral" in said  # what was expected


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
        ({"quantization": {"group_size": 64, "bits": 7}}, "bits must be one of"),
        ({"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}}, "'mxfp4'"),
        ({"strata_format": 99}, "strata_format 99"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok (99)"),
    ],
)
def test_unsupported_config(ckpt, changes, expected):
    edit_config(ckpt, **changes)
    assert expected in blames(load_error(ckpt), ckpt / "config.json")


def test_mixtral_sliding_window_is_refused(tmp_path_factory, tmp_path):
    path = tmp_path / "mixtral"
    shutil.copytree(hf_checkpoint(checkpoint_root(tmp_path_factory), "mixtral"), path)
    edit_config(path, sliding_window=256)
    assert "sliding_window 256" in blames(load_error(path), path / "config.json")
    edit_config(path, sliding_window=512)  # as long as max_position_embeddings: never drops a key
    load_model(path)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "missing" in blames(load_error(ckpt), ckpt / "config.json")


def test_missing_shard(ckpt):
    shard = shard_holding(ckpt, "model.norm.weight")
    shard.unlink()
    said = blames(load_error(ckpt), shard)
    assert "missing" in said and "model.safetensors.index.json" in said


def test_no_weights(ckpt):
    for f in ckpt.glob("*.safetensors*"):
        f.unlink()
    assert "no *.safetensors" in blames(load_error(ckpt), ckpt)


def test_model_path_missing_or_a_file(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in load_error(tmp_path / "file")


def test_truncated_shard(ckpt):
    shard = shard_holding(ckpt, "model.embed_tokens.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    said = blames(load_error(ckpt), shard)
    assert said.startswith("truncated safetensors file (its header needs ")


@pytest.mark.parametrize(
    "garbage", [b"", b"\x01\x02", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}....."]
)
def test_corrupt_shard(ckpt, garbage):
    shard = shard_holding(ckpt, "model.norm.weight")
    shard.write_bytes(garbage)
    said = blames(load_error(ckpt), shard)
    assert said.startswith(("corrupt safetensors header", "not a safetensors file"))


def test_wrong_shape_names_the_shard(ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = shard_holding(ckpt, name)
    rewrite_shard(shard, lambda t: t.__setitem__(name, t[name][:-1]))
    said = blames(load_error(ckpt), shard)
    assert said == f"tensor {name} has shape (63, 64), expected (64, 64)"


def test_wrong_expert_shape_names_the_shard(ckpt):
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    shard = shard_holding(ckpt, name)
    rewrite_shard(shard, lambda t: t.__setitem__(name, t[name][:, :32]))
    said = blames(load_error(ckpt), shard)
    assert said.startswith(f"tensor {name} has shape (64, 32), expected (64, 64)")


def test_missing_expert(ckpt):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    rewrite_shard(shard_holding(ckpt, name), lambda t: t.pop(name))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    said = blames(load_error(ckpt), ckpt)
    assert said == f"missing tensor {name} (7 of 8 experts present)"


def test_missing_and_unexpected_tensors(ckpt):
    name = "model.layers.1.mlp.up_proj.weight"  # layer 1 is a dense MLP layer
    shard = shard_holding(ckpt, name)
    rewrite_shard(shard, lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", t.pop(name)))
    said = blames(load_error(ckpt), ckpt)
    assert said.startswith("missing tensors") and name in said


def test_cli_reports_one_line_and_exit_1(ckpt):
    shard = shard_holding(ckpt, "model.norm.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    result = CliRunner().invoke(cli, ["generate", "--model", str(ckpt), "x"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(shard) in lines[0]
