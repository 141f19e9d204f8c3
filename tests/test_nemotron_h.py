"""Nemotron-H (`nemotron_h`) against transformers and mlx-lm on a tiny random checkpoint of every
block kind (Mamba-2, attention, MLP, MoE with group routing); what is checked: tests/hybrid_parity.py."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from hf_checkpoints import (
    checkpoint_root,
    hybrid_fused_checkpoint,
    hybrid_hf_checkpoint,
    hybrid_hf_model,
    hybrid_mlx_checkpoint,
    prompt_text,
    tokenizer_dir,
)
from hybrid_parity import (
    check_greedy,
    check_logits,
    check_seeded_sampling,
    hf_greedy,
    hf_logits,
    mlx_lm_reference,
    strata_logits,
)

from strata_cli.model import load_model
from strata_cli.model.config import ConfigError
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.nemotron_h import Config, ExpertLinear
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
FAMILY = "nemotron_h"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())
    assert len(ids) >= 64
    return ids


@pytest.fixture(scope="module")
def model(root):
    return load_model(hybrid_hf_checkpoint(root, FAMILY))


def test_logits_match_transformers(root, model, prompt_ids):
    check_logits(strata_logits(model, prompt_ids), hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "HF layout")


def test_fused_layout_matches_transformers(root, prompt_ids):
    logits = strata_logits(load_model(hybrid_fused_checkpoint(root, FAMILY)), prompt_ids)
    check_logits(logits, hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "fused experts")


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(hybrid_hf_model(FAMILY), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


@pytest.mark.parametrize("bits", [None, 4], ids=["unquantized", "q4"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, bits):
    path = hybrid_mlx_checkpoint(root, FAMILY, bits)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path, dequantize=False)  # the quantized path itself (the CPU default dequantizes)
    moe = model.layers[1].mixer
    assert isinstance(moe.switch_mlp.fc1, ExpertLinear) == (bits is None)
    if bits:
        assert moe.switch_mlp.fc1.bits == bits and model.layers[0].mixer.in_proj.bits == bits
    check_logits(strata_logits(model, prompt_ids), reference, f"mlx layout {bits}-bit")
    check_greedy(model, prompt_ids, tokens)


def test_dt_limit_clamps_as_transformers_does(model):
    """dt is clamped to the config's time_step_limit after the softplus (transformers' mixer, as the
    CUDA scan kernels and mlx-lm do; the test checkpoints' (0, inf) never bites): one Mamba-2
    layer against transformers' with dt_bias pushed far below a lower limit of 0.001."""
    from strata_cli.engine.state import Mamba2State, Mode

    hf = hybrid_hf_model(FAMILY).model.layers[0].mixer
    mixer = model.layers[0].mixer
    x = np.random.RandomState(3).standard_normal((1, 40, 64)).astype(np.float32)
    low = torch.full_like(hf.dt_bias, -12.0)  # softplus(-12 + dt) is far below 0.001 for every row
    limit = (0.001, float("inf"))
    saved = hf.dt_bias.detach().clone(), hf.time_step_limit
    try:
        with torch.no_grad():
            hf.dt_bias.copy_(low)
            hf.time_step_limit = limit
            expected = hf(torch.tensor(x)).numpy()
            hf.time_step_limit = saved[1]
            unclamped = hf(torch.tensor(x)).numpy()
    finally:
        with torch.no_grad():
            hf.dt_bias.copy_(saved[0])
        hf.time_step_limit = saved[1]
    original = mixer.dt_bias, mixer.dt_min
    mixer.dt_bias, mixer.dt_min = mx.array(low.numpy()), limit[0]
    try:
        state = Mamba2State(4, lazy=True)
        state.begin(0, 40, Mode.COMMIT_ALL)
        got = np.array(mixer(mx.array(x), state))
    finally:
        mixer.dt_bias, mixer.dt_min = original
    assert np.abs(expected - unclamped).max() > 1e-3  # the clamp changes the output
    assert np.abs(got - expected).max() <= 1e-5


def test_config_reads_time_step_limit():
    """time_step_limit as transformers writes it ({"__float__": "Infinity"}), as JSON's Infinity, under
    its config alias mamba_dt_limit, and (0, inf) when absent; time_step_min is an init parameter only."""
    from strata_cli.model.nemotron_h import NemotronHConfig

    base = {"model_type": "nemotron_h", "max_position_embeddings": 64, "hidden_size": 64, "vocab_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4,
            "intermediate_size": 128, "hybrid_override_pattern": "M-", "rms_norm_eps": 1e-5, "time_step_min": 0.01}
    limit = NemotronHConfig.from_dict
    assert limit(base).time_step_limit == (0.0, float("inf"))
    assert limit({**base, "time_step_limit": [0.001, {"__float__": "Infinity"}]}).time_step_limit == (0.001, float("inf"))
    assert limit({**base, "mamba_dt_limit": json.loads("[0.0, Infinity]")}).time_step_limit == (0.0, float("inf"))
    with pytest.raises(ConfigError, match="time_step_limit holds 'soon'"):
        limit({**base, "time_step_limit": [0.0, "soon"]})


def test_config_reads_every_spelling_of_the_pattern(root):
    params = json.loads((hybrid_hf_checkpoint(root, FAMILY) / "config.json").read_text())
    assert Config.from_dict(params).layer_types == tuple("ME*M-E")
    legacy = {k: v for k, v in params.items() if k != "layers_block_type"}
    assert Config.from_dict({**legacy, "hybrid_override_pattern": "M*E"}).num_hidden_layers == 3
    with pytest.raises(ConfigError, match=r"unknown Nemotron-H block types \['X'\]"):
        Config.from_dict({**legacy, "hybrid_override_pattern": "MX"})
    with pytest.raises(ConfigError, match="n_group"):
        Config.from_dict({**params, "n_group": 3})


def test_missing_expert_is_refused_with_the_file(root, tmp_path):
    src = hybrid_hf_checkpoint(root, FAMILY)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = next(p for p in sorted(bad.glob("*.safetensors"))
                 if any(k.endswith("experts.3.up_proj.weight") for k in mx.load(str(p))))
    tensors = {k: v for k, v in mx.load(str(shard)).items() if not k.endswith("experts.3.up_proj.weight")}
    mx.save_safetensors(str(shard), tensors)
    with pytest.raises(ModelLoadError, match=r"experts\.3\.up_proj\.weight"):
        load_model(bad)


def test_gpu_prompt_form_matches_transformers(model, prompt_ids, monkeypatch):
    """The experts' form GPU prompt chunks take (picks not flagged sorted: MLX 0.32.4's CUDA sorted
    gather_mm is wrong, moe.sorted_gather_is_exact), here on the CPU."""
    monkeypatch.setattr("strata_cli.model.moe.sorted_gather_is_exact", lambda: False)
    check_logits(strata_logits(model, prompt_ids), hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "GPU form")
