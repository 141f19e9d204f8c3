"""GPT-OSS (`gpt_oss`) against transformers and mlx-lm on tiny random checkpoints
(tests/gpt_oss_checkpoints.py): sliding-window and full layers with sinks, YaRN rope, biased
clamped-SwiGLU experts, float and MXFP4; what is checked: tests/hybrid_parity.py."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gpt_oss_checkpoints import (
    WINDOW,
    dequantize_blocks,
    hf_checkpoint,
    hf_model,
    hf_mxfp4_checkpoint,
    mlx_checkpoint,
    mxfp4_blocks,
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

from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.model.biased_experts import ExpertLinear, QuantizedExpertLinear
from strata_cli.model.config import ConfigError
from strata_cli.model.gpt_oss import Config
from strata_cli.model.layers import WINDOW_ROWS, RowSplit
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.sink_attention import rope_periods
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())
    assert len(ids) >= 8 * WINDOW  # the sliding layers' ring wraps many times
    return ids


@pytest.fixture(scope="module")
def model(root):
    return load_model(hf_checkpoint(root))


@pytest.fixture(scope="module")
def mxfp4_model(root):
    return load_model(hf_mxfp4_checkpoint(root))


def serial_logits(model, ids: list[int]) -> np.ndarray:
    """Every row's logits decoding one token at a time (the ring and the decode-window path)."""
    engine = WindowEngine(model)
    rows = []
    for pos, token in enumerate(ids):
        rows.append(engine.run([token], pos).logits[0])
        engine.commit(1)
    return np.array(mx.stack(rows))


def test_mlx_mxfp4_bits_are_transformers_mxfp4():
    """MLX's mxfp4 packing read as transformers reads `*_blocks` / `*_scales` (low nibble first,
    E2M1 table, 2^(scale-127)) gives MLX's own dequantization: the published tensors can be kept
    as MLX mxfp4 weights by viewing the bytes."""
    w = np.random.default_rng(0).normal(size=(3, 8, 96)).astype(np.float32) * 3
    blocks, scales = mxfp4_blocks(w)
    words = mx.array(blocks).view(mx.uint32).reshape(3, 8, -1)
    mine = mx.dequantize(words, mx.array(scales), None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert np.array_equal(dequantize_blocks(blocks, scales), np.array(mine))
    assert np.abs(dequantize_blocks(blocks, scales) - w).max() < 0.6 * np.abs(w).max()


def test_logits_match_transformers(model, prompt_ids):
    reference = hf_logits(hf_model(), prompt_ids)
    check_logits(strata_logits(model, prompt_ids), reference, "HF layout, one window")
    check_logits(serial_logits(model, prompt_ids), reference, "HF layout, serial")


def test_mxfp4_layout_matches_transformers(mxfp4_model, prompt_ids):
    experts = mxfp4_model.layers[0].mlp.experts
    assert isinstance(experts.gate_proj, QuantizedExpertLinear) and experts.gate_proj.mode == "mxfp4"
    reference = hf_logits(hf_model(mxfp4=True), prompt_ids)
    check_logits(strata_logits(mxfp4_model, prompt_ids), reference, "MXFP4 layout, one window")
    check_logits(serial_logits(mxfp4_model, prompt_ids), reference, "MXFP4 layout, serial")


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(hf_model(), prompt_ids))


def test_mxfp4_greedy_matches_transformers_generate(mxfp4_model, prompt_ids):
    check_greedy(mxfp4_model, prompt_ids, hf_greedy(hf_model(mxfp4=True), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float32", "mxfp4"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, mxfp4):
    path = mlx_checkpoint(root, mxfp4)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path)
    kind = QuantizedExpertLinear if mxfp4 else ExpertLinear
    assert isinstance(model.layers[1].mlp.experts.down_proj, kind)
    check_logits(strata_logits(model, prompt_ids), reference, f"mlx layout ({'mxfp4' if mxfp4 else 'float32'})")
    check_greedy(model, prompt_ids, tokens)


@pytest.mark.parametrize("row_split", ["auto", "always"])
def test_every_row_of_a_window_equals_its_serial_logits(model, prompt_ids, row_split, monkeypatch):
    """Row invariance, bit for bit, with the ring wrapped: "auto" is what the CPU runs, "always"
    the GPU backends' path (each row its own sdpa call)."""
    monkeypatch.setattr(RowSplit, "mode", row_split)
    engine = WindowEngine(model)
    start_pos = 3 * WINDOW + 5
    engine.prefill(prompt_ids[:start_pos])
    start = engine.snapshot()
    alone = []
    for i in range(WINDOW_ROWS):
        alone.append(engine.run([prompt_ids[start_pos + i]], start_pos + i).logits[0])
        engine.commit(1)
    engine.restore(start)
    together = engine.run(prompt_ids[start_pos : start_pos + WINDOW_ROWS], start_pos).logits
    assert mx.array_equal(together, mx.stack(alone)).item()


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_periods_match_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = GptOssConfig(head_dim=64, hidden_size=128, num_attention_heads=2, rope_parameters=rope,
                          max_position_embeddings=131072)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    periods, mine = rope_periods(64, 150000.0, {k: v for k, v in rope.items() if k != "rope_theta"})
    assert mine == pytest.approx(factor, rel=1e-12)
    assert np.allclose(1 / periods, inv_freq.numpy(), rtol=1e-6, atol=0)


def test_config_reads_the_published_spelling(root):
    params = json.loads((hf_mxfp4_checkpoint(root) / "config.json").read_text())
    config = Config.from_dict(params)
    assert config.rope_scaling["truncate"] is False and config.rope_theta == 10000.0
    assert config.layer_types[:2] == ("sliding_attention", "full_attention") and config.sliding_window == WINDOW


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3' is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     r"layer_types \['chunked_attention'\] are not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers, num_hidden_layers is 4"),
    ({"sliding_window": None}, "'sliding_attention' layers but sliding_window is null"),
])
def test_config_refusals(root, change, words):
    params = json.loads((hf_mxfp4_checkpoint(root) / "config.json").read_text())
    with pytest.raises(ConfigError, match=words):
        Config.from_dict({**params, **change})


def test_a_half_mxfp4_expert_is_refused_with_the_file(root, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(hf_mxfp4_checkpoint(root), path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.2.mlp.experts.down_proj_scales"):
        load_model(path)


def test_other_quantization_configs_are_still_refused(root, tmp_path):
    path = tmp_path / "fp8"
    shutil.copytree(hf_checkpoint(root), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'fp8'"):
        load_model(path)


def test_prefill_chunks_cross_the_window(model, prompt_ids):
    """Prompt chunks of every size against the ring (short chunks take the ring, long ones the
    positional band; a chunk boundary anywhere in the window) end on transformers' last logits."""
    reference = hf_logits(hf_model(), prompt_ids)[-1]
    for chunk in (3, WINDOW - 1, WINDOW + 7, 17, 512):
        last = WindowEngine(model).prefill(prompt_ids, chunk=chunk)
        assert float(mx.abs(last - mx.array(reference)).max()) <= 1e-4, chunk


def test_bfloat16_windows_equal_serial(root, prompt_ids):
    """In bfloat16 (the GPU dtype) the greedy tokens with drafts are serial decoding's."""
    from hybrid_parity import MODES, strata_tokens

    model = load_model(hf_checkpoint(root), dtype="bfloat16")
    runs = [strata_tokens(model, prompt_ids, spec)[0] for spec in MODES.values()]
    assert runs[0] == runs[1] == runs[2]


def test_qkv_is_stacked_at_load(model):
    """Loading stacks q, k and v with their biases (`layers.StackedRows`): one matmul per head."""
    from strata_cli.model.layers import stacked

    assert all(stacked(layer.self_attn, "_qkv_rows") is not None for layer in model.layers)


def test_sinks_change_the_output(model, prompt_ids):
    """The sinks take weight (the comparison above would see a model that ignored them)."""
    layer = model.layers[0].self_attn
    saved = layer.sinks
    base = strata_logits(model, prompt_ids[:20])
    try:
        layer.sinks = saved + 3.0
        moved = strata_logits(model, prompt_ids[:20])
    finally:
        layer.sinks = saved
    assert np.abs(moved - base).max() > 1e-2


def test_quantization_blocks_name_mxfp4_and_refuse_other_modes(mxfp4_model):
    from strata_cli.model.quant import Quantization, recorded_quantization

    block = {"group_size": 32, "bits": 4, "mode": "mxfp4", "model.layers.0.mlp.router": {"group_size": 64, "bits": 8}}
    q = Quantization.from_config(block)
    assert q.settings("model.layers.0.mlp.experts.up_proj") == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert q.settings("model.layers.0.mlp.router") == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert q.to_config() == block
    with pytest.raises(ConfigError, match="mode 'mxfp4' needs group_size 32 and bits 4, got 64 and 4"):
        Quantization.from_config({"group_size": 64, "bits": 4, "mode": "mxfp4"})
    with pytest.raises(ConfigError, match="mode 'nvfp4' is not supported"):
        Quantization.from_config({"group_size": 16, "bits": 4, "mode": "nvfp4"})
    assert recorded_quantization(mxfp4_model) == {"group_size": 32, "bits": 4, "mode": "mxfp4"}


@pytest.fixture
def on_gpu(monkeypatch):
    """mx.default_device() says GPU (the ops still run on the CPU; no kernel passes its probe
    here, so their MLX fallbacks run); numpy's BLAS off."""
    from strata_cli.model.host_blas import HostBlas

    monkeypatch.setattr(HostBlas, "mode", "mlx")
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float32", "mxfp4"])
def test_gpu_prompt_and_window_forms_match_transformers(root, prompt_ids, mxfp4, on_gpu, monkeypatch):
    """The GPU backends' forms, run on the CPU: prompt chunks with the masked sdpa (band for the
    sliding layers) and padded expert batches, decode windows split by row (each row its own
    sdpa call over the ring); logits within the parity tolerance of transformers."""
    from strata_cli.model import moe

    monkeypatch.setattr(moe, "PADDED_MAX_ROWS_PER_PICK", 100)  # every prompt batch padded
    model = load_model(hf_mxfp4_checkpoint(root) if mxfp4 else hf_checkpoint(root))
    reference = hf_logits(hf_model(mxfp4=mxfp4), prompt_ids)
    check_logits(strata_logits(model, prompt_ids), reference, "GPU prompt form")
    engine = WindowEngine(model)
    engine.prefill(prompt_ids[:100])
    rows = engine.run(prompt_ids[100:108], 100).logits
    check_logits(np.array(rows), reference[100:108], "GPU window form")
