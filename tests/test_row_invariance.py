"""Row invariance: each row of a T-row window computes exactly what it computes alone.

On the CPU MLX's kernels are row-invariant as they are; on GPU backends `RowSplit` runs a small
window's matmuls and attention row by row (scripts/bench/row_probe.py measures why). Both paths are
checked here on the CPU, bit for bit: "auto" (what the CPU runs) and "always" (the GPU path).
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from strata_cli.engine.window import WindowEngine
from strata_cli.model.layers import (
    WINDOW_ROWS,
    RowLinear,
    RowQuantizedLinear,
    RowSplit,
    by_row,
)

PREFIX = 11


@pytest.fixture(params=["auto", "always"])
def row_split(request, monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", request.param)
    return request.param


def test_every_row_of_a_window_equals_its_serial_logits(next_model, row_split):
    model = next_model
    rng = random.Random(7)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(PREFIX + WINDOW_ROWS)]
    serial = WindowEngine(model)
    serial.prefill(tokens[:PREFIX])
    alone = []
    for i in range(WINDOW_ROWS):
        alone.append(np.array(serial.run([tokens[PREFIX + i]], PREFIX + i).logits[0]))
        serial.commit(1)
    for T in range(1, WINDOW_ROWS + 1):
        engine = WindowEngine(model)
        engine.prefill(tokens[:PREFIX])
        out = np.array(engine.run(tokens[PREFIX : PREFIX + T], PREFIX).logits)
        engine.commit(1)
        for i in range(T):
            np.testing.assert_array_equal(out[i], alone[i], err_msg=f"T={T} row {i} ({row_split})")


def test_row_split_applies_to_windows_only(monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", "always")
    assert [RowSplit.applies(T) for T in (1, 2, WINDOW_ROWS, WINDOW_ROWS + 1, 512)] == [False, True, True, False, False]
    monkeypatch.setattr(RowSplit, "mode", "never")
    assert not RowSplit.applies(4)
    monkeypatch.setattr(RowSplit, "mode", "auto")
    assert RowSplit.applies(4) == (mx.default_device() != mx.cpu)


def test_by_row_calls_once_per_row_and_keeps_the_shape(monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", "always")
    calls = []
    x = mx.arange(2 * 5 * 3, dtype=mx.float32).reshape(2, 5, 3)
    out = by_row(lambda part: calls.append(part.shape) or part * 2, x)
    assert calls == [(2, 1, 3)] * 5 and mx.array_equal(out, x * 2).item()


def test_row_linear_quantizes_to_its_row_twin(monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", "always")
    layer = RowLinear(64, 16, bias=True)
    q = layer.to_quantized(group_size=32, bits=4)
    assert isinstance(q, RowQuantizedLinear) and q.bits == 4 and "bias" in q
    x = mx.random.normal((1, 4, 64))
    whole = mx.quantized_matmul(x, q.weight, q.scales, q.biases, transpose=True, group_size=32, bits=4) + q.bias
    assert mx.allclose(q(x), whole, atol=1e-5).item()
