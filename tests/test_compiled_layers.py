"""Compiled layer ends (model/compiled.py): decode windows run each layer's pure parts from an
`mx.compile` trace. They must compute the eager bits, follow weight changes, and never freeze
anything that consults the expert cache.

These tests run the windows' linears in MLX (`HostBlas.windows` off), as GPU backends do: with
numpy's matrix-vector products (the CPU's default) the layer ends cannot be traced and run
eagerly, and only the GDN recurrence's pure steps are compiled (the last tests here)."""

import random

import mlx.core as mx
import numpy as np
import pytest

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.engine.window import WindowEngine
from strata_cli.model import gdn, host_gdn
from strata_cli.model.compiled import Compiled, Holdings, LayerCompile
from strata_cli.model.host_blas import HostBlas
from strata_cli.model.layers import WINDOW_ROWS, RowSplit, host_window

PREFIX = 9


@pytest.fixture(autouse=True)
def mlx_window_linears(request, monkeypatch):
    if "host_path" not in request.node.name:
        monkeypatch.setattr(HostBlas, "windows", False)


def windows(model, tokens, sizes):
    """Logits of consecutive windows of `sizes` rows after a prefix, every row kept."""
    engine = WindowEngine(model)
    engine.prefill(tokens[:PREFIX])
    pos, out = PREFIX, []
    for T in sizes:
        out.append(np.array(engine.run(tokens[pos:pos + T], pos).logits))
        engine.commit(T)
        pos += T
    return out


@pytest.mark.parametrize("row_split", ["auto", "always"])
def test_compiled_windows_compute_the_eager_bits(next_model, row_split, monkeypatch):
    model = next_model
    monkeypatch.setattr(RowSplit, "mode", row_split)
    rng = random.Random(1)
    sizes = [1, 3, 8, 1, 5, 2, 8, 1]  # each size twice or more: the second call replays a trace
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(PREFIX + sum(sizes))]
    monkeypatch.setattr(LayerCompile, "mode", "never")
    eager = windows(model, tokens, sizes)
    monkeypatch.setattr(LayerCompile, "mode", "always")
    compiled = windows(model, tokens, sizes)
    assert all(layer._compiled.compiled is not None for layer in model.layers)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        np.testing.assert_array_equal(a, b, err_msg=f"window {i} ({sizes[i]} rows)")


def test_prompts_run_eager_and_windows_compiled():
    x = mx.zeros((1, WINDOW_ROWS + 1, 4))
    assert not LayerCompile.applies(x) and LayerCompile.applies(x[:, :WINDOW_ROWS]) and LayerCompile.applies(x[:, :1])


def test_the_first_call_of_a_setting_is_eager_then_traced_once(monkeypatch):
    module = random_model(tiny_qwen3_next_config(), seed=0).layers[0].mlp
    traces = []

    def fn(x):
        traces.append(x.shape)
        return module(x)

    parts = Compiled(module, fn)
    x = mx.ones((1, 2, module.gate.weight.shape[1]))
    eager = parts.functions()[0]
    assert eager is fn  # probes may evaluate arrays: not inside a trace
    for _ in range(3):
        mx.eval(parts.functions()[0](x))
    assert traces == [x.shape]  # traced once, then replayed
    monkeypatch.setattr(RowSplit, "mode", "never")
    assert parts.functions()[0] is fn  # a new setting: eager again, then a new trace


def test_a_replaced_weight_is_seen(monkeypatch):
    monkeypatch.setattr(LayerCompile, "mode", "always")
    model = random_model(tiny_qwen3_next_config(), seed=4)
    tokens = list(range(3, 3 + PREFIX + 4))
    before = windows(model, tokens, [1, 1, 1])
    layer = model.layers[0]
    layer.mlp.gate.weight = layer.mlp.gate.weight * -1.0  # reroutes every token
    layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight * 2.0
    after = windows(model, tokens, [1, 1, 1])
    monkeypatch.setattr(LayerCompile, "mode", "never")
    expected = windows(model, tokens, [1, 1, 1])
    for a, b in zip(after, expected):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_holdings_notice_any_array_or_container_replaced_added_or_removed():
    model = random_model(tiny_qwen3_next_config(), seed=4)
    layer = model.layers[0]

    def changed(change) -> bool:
        held = Holdings(layer)
        assert held.current()
        change()
        return not held.current()

    experts = layer.mlp.switch_mlp
    name = next(k for k, v in experts.items() if isinstance(v, mx.array))
    assert changed(lambda: experts.__setitem__(name, experts[name] + 0))  # deep in the tree
    assert changed(lambda: layer.mlp.gate.__setitem__("bias", mx.zeros((1,))))  # an array added
    assert changed(lambda: layer.mlp.gate.pop("bias"))  # and removed again
    assert not changed(lambda: setattr(layer, "mlp", layer.mlp))  # the same module put back: nothing changed
    layers = model.model.layers
    assert not changed(lambda: layers.__setitem__(1, layers[1]))
    held = Holdings(model)
    layers[1] = random_model(tiny_qwen3_next_config(), seed=5).layers[1]  # a list element replaced
    assert not held.current()


def test_routing_that_consults_the_cache_is_never_traced(monkeypatch):
    monkeypatch.setattr(LayerCompile, "mode", "always")
    model = random_model(tiny_qwen3_next_config(), seed=6)
    calls = []

    def policy(probs, k):  # what experts/moce.py attaches: it reads the cache each call
        calls.append(probs.shape)
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]
        return inds, mx.ones(inds.shape)

    for layer in model.layers:
        layer.mlp.routing_policy = policy
    assert not any(layer.mlp.compilable for layer in model.layers)
    windows(model, list(range(5, 5 + PREFIX + 6)), [1, 1, 2, 2])
    window_calls = [s for s in calls if s[0] <= 2]
    assert len(window_calls) == 4 * len(model.layers)  # every window called the policy: nothing frozen


@pytest.mark.parametrize("fold", ["lazy", "eager"])
def test_host_path_compiled_recurrence_computes_the_eager_bits(next_model, fold, monkeypatch):
    """CPU windows with numpy linears: the GDN recurrence's compiled steps (one `scan_row` call
    a row, folds included) give the eager ops' bits, window by window and in the state. Layers
    that run whole on the host (model/host_layer.py: the float32 model's) take the numpy
    recurrence instead, whatever LayerCompile says."""
    from strata_cli.options import EngineOptions

    model = next_model
    assert host_window(mx.zeros((1, 1, 4)))
    rng = random.Random(3)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(PREFIX + 40)]

    def run(mode):
        monkeypatch.setattr(LayerCompile, "mode", mode)
        engine = WindowEngine(model, EngineOptions(fold=fold))
        engine.prefill(tokens[:PREFIX])
        pos, out = PREFIX, []
        for T, keep in [(1, 1), (3, 2), (8, 8), (5, 1), (2, 2), (8, 3), (1, 1)]:
            out.append(np.array(engine.run(tokens[pos:pos + T], pos).logits))
            engine.commit(keep)
            pos += keep
        return out, [np.array(a) for state in engine.state_tensors() for a in state.values()]

    calls, host_calls = [], []
    real, real_host = gdn.scan_row, host_gdn.scan
    monkeypatch.setattr(gdn, "scan_row", lambda t: calls.append(t) or real(t))
    monkeypatch.setattr(host_gdn, "scan", lambda rows, S: host_calls.append(1) or real_host(rows, S))
    eager, eager_state = run("never")
    assert not calls
    compiled, compiled_state = run("always")
    assert bool(calls) != bool(host_calls)  # the 4-bit model's layers trace scan rows, the float32 model's run in numpy
    for i, (a, b) in enumerate(zip(eager, compiled)):
        np.testing.assert_array_equal(a, b, err_msg=f"window {i}")
    for a, b in zip(eager_state, compiled_state):
        np.testing.assert_array_equal(a, b)


def test_host_path_layer_ends_run_eagerly():
    x = mx.zeros((1, 4, 8))
    assert host_window(x) and not LayerCompile.applies(x) and LayerCompile.applies_to_state(4)
