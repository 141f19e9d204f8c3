"""Whole decoder layers on the CPU's host path (model/host_layer.py): a float32 Qwen3-Next's
layers run in numpy from input norm to tail, and compute what the MLX forms compute, to float32
rounding (their bits are their own: windows against serial steps, bit for bit, are
tests/test_row_invariance.py's)."""

import random

import numpy as np

from strata_cli.engine.window import WindowEngine
from strata_cli.model import host_layer
from strata_cli.model.host_blas import HostBlas

PREFIX = 20  # a prompt-sized chunk, then a short one (host path too)


def window_logits(model, tokens, sizes):
    engine = WindowEngine(model)
    engine.prefill(tokens[:PREFIX])
    pos, out = PREFIX, []
    for T, keep in sizes:
        out.append(np.array(engine.run(tokens[pos:pos + T], pos).logits))
        engine.commit(keep)
        pos += keep
    return out


def test_host_layers_run_and_match_the_mlx_forms(tiny_model, monkeypatch):
    rng = random.Random(4)
    tokens = [rng.randrange(tiny_model.config.vocab_size) for _ in range(PREFIX + 40)]
    sizes = [(1, 1), (4, 2), (8, 8), (3, 1), (1, 1)]
    calls = []
    real = host_layer.call
    monkeypatch.setattr(host_layer, "call", lambda *a: calls.append(1) or real(*a))
    host = window_logits(tiny_model, tokens, sizes)
    assert len(calls) == len(sizes) * len(tiny_model.layers)
    monkeypatch.setattr(HostBlas, "windows", False)  # MLX's linears and layer ends
    mlx_forms = window_logits(tiny_model, tokens, sizes)
    for i, (a, b) in enumerate(zip(host, mlx_forms)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"window {i}")
