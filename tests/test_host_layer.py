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


def test_the_kv_states_host_copies_follow_rollback_restore_growth_and_mlx_writes():
    """`KVState.update_and_fetch_host` keeps numpy copies of the buffers: every call returns
    exactly the cells the MLX buffers hold after its write, whatever happened in between."""
    import mlx.core as mx

    from strata_cli.engine.state import KV_STEP, KVState, Mode

    rng = np.random.default_rng(0)
    state = KVState()

    def rows(T):
        return rng.normal(size=(1, 2, T, 4)).astype(np.float32), rng.normal(size=(1, 2, T, 4)).astype(np.float32)

    def host(T, keep=None, mode=Mode.WINDOW):
        state.begin(state.length, T, mode)
        keys, values = state.update_and_fetch_host(*rows(T))
        end = state._window[0] + T
        assert np.array_equal(keys, np.asarray(state.keys)[:, :, :end])
        assert np.array_equal(values, np.asarray(state.values)[:, :, :end])
        state.commit(T if keep is None else keep)

    host(5, mode=Mode.COMMIT_ALL)
    host(4, keep=1)  # rejected drafts: their cells are overwritten next
    saved = state.snapshot()
    host(3, keep=3)
    state.begin(state.length, 2, Mode.WINDOW)  # an MLX-path write the copies did not see
    state.update_and_fetch(*(mx.array(a) for a in rows(2)))
    state.commit(2)
    host(1)
    state.restore(saved)  # back to 6 positions: the copies hold later cells, the arrays do not
    host(2, keep=1)
    for _ in range(KV_STEP // 5 + 2):  # past the first buffer's capacity
        host(8, keep=5)
    assert state.length > KV_STEP


def test_the_hosts_greedy_token_breaks_ties_and_nans_as_mlx_argmax():
    """WindowEngine takes the host path's greedy tokens with np.argmax and the others with
    mx.argmax: the two must agree wherever logits tie or hold NaN, or serial and speculative
    decoding could part on such a row."""
    import mlx.core as mx

    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, 2.0], [1.0, nan, 3.0, nan], [-inf] * 4, [nan] * 4, [1.0, inf, inf, 0.0], [0.0] * 4]
    rng = np.random.default_rng(0)
    rows += rng.integers(0, 3, (64, 4)).astype(np.float32).tolist()  # many ties
    logits = np.array(rows, dtype=np.float32)
    assert np.argmax(logits, axis=-1).tolist() == mx.argmax(mx.array(logits), axis=-1).tolist()
