"""DeepSeek-V3 (`deepseek_v3`) against transformers and mlx-lm on tiny random checkpoints
(tests/deepseek_checkpoints.py), what tests/hybrid_parity.py checks for every family, plus:

- YaRN rope (attention factor and softmax mscale) and the plain-q_proj variant against transformers;
- the MLA latent state (`LatentKVState`): forced rejection at every keep of T = 2..8 at
  pos0 = 8 and 11, partial on and off, and with every window row split as a GPU runs it;
  snapshots, session files, forged snapshots refused;
- MTP layers kept aside (published layout), written back by convert; unsupported configs refused.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from deepseek_checkpoints import (
    YARN,
    deepseek_v3_checkpoint,
    deepseek_v3_hf_model,
    deepseek_v3_mlx_checkpoint,
    deepseek_v3_published_checkpoint,
    mtp_tensors,
)
from hf_checkpoints import checkpoint_root, prompt_text, tokenizer_dir
from hybrid_parity import (
    check_greedy,
    check_logits,
    check_seeded_sampling,
    hf_greedy,
    hf_logits,
    mlx_lm_reference,
    strata_logits,
)
from state_checks import REJECTION_OFFSETS, check_checkpoint_round_trip, check_forced_rejections, serial_decode

from strata_cli.convert import convert
from strata_cli.engine.state import LatentKVState
from strata_cli.engine.window import SnapshotError, WindowEngine
from strata_cli.model import load_model
from strata_cli.model.config import ConfigError
from strata_cli.model.deepseek_v3 import Config, DeepseekMoE
from strata_cli.model.layers import RowSplit
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.mla import MultiLinear, QuantizedMultiLinear
from strata_cli.options import ConvertOptions, EngineOptions
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
TOL = 1e-5
SEQ_LEN = 40
VARIANTS = {"yarn": dict(rope_parameters=YARN), "no-q-lora": dict(q_lora_rank=None, rope_interleave=False)}


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
    return load_model(deepseek_v3_checkpoint(root))


def test_logits_match_transformers(model, prompt_ids):
    assert isinstance(model.layers[1].mlp, DeepseekMoE) and not isinstance(model.layers[0].mlp, DeepseekMoE)
    check_logits(strata_logits(model, prompt_ids), hf_logits(deepseek_v3_hf_model(), prompt_ids), "HF layout")


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_transformers(root, prompt_ids, variant):
    """YaRN (mscale 0.707 / mscale_all_dim 1: both the rotary attention factor and the softmax
    scale differ from 1), and a plain q_proj with non-interleaved rope."""
    overrides = VARIANTS[variant]
    model = load_model(deepseek_v3_checkpoint(root, f"-{variant}", **overrides))
    reference = deepseek_v3_hf_model(**overrides)
    if variant == "yarn":
        rope = model.config.rope
        assert rope.attention_factor != 1.0 and rope.softmax_factor != 1.0
    check_logits(strata_logits(model, prompt_ids), hf_logits(reference, prompt_ids), variant)
    check_greedy(model, prompt_ids, hf_greedy(reference, prompt_ids))


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(deepseek_v3_hf_model(), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


@pytest.mark.parametrize("bits", [None, 4], ids=["unquantized", "q4"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, bits):
    path = deepseek_v3_mlx_checkpoint(root, bits)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path, dequantize=False)
    attn = model.layers[0].self_attn
    assert isinstance(attn.embed_q, QuantizedMultiLinear if bits else MultiLinear)
    check_logits(strata_logits(model, prompt_ids), reference, f"mlx layout {bits}-bit")
    check_greedy(model, prompt_ids, tokens)


# -- the latent KV state ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serial(model):
    return serial_decode(model, SEQ_LEN)


def test_the_state_is_the_latent(model):
    engine = WindowEngine(model)
    assert all(isinstance(s, LatentKVState) for s in engine.states)
    engine.prefill([1, 2, 3])
    cells = engine.state_tensors()[0]["latent"]
    assert cells.shape == (1, 1, 3, 64 + 32)  # kv_lora_rank + qk_rope_head_dim, one head


@pytest.mark.parametrize("row_split", ["auto", "always"], ids=["cpu", "rows-split"])
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("pos0", REJECTION_OFFSETS, ids=lambda p: f"pos0={p}")
def test_forced_rejection_matches_serial(model, serial, partial, pos0, row_split, monkeypatch):
    """"always": every window row's projections and attention run alone, as on a GPU."""
    monkeypatch.setattr(RowSplit, "mode", row_split)
    options = EngineOptions(partial=partial)
    assert check_forced_rejections(model, options, serial, pos0, TOL) == sum(range(2, 9))


def test_check_snapshot_names_what_does_not_fit(model, serial):
    engine = WindowEngine(model)
    engine.prefill(serial[0][:12])
    good = engine.snapshot()
    engine.check_snapshot(good)
    cells, values, n = good.states[0]
    for slots, words in [
        ((cells[..., :8], None, n), r"layer 0 \(LatentKVState\): cells has shape \(1, 1, \d+, 8\)"),
        ((cells.astype(mx.float16), None, n), "cells is float16"),
        ((cells, cells, n), "values slot is an array"),
        ((cells, None, 11), "length slot is int 11"),
        ((cells, None), "2 slots, a latent KV state has 3"),
    ]:
        with pytest.raises(SnapshotError, match=words):
            engine.check_snapshot(type(good)(good.length, (slots, *good.states[1:])))


def test_prefix_checkpoint_and_session_round_trip(model, serial, tmp_path):
    check_checkpoint_round_trip(model, serial[0], tmp_path / "s.session", identity="deepseek-tiny", rejected=1)


# -- MTP, configs ----------------------------------------------------------------------------------


def test_mtp_layers_are_kept_aside(root, prompt_ids, model):
    published = load_model(deepseek_v3_published_checkpoint(root))
    assert published.config.num_nextn_predict_layers == 1 and "MTP: 1 layer(s)" in published.load_notes[0]
    source = mtp_tensors(deepseek_v3_hf_model())
    kept = dict(published.mtp.parameters()["layers"][0].items())
    assert np.array_equal(np.array(kept["eh_proj"]["weight"]), source["model.layers.3.eh_proj.weight"].numpy())
    stacked = np.array(kept["mlp"]["switch_mlp"]["up_proj"][5])
    assert np.array_equal(stacked, source["model.layers.3.mlp.experts.5.up_proj.weight"].numpy())
    np.testing.assert_array_equal(strata_logits(published, prompt_ids[:40]), strata_logits(model, prompt_ids[:40]))
    assert model.load_notes == ["MTP: config.json lists 1 layer(s), the checkpoint holds none"]


def test_unexpected_mtp_tensor_is_refused(root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(deepseek_v3_published_checkpoint(root), bad)
    shard = bad / "model-mtp.safetensors"
    tensors = dict(mx.load(str(shard)))
    tensors["model.layers.3.surprise.weight"] = mx.zeros((2,))
    mx.save_safetensors(str(shard), tensors)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.surprise.weight"] = shard.name
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors mtp\.layers\.0\.surprise\.weight"):
        load_model(bad)


def test_unsupported_configs_are_refused(root):
    params = json.loads((deepseek_v3_checkpoint(root) / "config.json").read_text())
    for change, words in [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'linear'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"topk_method": "greedy", "scoring_func": "softmax"}, "only noaux_tc with sigmoid"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
        ({"n_group": 3}, "n_group"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "factor and original_max"),
    ]:
        with pytest.raises(ConfigError, match=words):
            Config.from_dict({**params, **change})
    dense = Config.from_dict({**params, "n_routed_experts": None})
    assert not dense.is_moe_layer(2)


# -- convert and streaming -------------------------------------------------------------------------


def test_convert_is_the_source_model_and_keeps_mtp(root, prompt_ids, tmp_path):
    """`strata convert` (the CLI) of the published layout: the same logits bit for bit, the MTP
    layer written back and read again."""
    from click.testing import CliRunner

    from strata_cli.cli import cli

    src, out = deepseek_v3_published_checkpoint(root), tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out)])
    assert result.exit_code == 0, result.output
    source, converted = load_model(src), load_model(out)
    np.testing.assert_array_equal(strata_logits(converted, prompt_ids), strata_logits(source, prompt_ids))
    assert converted.config.num_nextn_predict_layers == 1
    for (name, a), (_, b) in zip(tree_flatten(source.mtp.parameters()), tree_flatten(converted.mtp.parameters())):
        assert mx.array_equal(a, b).item(), name


def test_convert_q4_decodes_as_mlx_lm_q4(root, prompt_ids, tmp_path):
    from strata_cli.bench.peers import MlxLmPeer

    result = convert(deepseek_v3_checkpoint(root), tmp_path / "q4", options=ConvertOptions(bits=4, group_size=32))
    reference_path = deepseek_v3_mlx_checkpoint(root, 4)
    expected = json.loads((reference_path / "config.json").read_text())["quantization"]
    assert result.quantization == expected
    model, reference = load_model(result.path), load_model(reference_path)
    np.testing.assert_allclose(strata_logits(model, prompt_ids), strata_logits(reference, prompt_ids), rtol=0, atol=1e-5)
    peer = MlxLmPeer.load(result.path, dtype=mx.float32).model  # mlx-lm loads strata's output
    ids = prompt_ids[:24]
    np.testing.assert_allclose(strata_logits(model, ids), np.array(peer(mx.array([ids]))[0]), rtol=0, atol=1e-4)


def test_streamed_convert_is_bit_identical(root, prompt_ids, tmp_path):
    from hybrid_parity import strata_tokens

    from strata_cli.options import SpecOptions, StreamOptions
    from strata_cli.runtime import load_checkpoint

    src = deepseek_v3_checkpoint(root)
    options = dict(bits=4, group_size=32)
    q4 = convert(src, tmp_path / "q4", options=ConvertOptions(**options)).path
    streamed_path = convert(src, tmp_path / "q4-stream", options=ConvertOptions(**options, stream=True)).path
    assert (streamed_path / "experts").is_dir()
    resident = load_model(q4)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in (SpecOptions(), SpecOptions(max_drafts=3)):
            assert strata_tokens(streamed, prompt_ids, spec)[0] == strata_tokens(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()


def test_routing_bias_stays_float32_in_bfloat16(root, prompt_ids):
    model = load_model(deepseek_v3_checkpoint(root), dtype="bfloat16")
    moe = model.layers[1].mlp
    assert moe.gate.e_score_correction_bias.dtype == mx.float32 and moe.gate.weight.dtype == mx.bfloat16
    WindowEngine(model).run(prompt_ids[:20], 0)  # runs with the float32 bias


def test_a_routing_policy_of_natural_picks_is_exact_routing(model, prompt_ids):
    """The MoCE hook (`SparseMoeBlock.routing_policy`) sees the biased, group-limited scores; a
    policy that takes their natural top-k with full weight gives exact routing's logits."""
    exact = strata_logits(model, prompt_ids[:40])

    def natural(probs, top_k):
        return mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k], mx.ones((probs.shape[0], top_k))

    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, DeepseekMoE)]
    try:
        for block in blocks:
            block.routing_policy = natural
            assert not block.compilable
        np.testing.assert_allclose(strata_logits(model, prompt_ids[:40]), exact, rtol=0, atol=1e-6)
    finally:
        for block in blocks:
            block.routing_policy = None


def test_kimi_k2_is_deepseek_v3(root, prompt_ids, model, tmp_path):
    """Kimi-K2's config.json says `kimi_k2` for DeepSeek-V3's architecture (mlx-lm remaps it too)."""
    path = tmp_path / "k2"
    shutil.copytree(deepseek_v3_checkpoint(root), path)
    params = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**params, "model_type": "kimi_k2"}))
    ids = prompt_ids[:30]
    np.testing.assert_array_equal(strata_logits(load_model(path), ids), strata_logits(model, ids))
