"""Issue 31 (smaller): a config.json field of the wrong type or range is refused in one line that
names the field, its value and what it must be, before anything computes with it (not "math
domain error" or "unsupported operand type(s)")."""

import json
import shutil
import subprocess
import sys

import pytest
from hf_checkpoints import checkpoint_root, hf_checkpoint

from strata_cli.model import ModelLoadError, load_model
from strata_cli.runtime import embedded_model_path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def config_error(path) -> str:
    """What load_model says about config.json, less the file's name it starts with."""
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(f"{path / 'config.json'}: "), message
    return message.removeprefix(f"{path / 'config.json'}: ")


@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory):
    """The demo model (Qwen3-Next) copied once; each test edits config.json and puts it back."""
    path = tmp_path_factory.mktemp("demo") / "demo"
    shutil.copytree(embedded_model_path(), path)
    good = (path / "config.json").read_text()
    yield path
    (path / "config.json").write_text(good)


@pytest.fixture
def demo(demo_copy):
    good = (demo_copy / "config.json").read_text()
    yield demo_copy
    (demo_copy / "config.json").write_text(good)


@pytest.mark.parametrize("changes, said", [
    ({"hidden_size": -256}, "hidden_size must be a positive integer, got -256"),
    ({"hidden_size": "256"}, 'hidden_size must be a positive integer, got "256" (a string)'),
    ({"hidden_size": 256.5}, "hidden_size must be a positive integer, got 256.5"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"num_experts_per_tok": True}, "num_experts_per_tok must be a positive integer, got true (a boolean)"),
    ({"vocab_size": [4096]}, "vocab_size must be a positive integer, got [4096] (a list)"),
    ({"head_dim": None}, "head_dim must be a positive integer, got null"),
    # used in a modulo before the config was built: ZeroDivisionError, a traceback
    ({"full_attention_interval": 0}, "full_attention_interval must be a positive integer, got 0"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number, got -1"),
    ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps must be a positive number, got "1e-6" (a string)'),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive number, got NaN"),
    ({"partial_rotary_factor": 2}, "partial_rotary_factor must be in (0, 1], got 2"),
    ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings must be true or false, got "yes" (a string)'),
    ({"mlp_only_layers": 3}, "mlp_only_layers must be a list of non-negative integers, got 3"),
    ({"mlp_only_layers": [-1]}, "mlp_only_layers must be a list of non-negative integers, got [-1] (a list)"),
    ({"layer_types": "linear_attention"}, 'layer_types must be a list of strings, got "linear_attention" (a string)'),
])
def test_a_bad_qwen3_next_field_is_named_with_its_value(demo, changes, said):
    edit_config(demo, **changes)
    assert config_error(demo) == said


@pytest.mark.parametrize("family, changes, said", [
    ("qwen3_moe", {"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ("qwen3_moe", {"moe_intermediate_size": "64"}, 'moe_intermediate_size must be a positive integer, got "64" (a string)'),
    ("qwen3_moe", {"norm_topk_prob": 1}, "norm_topk_prob must be true or false, got 1"),
    ("mixtral", {"num_local_experts": -8}, "num_local_experts must be a positive integer, got -8"),
    ("mixtral", {"sliding_window": "4096"}, 'sliding_window must be a positive integer or null, got "4096" (a string)'),
    ("mixtral", {"rope_theta": [1e6]}, "rope_theta must be a positive number, got [1000000.0] (a list)"),
])
def test_a_bad_field_of_each_family_is_named_with_its_value(tmp_path_factory, tmp_path, family, changes, said):
    path = tmp_path / family
    shutil.copytree(hf_checkpoint(checkpoint_root(tmp_path_factory), family), path)
    edit_config(path, **changes)
    assert config_error(path) == said


def test_qwen3_moe_names_num_local_experts_when_that_is_the_spelling(tmp_path_factory, tmp_path):
    path = tmp_path / "qwen3_moe"
    shutil.copytree(hf_checkpoint(checkpoint_root(tmp_path_factory), "qwen3_moe"), path)
    assert "num_experts" not in json.loads((path / "config.json").read_text())  # transformers 5 spells it so
    edit_config(path, num_local_experts="8")
    assert config_error(path) == 'num_local_experts must be a non-negative integer, got "8" (a string)'


@pytest.mark.parametrize("value, said", [
    (-256, "hidden_size must be a positive integer, got -256"),
    ("256", 'hidden_size must be a positive integer, got "256" (a string)'),
])
def test_generate_says_one_line_and_exits_1(demo, value, said):
    edit_config(demo, hidden_size=value)
    proc = subprocess.run([sys.executable, "-m", "strata_cli.cli", "generate", "--model", str(demo), "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"Error: {demo / 'config.json'}: {said}"]
