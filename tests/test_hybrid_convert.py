"""`strata convert` of the Mamba-2 hybrids (Nemotron-H, Granite-4.0-H), from the Hugging Face
layout of each family's tiny random checkpoint (tests/hf_checkpoints.py):

- unquantized: the converted checkpoint gives the source's logits bit for bit and its greedy tokens;
- `--bits 4`: the same quantization block as mlx-lm's own 4-bit conversion of the same source, logits
  within 1e-5 of strata loading that conversion, the same greedy tokens; mlx-lm loads strata's output;
- `--stream` and `--bits 4 --stream`: each family's experts (Granite's SwiGLU, Nemotron-H's relu²
  records) stream bit-identically to resident at 3 cache slots (window logits, serial and 3-draft
  greedy); `strata verify` checks the relu² records' crc32 as it checks the others; a model with no
  experts is refused in one line before anything is written.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from hf_checkpoints import (
    checkpoint_root,
    hybrid_hf_checkpoint,
    hybrid_mlx_checkpoint,
    prompt_text,
    tokenizer_dir,
)
from hybrid_parity import strata_logits, strata_tokens

from strata_cli.cli import cli
from strata_cli.convert import ConvertError, convert
from strata_cli.engine.window import WindowEngine
from strata_cli.experts.store import ExpertStoreError, read_index
from strata_cli.model import load_model
from strata_cli.model.granitemoehybrid import granite_glu_by_expert
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.moe import glu_by_expert
from strata_cli.options import ConvertOptions, SpecOptions, StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.tokenizer import Tokenizer
from strata_cli.verify import verify_checkpoint

pytestmark = pytest.mark.parity
FAMILIES = ("nemotron_h", "granitemoehybrid")
SPECS = {"serial": SpecOptions(), "draft3": SpecOptions(max_drafts=3)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    return Tokenizer(tokenizer_dir(root)).encode(prompt_text())


def greedy(model, ids, spec=SPECS["serial"]):
    return strata_tokens(model, ids, spec)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_is_the_source_model(root, prompt_ids, tmp_path, family):
    """`strata convert SRC DST` (the CLI) writes the source's model: the same logits bit for bit."""
    src, out = hybrid_hf_checkpoint(root, family), tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out)])
    assert result.exit_code == 0, result.output
    source, converted = load_model(src), load_model(out)
    np.testing.assert_array_equal(strata_logits(converted, prompt_ids), strata_logits(source, prompt_ids))
    assert greedy(converted, prompt_ids) == greedy(source, prompt_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_q4_decodes_as_mlx_lm_q4(root, prompt_ids, tmp_path, family):
    from strata_cli.bench.peers import MlxLmPeer

    result = convert(hybrid_hf_checkpoint(root, family), tmp_path / "q4", options=ConvertOptions(bits=4))
    reference_path = hybrid_mlx_checkpoint(root, family, 4)
    expected = json.loads((reference_path / "config.json").read_text())["quantization"]
    assert result.quantization == expected  # the same layers at the same widths
    model, reference = load_model(result.path), load_model(reference_path)
    np.testing.assert_allclose(strata_logits(model, prompt_ids), strata_logits(reference, prompt_ids), rtol=0, atol=1e-5)
    assert greedy(model, prompt_ids) == greedy(reference, prompt_ids)
    peer = MlxLmPeer.load(result.path, dtype=mx.float32).model  # mlx-lm loads strata's output
    ids = prompt_ids[:24]
    np.testing.assert_allclose(strata_logits(model, ids), np.array(peer(mx.array([ids]))[0]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bits", [None, 4], ids=["plain", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_convert_is_bit_identical(root, prompt_ids, tmp_path, family, bits, monkeypatch):
    src = hybrid_hf_checkpoint(root, family)
    full = convert(src, tmp_path / "full", options=ConvertOptions(bits=bits)).path
    streamed_path = convert(src, tmp_path / "stream", options=ConvertOptions(bits=bits, stream=True)).path
    index = json.loads((streamed_path / "experts" / "index.json").read_text())
    kind = {"nemotron_h": "relu2", "granitemoehybrid": "glu"}[family]
    assert index["version"] == 2 and {b["kind"] for b in index["blocks"]} == {kind}
    assert all(bool(b["quantization"]) == (bits is not None) for b in index["blocks"])
    resident = load_model(full)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        assert len(streamed.expert_cache.paths) == len(index["blocks"]) == {"nemotron_h": 2, "granitemoehybrid": 4}[family]
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in SPECS.values():
            assert greedy(streamed, prompt_ids, spec) == greedy(resident, prompt_ids, spec)
        if family == "granitemoehybrid":  # the prompt form of the resident stack it replaces
            switch = streamed.layers[0].block_sparse_moe.switch_mlp
            assert switch.by_expert is (glu_by_expert if bits else granite_glu_by_expert)
            monkeypatch.setattr("strata_cli.model.granitemoehybrid.sorted_gather_is_exact", lambda: False)
            assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits,
                                  WindowEngine(resident).run(ids, 0).logits)  # the GPU prompt form, on the CPU
    finally:
        streamed.expert_cache.close()


def test_nemotron_streamed_records_verify_convert_back_and_corruption_is_named(root, tmp_path):
    out = tmp_path / "s"
    result = CliRunner().invoke(cli, ["convert", str(hybrid_hf_checkpoint(root, "nemotron_h")), str(out),
                                      "--bits", "4", "--stream"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "experts" / "index.json").read_text())
    records = sum(len(b["records"]) for b in index["blocks"])
    assert records == 2 * 8  # two E blocks of 8 experts
    assert verify_checkpoint(out).expert_records == records
    back = convert(out, tmp_path / "back", options=ConvertOptions()).path  # the relu² records read back whole
    assert not (back / "experts").exists()
    ids = list(range(3, 40))
    assert mx.array_equal(WindowEngine(load_model(back)).run(ids, 0).logits,
                          WindowEngine(load_model(convert(hybrid_hf_checkpoint(root, "nemotron_h"), tmp_path / "q4",
                                                          options=ConvertOptions(bits=4)).path)).run(ids, 0).logits)
    block = index["blocks"][1]
    offset, length, _ = block["records"][5]
    with open(out / "experts" / block["file"], "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ModelLoadError, match=rf"{block['file']}: crc32 mismatch in layer {block['layer']} .* expert 5 "):
        verify_checkpoint(out)


def test_relu2_index_with_the_wrong_tensors_is_refused(root, tmp_path):
    out = convert(hybrid_hf_checkpoint(root, "nemotron_h"), tmp_path / "s", options=ConvertOptions(stream=True)).path
    path = out / "experts" / "index.json"
    index = json.loads(path.read_text())
    assert [t["name"] for t in index["blocks"][0]["tensors"]] == ["fc1.weight", "fc2.weight"]
    index["blocks"][0]["kind"] = "glu"  # the record holds fc1/fc2, not gate/up/down
    path.write_text(json.dumps(index))
    (out / "checksums.json").unlink()  # only the field checks stand between the index and the model
    with pytest.raises(ExpertStoreError, match=r"a glu record needs .*down_proj is missing; fc1.weight is not one"):
        read_index(out)


def test_a_dense_model_stream_is_refused_in_one_line(root, tmp_path):
    src = hybrid_hf_checkpoint(root, "nemotron_h", "-dense", hybrid_override_pattern="M*M-")
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "s", options=ConvertOptions(bits=4, stream=True))
    assert "nemotron_h" in str(e.value) and "no MoE experts" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists() and not list(tmp_path.iterdir())


def test_nemotron_stream_refuses_options_that_read_softmax_probabilities(root, tmp_path):
    """Nemotron-H routes by sigmoid scores in groups: cache-aware routing and the read-ahead
    probability gate, which read softmax probabilities, are refused in one line, never ignored."""
    from strata_cli.options import ConfigError, MoceOptions

    out = convert(hybrid_hf_checkpoint(root, "nemotron_h"), tmp_path / "s", options=ConvertOptions(stream=True)).path
    for kwargs, says in ((dict(moce=MoceOptions(protect=1)), "--moce-protect"),
                         (dict(stream=StreamOptions(readahead_min_prob=0.1)), "--expert-readahead-min-prob")):
        with pytest.raises(ConfigError, match=says) as e:
            load_checkpoint(out, **kwargs)
        assert "sigmoid" in str(e.value) and "\n" not in str(e.value)
    model = load_checkpoint(out, stream=StreamOptions(prefetch="history", resident_experts=2))
    model.expert_cache.close()


def test_latent_experts_refuse_router_prefetch_in_one_line(tmp_path):
    """Experts in a latent space (`moe_latent_size`) take a projection of the input the router
    reads, so the next block's router cannot be applied to their input: router prefetch is refused
    (history prefetch serves them)."""
    from strata_cli.bench.hybrid_probe import CONFIG
    from strata_cli.experts.store import write_streamed_experts
    from strata_cli.experts.switch import attach_streamed_experts
    from strata_cli.model.nemotron_h import Model, NemotronHConfig
    from strata_cli.options import ConfigError

    config = NemotronHConfig.from_dict({**CONFIG, "moe_latent_size": 32})
    write_streamed_experts(Model(config), tmp_path)
    with pytest.raises(ConfigError, match="--expert-prefetch router: .*latent") as e:
        attach_streamed_experts(Model(config), tmp_path, dtype=mx.float32)
    assert "\n" not in str(e.value)
    model = Model(config)
    cache = attach_streamed_experts(model, tmp_path, dtype=mx.float32, options=StreamOptions(prefetch="history"))
    try:
        assert model.layers[1].mixer.switch_mlp.kind == "relu2" and not model.layers[1].mixer.compilable
    finally:
        cache.close()
