"""strata_cli/model/dispatch.py: a window's layers handed to the device as they are built give
the same logits and tokens, bit for bit, as the window evaluated whole (run here on the CPU's MLX
path, where the layers build a lazy graph as on a GPU); serial steps dispatch no layer."""

import mlx.core as mx
import pytest

from strata_cli.engine.window import WindowEngine
from strata_cli.model.dispatch import LayerDispatch
from strata_cli.model.layers import CpuShortCalls


@pytest.fixture
def dispatches(monkeypatch):
    """The MLX path on the CPU, dispatch on here too; the layer counts each async_eval saw."""
    monkeypatch.setattr(CpuShortCalls, "mode", "never")
    monkeypatch.setattr(LayerDispatch, "mode", "always")
    calls = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: calls.append(len(arrays)) or real(*arrays))
    return calls


def _windows(model, every):
    LayerDispatch.every = every
    engine = WindowEngine(model)
    engine.prefill(list(range(3, 40)))
    out = []
    for T, tokens in [(1, [7]), (4, [9, 2, 11, 4]), (8, [5, 6, 7, 8, 1, 2, 3, 4]), (2, [12, 13])]:
        window = engine.run(tokens, engine.length)
        mx.eval(window.logits)
        out.append((window.logits, window.tokens))
        engine.commit(T - 1 if T > 1 else 1)  # a rejected last draft: the states roll back as ever
    return out


def test_dispatched_windows_equal_whole_ones(dispatches, next_model, monkeypatch):
    monkeypatch.setattr(LayerDispatch, "every", LayerDispatch.every)  # restored after the test
    whole = _windows(next_model, 0)
    assert dispatches == []
    layers = len(next_model.layers)
    for every in (1, 2):
        dispatches.clear()
        pieces = _windows(next_model, every)
        assert len(dispatches) == 4 * ((layers - 1) // every)  # never after the last layer
        for (a, tokens_a), (b, tokens_b) in zip(whole, pieces, strict=True):
            assert tokens_a == tokens_b and mx.array_equal(a, b).item()


def test_serial_steps_and_calls_outside_a_window_do_not_dispatch(dispatches, next_model, monkeypatch):
    monkeypatch.setattr(LayerDispatch, "every", 1)
    engine = WindowEngine(next_model)
    engine.prefill([3, 4, 5])
    engine.launch(6, 3)
    engine.commit(1)
    assert dispatches == [1] and len(next_model.layers) > 1  # the step's own hand-off, none a layer
    dispatches.clear()
    h = mx.zeros((1, 1, 4))
    LayerDispatch.after(h, 1, 4)  # outside a window
    with LayerDispatch.window():
        LayerDispatch.after(h, 1, 4)
    assert dispatches == [1]
