"""`strata convert` of GPT-OSS (tests/gpt_oss_checkpoints.py's tiny checkpoints):

- unquantized, from transformers' float layout and from the published MXFP4 layout: the converted
  checkpoint gives the source's logits bit for bit (MXFP4 experts stay MXFP4, recorded in the
  output's quantization block), and mlx-lm reads it as it reads the source;
- `--bits 4`: the same model as mlx-lm's own 4-bit conversion of the same source (dense layers
  affine 4-bit, routers 8-bit, MXFP4 experts kept), logits within 1e-5, the same greedy tokens;
- `--stream`: the experts (with their biases) streamed through fewer cache slots than a window
  needs give the resident model's logits and tokens bit for bit.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from gpt_oss_checkpoints import hf_checkpoint, hf_mxfp4_checkpoint
from hf_checkpoints import checkpoint_root, prompt_text, tokenizer_dir
from hybrid_parity import strata_logits, strata_tokens

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.options import ConvertOptions, SpecOptions, StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
SOURCES = {"float": hf_checkpoint, "mxfp4": hf_mxfp4_checkpoint}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    return Tokenizer(tokenizer_dir(root)).encode(prompt_text())


def mlx_lm_logits(path, ids) -> np.ndarray:
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(path))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def as_mlx_lm_reads_it(path, tmp_path):
    """A copy of a strata-written checkpoint with the two settings mlx-lm 0.32's gpt_oss ignores set
    to what it assumes (YaRN's range truncated, the SwiGLU limit 7): then both engines run one
    model, and their logits say whether they read the same tensors."""
    copy = tmp_path / f"{path.name}-as-mlx-lm-reads-it"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):  # the output keeps the source's spelling too
        if key in config:
            config[key]["truncate"] = True
    config["swiglu_limit"] = 7.0
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def published_for_mlx_lm(root, tmp_path):
    """The MXFP4 source as mlx-lm's converter reads it (it reads the published layout; not
    transformers' float save, whose fused experts it slices along the wrong axis)."""
    return hf_mxfp4_checkpoint(root)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_convert_is_the_source_model(root, prompt_ids, tmp_path, source):
    src, out = SOURCES[source](root), tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out)])
    assert result.exit_code == 0, result.output
    converted = load_model(out)
    np.testing.assert_array_equal(strata_logits(converted, prompt_ids), strata_logits(load_model(src), prompt_ids))
    config = json.loads((out / "config.json").read_text())
    if source == "mxfp4":
        assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        assert converted.layers[0].mlp.experts.up_proj.mode == "mxfp4"
    else:
        assert "quantization" not in config
    ids = prompt_ids[:24]  # mlx-lm reads strata's output as strata does
    same = as_mlx_lm_reads_it(out, tmp_path)
    np.testing.assert_allclose(mlx_lm_logits(same, ids), strata_logits(load_model(same), ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_convert_q4_is_mlx_lm_q4(root, prompt_ids, tmp_path, source):
    from mlx_lm.convert import convert as mlx_lm_convert

    result = convert(SOURCES[source](root), tmp_path / "q4", options=ConvertOptions(bits=4))
    # mlx-lm converts the published layout itself, and transformers' float one through strata's
    # unquantized conversion (which it reads: the test above)
    plain = published_for_mlx_lm(root, tmp_path) if source == "mxfp4" else convert(
        SOURCES[source](root), tmp_path / "plain", options=ConvertOptions()).path
    reference_path = tmp_path / "mlx-lm-q4"
    mlx_lm_convert(str(plain), str(reference_path), quantize=True, q_bits=4, q_group_size=64)
    layer = "model.layers.0"
    assert result.quantization["bits"] == 4 and result.quantization[f"{layer}.mlp.router"]["bits"] == 8
    if source == "mxfp4":
        assert result.quantization[f"{layer}.mlp.experts.gate_proj"]["mode"] == "mxfp4"
    model, reference = load_model(result.path, dequantize=False), load_model(reference_path, dequantize=False)
    assert model.layers[0].self_attn.q_proj.bits == 4 and model.layers[0].mlp.router.bits == 8
    np.testing.assert_allclose(strata_logits(model, prompt_ids), strata_logits(reference, prompt_ids), rtol=0,
                               atol=1e-5)
    spec = SpecOptions(max_drafts=3)
    assert strata_tokens(model, prompt_ids, spec)[0] == strata_tokens(reference, prompt_ids, SpecOptions())[0]


@pytest.mark.parametrize("source, bits", [("float", None), ("mxfp4", None), ("float", 4)],
                         ids=["float", "mxfp4", "float-q4"])
def test_streamed_experts_are_bit_identical(root, prompt_ids, tmp_path, source, bits):
    """`convert --stream`: the biased experts (float, mxfp4 or affine 4-bit) served from disk
    through 3 of 4 cache slots give the resident model's logits and greedy tokens bit for bit
    (serial and with drafts): the streamed switch adds the biases and clamps as the resident one."""
    src = SOURCES[source](root)
    resident = load_model(convert(src, tmp_path / "resident", options=ConvertOptions(bits=bits)).path)
    streamed_path = convert(src, tmp_path / "stream", options=ConvertOptions(bits=bits, stream=True)).path
    index = json.loads((streamed_path / "experts" / "index.json").read_text())
    names = [t["name"] for t in index["blocks"][0]["tensors"]]
    assert "gate_proj.bias" in names and "down_proj.bias" in names
    assert index["version"] == 2 and {b["kind"] for b in index["blocks"]} == {"glu"}
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in (SpecOptions(), SpecOptions(max_drafts=3)):
            assert strata_tokens(streamed, prompt_ids, spec)[0] == strata_tokens(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()


def test_cache_aware_routing_is_refused_in_one_line(root, tmp_path):
    from strata_cli.options import ConfigError, MoceOptions

    path = convert(SOURCES["float"](root), tmp_path / "stream", options=ConvertOptions(stream=True)).path
    with pytest.raises(ConfigError, match="cache-aware routing .* is not supported for GptOssMoe blocks"):
        load_checkpoint(path, moce=MoceOptions(protect=1))


def test_a_layout_without_the_models_bias_rows_is_refused(root, tmp_path):
    """Records whose index lists no bias rows for experts that have them would drop the biases:
    the load refuses it in one line, naming the tensor."""
    from strata_cli.model.loader import ModelLoadError

    path = convert(SOURCES["float"](root), tmp_path / "stream", options=ConvertOptions(stream=True)).path
    index_path = path / "experts" / "index.json"
    index = json.loads(index_path.read_text())
    block = index["blocks"][0]
    block["tensors"] = [t for t in block["tensors"] if t["name"] != "down_proj.bias"]
    index_path.write_text(json.dumps(index))
    (path / "checksums.json").unlink()  # only the layout checks stand between the index and the model
    with pytest.raises(ModelLoadError, match=r"\.down_proj\.bias is nothing, the model needs \(\d+,\)"):
        load_checkpoint(path, stream=StreamOptions(resident_experts=3))
