"""Windows whose layers go to the device as they are built (strata_cli/model/dispatch.py) against
the same windows evaluated whole, on the CPU's MLX path (where layers build a lazy graph as on a
GPU): the family tests call `assert_dispatch_changes_nothing` on their own models."""

import mlx.core as mx

from strata_cli.engine.window import WindowEngine
from strata_cli.model.dispatch import LayerDispatch
from strata_cli.model.layers import CpuShortCalls

WINDOWS = [(1, [7]), (4, [9, 2, 11, 4]), (8, [5, 6, 7, 8, 1, 2, 3, 4]), (2, [12, 13])]


def windows(model, prompt: list[int], pieces: int) -> list[tuple[mx.array, list[int]]]:
    """Logits and greedy tokens of WINDOWS after `prompt`, each committing all but its last row."""
    LayerDispatch.pieces = pieces
    engine = WindowEngine(model)
    engine.prefill(prompt)
    out = []
    for T, tokens in WINDOWS:
        window = engine.run(tokens, engine.length)
        mx.eval(window.logits)
        out.append((window.logits, window.tokens))
        engine.commit(T - 1 if T > 1 else 1)  # a rejected last draft: the states roll back as ever
    return out


def counted_dispatches(monkeypatch, pieces: int) -> list[int]:
    """The CPU's MLX path with dispatch on here too, in `pieces`; the list fills with each
    `mx.async_eval`'s argument count."""
    monkeypatch.setattr(CpuShortCalls, "mode", "never")
    monkeypatch.setattr(LayerDispatch, "mode", "always")
    monkeypatch.setattr(LayerDispatch, "pieces", pieces)
    calls = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: calls.append(len(arrays)) or real(*arrays))
    return calls


def assert_dispatch_changes_nothing(model, monkeypatch, prompt: list[int], layers: int) -> None:
    """In 2 pieces and in one piece a layer, dispatched windows equal whole ones bit for bit, and
    each window is handed over (layers - 1) // (layers a piece) times (never after its last layer)."""
    calls = counted_dispatches(monkeypatch, 0)
    whole = windows(model, prompt, 0)
    assert calls == []
    for pieces in (2, layers):
        calls.clear()
        dispatched = windows(model, prompt, pieces)
        assert len(calls) == len(WINDOWS) * ((layers - 1) // -(-layers // pieces))
        for (a, tokens_a), (b, tokens_b) in zip(whole, dispatched, strict=True):
            assert tokens_a == tokens_b and mx.array_equal(a, b).item()
