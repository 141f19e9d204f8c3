"""A window's greedy tokens are the argmax of its logits in their own dtype (bfloat16 on a GPU),
and its float32 logits are made only where a caller reads them: the same tokens as the argmax of
the float32 cast, ties and all, serial steps and windows alike."""

import mlx.core as mx
import numpy as np
import pytest

from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_argmax_of_a_half_dtype_is_the_argmax_of_its_float32_cast(dtype):
    rows = mx.random.normal((8, 1000), key=mx.random.key(0)).astype(dtype)
    ties = np.array(rows.astype(mx.float32))
    ties[0, [3, 500, 999]] = 50.0  # a tie for the max: the lowest index wins in both
    ties[1, :] = -np.inf
    ties[1, [7, 8]] = 1.0
    ties[2, :] = 0.0  # every value tied
    ties[3, 999] = 1e4  # the last index
    ties[4, 0] = 1e4  # the first
    rows = mx.array(ties).astype(dtype)
    assert mx.argmax(rows, axis=-1).tolist() == mx.argmax(rows.astype(mx.float32), axis=-1).tolist()
    assert mx.argmax(rows, axis=-1).tolist()[:3] == [3, 7, 0]


@pytest.fixture(scope="module")
def bf16_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    model = random_model(tiny_qwen3_next_config(), seed=3)
    model.set_dtype(mx.bfloat16)
    return model


def test_a_bfloat16_windows_tokens_are_its_float32_logits_argmax(bf16_model):
    engine = WindowEngine(bf16_model, EngineOptions())
    engine.prefill([3, 14, 15, 92, 65, 35])
    out = engine.run([89, 79, 32, 38, 46], engine.length)
    assert out.logits.dtype == mx.float32 and out.logits.shape[0] == 5
    assert out.tokens == np.argmax(np.array(out.logits), axis=-1).tolist()


def test_a_serial_step_gives_the_windows_first_token(bf16_model):
    """launch() (serial decoding's step) and run() take the same argmax of the same logits."""
    engines = [WindowEngine(bf16_model, EngineOptions()) for _ in range(2)]
    for engine in engines:
        engine.prefill([3, 14, 15, 92, 65, 35])
    window = engines[0].run([89], engines[0].length)
    step = engines[1].launch(89, engines[1].length)
    assert step.value() == window.tokens[0]
