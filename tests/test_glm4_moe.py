"""GLM-4.5 / 4.6 / 4.7 MoE (`glm4_moe`, issue 34), in float32 on the CPU, on tiny random checkpoints
built once per session (hf_checkpoints.py: a dense layer, two MoE layers with group routing, q/k
norm, q/k/v biases, partial rotary; the "-air" variant without q/k norm and groups):

- Hugging Face layouts (transformers' save, the in-memory state dict with fused experts, the
  published layout with an MTP layer): logits within 1e-4 of transformers' over a 214-token
  prompt; greedy 32-token continuations equal to transformers' `generate`, serially, with 3 suffix
  drafts, `auto` and scripted (partly wrong) drafts; seeded sampling the same in every draft mode;
  forced rejection at every keep of T = 2..8 equal to serial decoding (hybrid_parity.py, state_checks.py);
- MLX layout (mlx-lm's conversion of the published checkpoint: unquantized, 4- and 8-bit, and a
  mixed 4/6-bit recipe with per-layer records): logits and greedy tokens against mlx-lm;
- the MTP layer kept aside (loaded, unused, written back by convert under its published names,
  optional tensors too), what is refused, in one line; `strata convert` (plain, `--bits 4`,
  `--stream`), streamed bit-identical to resident at 3 and 5 cache slots.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_checkpoints import (
    GLM_LAYOUTS,
    checkpoint_root,
    glm_checkpoint,
    glm_hf_model,
    glm_mlx_checkpoint,
    glm_mtp_tensors,
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
    strata_tokens,
)
from mlx.utils import tree_flatten
from state_checks import check_forced_rejections, serial_decode

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.moe import QuantizedSwitchGLU, SwitchGLU
from strata_cli.options import ConfigError, ConvertOptions, EngineOptions, MoceOptions, SpecOptions, StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
MTP_LAYER = "model.layers.3"  # after the 3 decoder layers
_cache: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())
    assert len(ids) >= 64
    return ids


def loaded(root, layout: str = "published", variant: str = ""):
    key = (layout, variant)
    if key not in _cache:
        _cache[key] = load_model(glm_checkpoint(root, layout, variant))
    return _cache[key]


def reference_logits(ids, variant: str = ""):
    key = ("hf logits", variant)
    if key not in _cache:
        _cache[key] = hf_logits(glm_hf_model(variant), ids)
    return _cache[key]


@pytest.mark.parametrize("layout", GLM_LAYOUTS)
def test_logits_match_transformers(root, prompt_ids, layout):
    check_logits(strata_logits(loaded(root, layout), prompt_ids), reference_logits(prompt_ids), layout)


def test_air_settings_match_transformers(root, prompt_ids):
    """No q/k norm, one group of experts, whole-head rotary: GLM-4.5-Air's choices."""
    model = loaded(root, "hf", "-air")
    assert "q_norm" not in model.layers[0].self_attn and model.layers[0].self_attn.rotary_dim == 32
    check_logits(strata_logits(model, prompt_ids), reference_logits(prompt_ids, "-air"), "air")


def test_greedy_and_drafts_match_transformers_generate(root, prompt_ids):
    check_greedy(loaded(root), prompt_ids, hf_greedy(glm_hf_model(), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(root, prompt_ids):
    check_seeded_sampling(loaded(root), prompt_ids)


@pytest.mark.parametrize("fold", ["lazy", "eager"])
def test_forced_rejection_matches_serial(root, fold):
    """tests/test_window_rollback.py's check on GLM: every row past the rejection leaves no trace."""
    model = loaded(root)
    if "serial" not in _cache:
        _cache["serial"] = serial_decode(model, 20)
    checked = sum(check_forced_rejections(model, EngineOptions(fold=fold), _cache["serial"], pos0, 1e-5)
                  for pos0 in (8, 11))
    assert checked == 2 * sum(range(2, 9))


@pytest.mark.parametrize("bits", [None, 4, 8, "mixed_4_6"], ids=["unquantized", "q4", "q8", "mixed"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, bits):
    path = glm_mlx_checkpoint(root, bits)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path, dequantize=False)  # the quantized path itself (the CPU default dequantizes)
    moe = model.layers[1].mlp
    assert isinstance(moe.switch_mlp, QuantizedSwitchGLU if bits else SwitchGLU)
    if bits == "mixed_4_6":  # per-layer records: some layers at 6 bits, the rest at 4
        widths = {m.bits for _, m in model.named_modules() if hasattr(m, "bits")}
        assert widths == {4, 6}, widths
    elif bits:
        assert moe.switch_mlp.gate_proj.bits == bits and model.layers[0].self_attn.q_proj.bits == bits
    assert moe.gate.weight.dtype == mx.float32 and "MTP: config.json lists 1" in model.load_notes[0]
    for candidate in (model, load_model(path)):  # quantized dense layers, and the CPU's dequantized ones
        check_logits(strata_logits(candidate, prompt_ids), reference, f"mlx layout {bits}")
    check_greedy(model, prompt_ids, tokens)


def test_mtp_layer_is_kept_aside(root):
    """The published MTP layer loads at its own index, experts stacked, unused by the forward pass
    (transformers' save, which holds none, gives the same logits: test_logits_match_transformers)."""
    model = loaded(root)
    assert len(model.layers) == 3 and len(model.mtp_layers) == 1
    kept = {f"{MTP_LAYER}.{k}": v for k, v in tree_flatten(model.mtp_layers[0].parameters())}
    source = {k: mx.array(v.numpy()) for k, v in glm_mtp_tensors().items()}
    for name in ("eh_proj.weight", "shared_head.norm.weight", "self_attn.q_proj.bias",
                 "mlp.gate.e_score_correction_bias"):
        assert mx.array_equal(kept[f"{MTP_LAYER}.{name}"], source[f"{MTP_LAYER}.{name}"]), name
    stacked = mx.stack([source[f"{MTP_LAYER}.mlp.experts.{e}.up_proj.weight"] for e in range(8)])
    assert mx.array_equal(kept[f"{MTP_LAYER}.mlp.switch_mlp.up_proj"], stacked)
    assert len(kept) == len(source) - 3 * 8 + 3
    assert model.load_notes == [f"MTP: 1 layer(s) ({MTP_LAYER}), {len(kept)} tensors loaded and kept aside, unused"]
    assert not loaded(root, "hf").mtp_layers and loaded(root, "hf").config.num_nextn_predict_layers == 0


def _published_copy(root, path, edit=None):
    shutil.copytree(glm_checkpoint(root, "published"), path)
    if edit is not None:
        shard = path / "model-mtp.safetensors"
        tensors = mx.load(str(shard))
        edit(tensors)
        mx.save_safetensors(str(shard), tensors)
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if v != shard.name},
                               **dict.fromkeys(tensors, shard.name)}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_optional_mtp_tensors_survive_convert(root, prompt_ids, tmp_path):
    """An MTP layer with its own embed_tokens and shared_head.head (some checkpoints carry them)
    loads, and `strata convert` writes every MTP tensor back under its published name; the
    converted checkpoint loads them again (strata's own layout) and computes the same logits."""
    def optional(tensors):
        tensors[f"{MTP_LAYER}.embed_tokens.weight"] = mx.ones((512, 64))
        tensors[f"{MTP_LAYER}.shared_head.head.weight"] = mx.full((512, 64), 2.0)

    src = _published_copy(root, tmp_path / "src", optional)
    model = load_model(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out)])
    assert result.exit_code == 0, result.output
    written = {}
    for shard in out.glob("*.safetensors"):
        written.update(mx.load(str(shard)))
    mtp = {k: v for k, v in written.items() if k.startswith(f"{MTP_LAYER}.")}
    assert mx.array_equal(mtp[f"{MTP_LAYER}.shared_head.head.weight"], mx.full((512, 64), 2.0))
    assert mx.array_equal(mtp[f"{MTP_LAYER}.mlp.switch_mlp.down_proj.weight"],
                          model.mtp_layers[0]["mlp"]["switch_mlp"]["down_proj"])
    assert len(mtp) == len(tree_flatten(model.mtp_layers[0].parameters())) == 23 + 2
    again = load_model(out)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert [k for k, _ in tree_flatten(again.mtp_layers[0].parameters())] == \
        [k for k, _ in tree_flatten(model.mtp_layers[0].parameters())]
    np.testing.assert_array_equal(strata_logits(again, prompt_ids[:40]), strata_logits(model, prompt_ids[:40]))


def _refusal(path) -> str:
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_what_is_refused_is_said_in_one_line(root, tmp_path):
    def unknown_mtp_tensor(tensors):  # never dropped in silence
        tensors[f"{MTP_LAYER}.mystery.weight"] = mx.zeros((4, 4))

    assert f"unexpected tensors {MTP_LAYER}.mystery.weight" in _refusal(_published_copy(root, tmp_path / "a",
                                                                                        unknown_mtp_tensor))

    def second_mtp_layer(tensors):  # config.json lists one
        tensors["model.layers.4.enorm.weight"] = mx.zeros((64,))

    assert "unexpected tensors model.layers.4.enorm.weight" in _refusal(_published_copy(root, tmp_path / "b",
                                                                                       second_mtp_layer))
    for n, (edit, expected) in enumerate([
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
         "rope scaling is not supported"),
        (dict(n_group=3), "must split into n_group (3) groups"),
        (dict(num_experts_per_tok=5), "exceeds the experts of topk_group (1) groups"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2}),
         "partial_rotary_factor must be in (0, 1], got 2"),
        (dict(head_dim=18), "gives 9 rotary dims; they must be even"),
        (dict(n_routed_experts="8"), 'n_routed_experts must be a positive integer, got "8" (a string)'),
    ]):
        path = shutil.copytree(glm_checkpoint(root, "hf"), tmp_path / f"c{n}")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **edit}))
        assert expected in _refusal(path), edit


@pytest.fixture(scope="module")
def converted(root, tmp_path_factory):
    out = tmp_path_factory.mktemp("glm_convert")
    src = glm_checkpoint(root, "published")
    q4 = convert(src, out / "q4", options=ConvertOptions(bits=4)).path
    streamed = convert(src, out / "q4-stream", options=ConvertOptions(bits=4, stream=True)).path
    return q4, streamed


def test_convert_is_the_source_model(root, prompt_ids, tmp_path):
    src = glm_checkpoint(root, "published")
    out = convert(src, tmp_path / "out", options=ConvertOptions()).path
    np.testing.assert_array_equal(strata_logits(load_model(out), prompt_ids), strata_logits(loaded(root), prompt_ids))


def test_convert_q4_decodes_as_mlx_lm_q4(root, prompt_ids, converted):
    """`strata convert --bits 4` quantizes what mlx-lm's converter does (the router is no linear:
    left in float32): the same quantization block, logits within 1e-5 and greedy tokens of
    mlx-lm's own 4-bit conversion; mlx-lm loads strata's output (dropping the MTP layer)."""
    from strata_cli.bench.peers import MlxLmPeer

    q4, _ = converted
    expected = json.loads((glm_mlx_checkpoint(root, 4) / "config.json").read_text())["quantization"]
    assert json.loads((q4 / "config.json").read_text())["quantization"] == expected
    model, reference = load_model(q4), load_model(glm_mlx_checkpoint(root, 4))
    np.testing.assert_allclose(strata_logits(model, prompt_ids), strata_logits(reference, prompt_ids),
                               rtol=0, atol=1e-5)
    assert strata_tokens(model, prompt_ids, SpecOptions())[0] == strata_tokens(reference, prompt_ids, SpecOptions())[0]
    assert len(model.mtp_layers) == 1 and model.config.num_nextn_predict_layers == 1
    peer = MlxLmPeer.load(q4, dtype=mx.float32).model
    ids = prompt_ids[:24]
    np.testing.assert_allclose(strata_logits(model, ids), np.array(peer(mx.array([ids]))[0]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("slots", [3, 5])
def test_streamed_convert_is_bit_identical(prompt_ids, converted, slots):
    q4, streamed_path = converted
    if "q4 model" not in _cache:
        _cache["q4 model"] = load_model(q4)
    resident = _cache["q4 model"]
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=slots))
    try:
        assert streamed.expert_cache.num_slots == slots  # below top-k · rows: windows served in several passes
        assert len(streamed.mtp_layers) == 1  # the MTP layer's experts stay in the shards, unstreamed
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in (SpecOptions(), SpecOptions(max_drafts=3)):
            assert strata_tokens(streamed, prompt_ids, spec)[0] == strata_tokens(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()


def test_moce_is_refused_in_one_line(converted):
    _, streamed_path = converted
    with pytest.raises(ConfigError, match="needs a softmax router; model.layers.1.mlp routes by sigmoid"):
        load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3), moce=MoceOptions(protect=1))


def test_router_stays_float32_in_bfloat16(root):
    model = load_model(glm_checkpoint(root, "published"), dtype="bfloat16")
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == mx.float32
    assert model.layers[1].mlp.switch_mlp.gate_proj.dtype == mx.bfloat16


def test_generate_stats_says_what_the_load_kept_aside(root):
    path = glm_checkpoint(root, "published")
    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "2", "--stats", "--model", str(path)])
    assert result.exit_code == 0, result.output
    assert f"note: MTP: 1 layer(s) ({MTP_LAYER})" in result.stderr
