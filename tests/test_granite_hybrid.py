"""Granite-4.0-H (`granitemoehybrid`) against transformers and mlx-lm on a tiny random checkpoint
(Mamba-2 and NoPE attention layers, MoE with a shared MLP, the four multipliers, tied
embeddings), plus its rotary-attention and dense (no experts) forms; what is checked:
tests/hybrid_parity.py."""

import json
import math

import pytest
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
from strata_cli.model.granitemoehybrid import Config
from strata_cli.model.moe import QuantizedSwitchGLU
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
FAMILY = "granitemoehybrid"
VARIANTS = {"-rope": dict(position_embedding_type="rope"), "-dense": dict(num_local_experts=0)}


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


def test_logits_match_transformers(model, prompt_ids):
    assert model.layers[1].self_attn.rotary_dim == 0  # "nope", as Granite-4.0-H ships
    check_logits(strata_logits(model, prompt_ids), hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "HF layout")


def test_fused_layout_matches_transformers(root, prompt_ids):
    logits = strata_logits(load_model(hybrid_fused_checkpoint(root, FAMILY)), prompt_ids)
    check_logits(logits, hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "fused experts")


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(hybrid_hf_model(FAMILY), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_transformers(root, prompt_ids, variant):
    model = load_model(hybrid_hf_checkpoint(root, FAMILY, variant, **VARIANTS[variant]))
    reference = hybrid_hf_model(FAMILY, **VARIANTS[variant])
    check_logits(strata_logits(model, prompt_ids), hf_logits(reference, prompt_ids), variant)
    if variant == "-rope":
        assert model.layers[1].self_attn.rotary_dim == 16
        check_greedy(model, prompt_ids, hf_greedy(reference, prompt_ids))
    else:
        assert "mlp" in model.layers[0] and "block_sparse_moe" not in model.layers[0]


@pytest.mark.parametrize("bits", [None, 4], ids=["unquantized", "q4"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, bits):
    path = hybrid_mlx_checkpoint(root, FAMILY, bits)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path, dequantize=False)  # the quantized path itself (the CPU default dequantizes)
    moe = model.layers[0].block_sparse_moe
    assert isinstance(moe.switch_mlp, QuantizedSwitchGLU) == (bits is not None)
    if bits:
        assert moe.switch_mlp.gate_proj.bits == bits and moe.router.layer.bits == 8  # mlx-lm's router bits
    check_logits(strata_logits(model, prompt_ids), reference, f"mlx layout {bits}-bit")
    check_greedy(model, prompt_ids, tokens)


def test_config_reads_transformers_spellings(root):
    params = json.loads((hybrid_hf_checkpoint(root, FAMILY) / "config.json").read_text())
    assert params["time_step_limit"][1] == {"__float__": "Infinity"}  # what transformers 5 writes
    config = Config.from_dict(params)
    assert config.time_step_limit == (0.0, math.inf)
    assert config.layer_types == ("mamba", "attention", "mamba", "mamba")
    assert Config.from_dict({**params, "layer_types": ["mamba", "attention"] * 2}).layer_types[1] == "attention"
    assert Config.from_dict({**params, "mamba_d_head": "auto"}).mamba_d_head == 32
    with pytest.raises(ConfigError, match="unknown Granite layer types"):
        Config.from_dict({**params, "layer_types": ["mamba", "conv", "mamba", "mamba"]})
    with pytest.raises(ConfigError, match="time_step_limit holds 'soon'"):
        Config.from_dict({**params, "time_step_limit": [0.0, "soon"]})


def test_gpu_prompt_form_matches_transformers(model, prompt_ids, monkeypatch):
    """The experts' form GPU prompt chunks take (sorted picks, not flagged, no padded batches:
    granitemoehybrid.GraniteSwitchGLU), here on the CPU."""
    monkeypatch.setattr("strata_cli.model.granitemoehybrid.sorted_gather_is_exact", lambda: False)
    check_logits(strata_logits(model, prompt_ids), hf_logits(hybrid_hf_model(FAMILY), prompt_ids), "GPU form")
