"""Parity with references we did not write, in float32 on the CPU.

- Hugging Face layout: logits against transformers (max abs diff <= 1e-4 over the whole prompt,
  well over 64 tokens) and greedy 32-token continuations against transformers' `generate`,
  serial and with 3 suffix drafts per window.
- MLX layout (what mlx-lm's converter writes; 4 and 8 bit, group size 64, and unquantized):
  logits and greedy tokens against mlx-lm loading the same checkpoint.

The checkpoints are tiny random models of each family, built once per session (hf_checkpoints.py).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from hf_checkpoints import (
    FAMILIES,
    checkpoint_root,
    fused_checkpoint,
    hf_checkpoint,
    hf_model,
    mlx_checkpoint,
    prompt_text,
    tokenizer_dir,
)

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.model.moe import QuantizedSwitchGLU
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.telemetry import DecodeStats
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity

LOGIT_TOLERANCE = 1e-4
MIN_LOGIT_STD = 1.0  # the logits are far from flat, so a 1e-4 tolerance means something
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())
    assert len(ids) >= 64
    return ids


def strata_logits(model, ids: list[int]) -> np.ndarray:
    """Every row's logits from one window over the whole prompt."""
    out = WindowEngine(model).run(ids, 0)
    return np.array(out.logits)


def strata_greedy(model, ids: list[int], *, drafts: int) -> tuple[list[int], dict]:
    stats = DecodeStats()
    steps = generate(
        WindowEngine(model), ids, options=GenerateOptions(max_tokens=NUM_TOKENS),
        spec=SpecOptions(max_drafts=drafts), eos_ids=frozenset(), stats=stats,
    )
    return [t for step in steps for t in step.tokens], stats.summary()


def check_greedy(model, ids: list[int], reference: list[int]) -> None:
    assert len(reference) == NUM_TOKENS
    serial, _ = strata_greedy(model, ids, drafts=0)
    assert serial == reference
    speculative, summary = strata_greedy(model, ids, drafts=3)
    assert speculative == reference
    assert summary["drafts_offered"] > 0  # windows of T > 1 really ran (the prompt ends in a repeat)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(root, prompt_ids, family):
    with torch.no_grad():
        reference = hf_model(family)(torch.tensor([prompt_ids])).logits[0].numpy()
    logits = strata_logits(load_model(hf_checkpoint(root, family)), prompt_ids)
    assert reference.std() >= MIN_LOGIT_STD
    diff = np.abs(logits - reference).max()
    assert diff <= LOGIT_TOLERANCE, f"{family}: max abs logit diff {diff:.2e} over {len(prompt_ids)} tokens"


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_layout_matches_transformers(root, prompt_ids, family):
    with torch.no_grad():
        reference = hf_model(family)(torch.tensor([prompt_ids])).logits[0].numpy()
    logits = strata_logits(load_model(fused_checkpoint(root, family)), prompt_ids)
    diff = np.abs(logits - reference).max()
    assert diff <= LOGIT_TOLERANCE, f"{family} (fused experts): max abs logit diff {diff:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(root, prompt_ids, family):
    inputs = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model(family).generate(
            inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NUM_TOKENS, do_sample=False,
        )
    reference = out[0, len(prompt_ids):].tolist()
    check_greedy(load_model(hf_checkpoint(root, family)), prompt_ids, reference)


@pytest.mark.parametrize("bits", [4, 8, None], ids=["q4", "q8", "unquantized"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, family, bits):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    path = mlx_checkpoint(root, family, bits)
    reference_model, _ = mlx_lm_load(str(path))
    reference = np.array(reference_model(mx.array([prompt_ids]))[0])
    model = load_model(path, dequantize=False)  # the quantized path itself (the CPU default dequantizes)
    layer = model.layers[0]
    moe = layer.block_sparse_moe if family == "mixtral" else layer.mlp  # layer 0 is MoE in every family
    assert isinstance(moe.switch_mlp, QuantizedSwitchGLU) == (bits is not None)
    if bits is not None:
        assert moe.switch_mlp.gate_proj.bits == bits

    assert reference.std() >= MIN_LOGIT_STD
    diff = np.abs(strata_logits(model, prompt_ids) - reference).max()
    assert diff <= LOGIT_TOLERANCE, f"{family} {bits}-bit: max abs logit diff {diff:.2e}"
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt_ids), reference_model, max_tokens=NUM_TOKENS)]
    check_greedy(model, prompt_ids, tokens)


@pytest.mark.parametrize("bits", [4, 8], ids=["q4", "q8"])
def test_cpu_runs_small_quantized_dense_layers_dequantized(root, prompt_ids, bits, monkeypatch):
    """On the CPU a small quantized checkpoint's dense layers run dequantized (quant.dequantize_dense),
    its experts stay quantized, and the logits are the quantized path's up to float32 rounding."""
    from strata_cli.model import quant
    from strata_cli.model.layers import RowLinear, RowQuantizedLinear

    path = mlx_checkpoint(root, "qwen3_next", bits)
    quantized = load_model(path, dequantize=False)
    dense = load_model(path)  # the default on the CPU
    attention = next(layer.self_attn for layer in dense.layers if "self_attn" in layer)
    assert type(attention.q_proj) is RowLinear and type(dense.model.embed_tokens) is nn.Embedding
    assert isinstance(dense.layers[0].mlp.switch_mlp, QuantizedSwitchGLU)
    assert isinstance(next(layer.self_attn for layer in quantized.layers if "self_attn" in layer).q_proj,
                      RowQuantizedLinear)
    expected = strata_logits(quantized, prompt_ids)
    got = strata_logits(dense, prompt_ids)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()

    monkeypatch.setattr(quant, "DEQUANTIZE_DENSE_MAX_BYTES", 0)  # a big model keeps its quantized layers
    monkeypatch.setattr("strata_cli.model.loader.DEQUANTIZE_DENSE_MAX_BYTES", 0)
    assert isinstance(load_model(path).model.embed_tokens, nn.QuantizedEmbedding)
