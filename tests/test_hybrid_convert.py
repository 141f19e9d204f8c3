"""`strata convert` of the Mamba-2 hybrids (Nemotron-H, Granite-4.0-H), from the Hugging Face
layout of each family's tiny random checkpoint (tests/hf_checkpoints.py):

- unquantized: the converted checkpoint gives the source's logits bit for bit and its greedy tokens;
- `--bits 4`: the same quantization block as mlx-lm's own 4-bit conversion of the same source, logits
  within 1e-5 of strata loading that conversion, the same greedy tokens; mlx-lm loads strata's output;
- `--stream`: Granite's experts stream bit-identically to resident at 3 cache slots; Nemotron-H
  (its experts are not a `SparseMoeBlock`) is refused in one line before anything is written.
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
from strata_cli.model import load_model
from strata_cli.options import ConvertOptions, SpecOptions, StreamOptions
from strata_cli.runtime import load_checkpoint
from strata_cli.tokenizer import Tokenizer

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


def test_granite_streamed_convert_is_bit_identical(root, prompt_ids, tmp_path):
    src = hybrid_hf_checkpoint(root, "granitemoehybrid")
    q4 = convert(src, tmp_path / "q4", options=ConvertOptions(bits=4)).path
    streamed_path = convert(src, tmp_path / "q4-stream", options=ConvertOptions(bits=4, stream=True)).path
    assert (streamed_path / "experts").is_dir()
    resident = load_model(q4)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in SPECS.values():
            assert greedy(streamed, prompt_ids, spec) == greedy(resident, prompt_ids, spec)
    finally:
        streamed.expert_cache.close()


def test_nemotron_stream_is_refused_in_one_line(root, tmp_path):
    with pytest.raises(ConvertError) as e:
        convert(hybrid_hf_checkpoint(root, "nemotron_h"), tmp_path / "s", options=ConvertOptions(bits=4, stream=True))
    assert "nemotron_h" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists() and not list(tmp_path.iterdir())
    result = CliRunner().invoke(cli, ["convert", str(hybrid_hf_checkpoint(root, "nemotron_h")), str(tmp_path / "s"),
                                      "--bits", "4", "--stream"])
    assert result.exit_code == 1 and "has no experts strata can stream" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "s").exists()
