"""strata_cli/model/dispatch.py: a window's layers handed to the device as they are built give
the same logits and tokens, bit for bit, as the window evaluated whole (run here on the CPU's MLX
path, where the layers build a lazy graph as on a GPU); serial steps dispatch no layer."""

import mlx.core as mx
from dispatch_checks import assert_dispatch_changes_nothing, counted_dispatches

from strata_cli.engine.window import WindowEngine
from strata_cli.model.dispatch import LayerDispatch


def test_dispatched_windows_equal_whole_ones(next_model, monkeypatch):
    assert_dispatch_changes_nothing(next_model, monkeypatch, list(range(3, 40)), len(next_model.layers))


def test_serial_steps_and_calls_outside_a_window_do_not_dispatch(next_model, monkeypatch):
    calls = counted_dispatches(monkeypatch, 8)
    engine = WindowEngine(next_model)
    engine.prefill([3, 4, 5])
    engine.launch(6, 3)
    engine.commit(1)
    assert calls == [1] and len(next_model.layers) > 1  # the step's own hand-off, none a layer
    calls.clear()
    h = mx.zeros((1, 1, 4))
    LayerDispatch.after(h, 1, 4)  # outside a window
    with LayerDispatch.window():
        LayerDispatch.after(h, 1, 4)
    assert calls == [1]
