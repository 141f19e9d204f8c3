"""What `strata convert` writes, mlx-lm loads: the same tensors, and the same logits as strata's own
load of the same files (so `strata bench`'s mlx-lm peer runs on a converted, quantized demo model)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from hf_checkpoints import checkpoint_root, hf_checkpoint, prompt_text, tokenizer_dir

from strata_cli.bench.peers import MlxLmPeer
from strata_cli.convert import convert
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.options import ConvertOptions
from strata_cli.tokenizer import Tokenizer

pytest.importorskip("mlx_lm", reason="the mlx-lm peer is the 'bench' extra")

# Both sides compute in float32 from the same stored (quantized) weights; measured up to 9e-6.
ATOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def ids(root):
    return Tokenizer(tokenizer_dir(root)).encode(prompt_text())[:24]


@pytest.mark.parametrize(
    "family, bits", [("qwen3_next", 8), ("qwen3_next", 4), ("qwen3_next", None), ("qwen3_moe", 4), ("mixtral", 8)]
)
def test_mlx_lm_loads_the_converted_checkpoint(root, ids, tmp_path, family, bits):
    out = convert(hf_checkpoint(root, family), tmp_path / "out", options=ConvertOptions(bits=bits)).path
    config = json.loads((out / "config.json").read_text())
    if bits is not None:  # mlx-lm writes both keys
        assert config["quantization_config"] == config["quantization"] and config["quantization"]["bits"] == bits
    peer = MlxLmPeer.load(out, dtype=mx.float32).model
    expected = np.array(peer(mx.array([ids]))[0])
    got = np.array(WindowEngine(load_model(out)).run(ids, 0).logits)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert np.abs(expected).max() > 1  # logits of a real model, not zeros that match anything
