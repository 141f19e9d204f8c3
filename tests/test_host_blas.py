"""CPU matmuls through numpy's BLAS (model/host_blas.py): the same products as MLX's, within
float32 rounding; prompt-sized float32 CPU calls as matrix products, decode windows (and shorter
calls) as one matrix-vector product a row, whose rows never depend on the others."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.engine.window import WindowEngine
from strata_cli.model import host_blas, moe
from strata_cli.model.attention import causal_attention_cpu
from strata_cli.model.host_blas import HostBlas
from strata_cli.model.layers import PREFILL_MIN_ROWS, RowLinear

TOL = 1e-5  # relative to the largest reference magnitude, float32


def rel_diff(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.fixture
def numpy_blas(monkeypatch):
    monkeypatch.setattr(HostBlas, "mode", "numpy")


@pytest.fixture
def spied(monkeypatch):
    """Counts the host calls by name."""
    calls = []
    for name in ("linear", "causal_attention", "rows_linears", "logits"):
        real = getattr(host_blas, name)
        monkeypatch.setattr(host_blas, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_prompt_linear_matches_nn_linear(numpy_blas, spied, bias):
    layer = RowLinear(48, 40, bias=bias)
    x = mx.random.normal((2, PREFILL_MIN_ROWS + 3, 48), key=mx.random.key(3))
    out = layer(x)
    assert spied == ["linear"] and out.shape == (2, PREFILL_MIN_ROWS + 3, 40) and out.dtype == mx.float32
    assert rel_diff(out, nn.Linear.__call__(layer, x)) < TOL


def test_half_precision_stays_in_mlx(numpy_blas, spied):
    layer = RowLinear(48, 40, bias=False)
    layer.set_dtype(mx.bfloat16)
    layer(mx.random.normal((1, 64, 48)).astype(mx.bfloat16))  # not float32
    layer(mx.random.normal((1, 4, 48)).astype(mx.bfloat16))
    assert spied == []


@pytest.mark.parametrize("bias", [False, True])
def test_window_rows_are_matrix_vector_products_that_never_see_the_other_rows(numpy_blas, spied, bias):
    """Every row of a 1..15-row call equals the row alone, bit for bit, wherever it lies in the
    window (K = 37: rows start at every alignment), and matches MLX's product within rounding."""
    layer = RowLinear(37, 29, bias=bias)
    x = mx.random.normal((1, PREFILL_MIN_ROWS - 1, 37), key=mx.random.key(8))
    alone = [np.array(layer(x[:, i:i + 1])) for i in range(x.shape[1])]
    for T in (2, 5, 8, PREFILL_MIN_ROWS - 1):
        out = np.array(layer(x[:, :T]))
        for i in range(T):
            np.testing.assert_array_equal(out[:, i:i + 1], alone[i], err_msg=f"T={T} row {i}")
    assert set(spied) == {"rows_linears"}
    assert rel_diff(layer(x), nn.Linear.__call__(layer, x)) < TOL


def test_window_projections_share_one_read(numpy_blas, spied):
    """`project` reads x back once for several linears and computes each as it would alone."""
    from strata_cli.model.layers import project

    a, b = RowLinear(16, 8, bias=False), RowLinear(16, 3, bias=True)
    x = mx.random.normal((1, 3, 16), key=mx.random.key(2))
    ya, yb = project(x, a, b)
    assert spied == ["rows_linears"]
    assert mx.array_equal(ya, a(x)).item() and mx.array_equal(yb, b(x)).item()


def test_routed_experts_stay_in_mlx(numpy_blas, spied):
    """Streamed experts are served in passes of picks and must equal resident ones bit for bit;
    OpenBLAS's rounding of a row depends on the rows sharing its call, so experts keep MLX's."""
    glu = moe.SwitchGLU(32, 32, 6)
    x = mx.random.normal((40, 32), key=mx.random.key(4))
    inds = mx.random.randint(0, 6, (40, 2), key=mx.random.key(5))
    mx.eval(glu(x, inds), glu.to_quantized(group_size=32, bits=8)(x, inds))
    assert spied == []


@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("T,P", [(16, 0), (129, 200), (300, 37)])
@pytest.mark.parametrize("block", [128, 32])
def test_attention_matches_sdpa(T, P, heads, block):
    kq, kk, kv = mx.random.split(mx.random.key(T + P), 3)
    Hq, Hkv = heads
    q = mx.random.normal((1, Hq, T, 16), key=kq)
    k, v = (mx.random.normal((1, Hkv, P + T, 16), key=key) for key in (kk, kv))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    out = host_blas.causal_attention(q, k, v, 0.25, block)
    assert out.shape == ref.shape and rel_diff(out, ref) < TOL
    shifted = mx.fast.scaled_dot_product_attention(q, k[:, :, :-1], v[:, :, :-1], scale=0.25, mask="causal")
    assert rel_diff(out[:, :, :-1], shifted[:, :, 1:]) > 1e-2  # a mask one cell off would show


def test_the_cpu_attention_entry_takes_numpy(numpy_blas, spied):
    q, k, v = mx.ones((1, 4, 20, 8)), mx.ones((1, 2, 20, 8)), mx.ones((1, 2, 20, 8))
    causal_attention_cpu(q, k, v, 0.5)
    assert spied == ["causal_attention"]


def test_mode(monkeypatch):
    x = mx.zeros((20, 4))
    monkeypatch.setattr(HostBlas, "mode", "auto")
    monkeypatch.setattr(host_blas.sys, "platform", "linux")
    assert HostBlas.takes(x) and not HostBlas.takes(x, x.astype(mx.bfloat16))
    monkeypatch.setattr(host_blas.sys, "platform", "darwin")  # MLX's CPU matmul is Accelerate's there
    assert not HostBlas.takes(x)
    monkeypatch.setattr(HostBlas, "mode", "numpy")
    assert HostBlas.takes(x)
    monkeypatch.setattr(HostBlas, "mode", "mlx")
    assert not HostBlas.takes(x)
    monkeypatch.setattr(HostBlas, "mode", "fast")
    with pytest.raises(ValueError, match="STRATA_PROMPT_BLAS must be one of auto, numpy, mlx"):
        HostBlas.takes(x)


def test_results_are_mlx_arrays_that_own_their_memory():
    """The product is copied back: a later numpy write can never reach an MLX array."""
    x = mx.random.normal((20, 8))
    out = host_blas.linear(x, mx.ones((3, 8)))
    view = np.asarray(out)
    assert isinstance(out, mx.array) and not np.shares_memory(view, np.asarray(x))


def test_prefill_in_numpy_and_in_mlx_agree_and_windows_take_rows(spied, monkeypatch):
    model = random_model(tiny_qwen3_next_config(max_position_embeddings=512), seed=3)
    ids = mx.random.randint(0, model.config.vocab_size, (300,), key=mx.random.key(9)).tolist()
    logits = {}
    for mode in ("numpy", "mlx"):
        monkeypatch.setattr(HostBlas, "mode", mode)
        engine = WindowEngine(model)
        logits[mode] = engine.prefill(ids, chunk=128)
        if mode == "numpy":
            assert set(spied) == {"linear", "causal_attention", "logits"}  # the last row's logits
            spied.clear()
            engine.run(ids[:8], engine.length)  # a decode window: matrix-vector products
            assert set(spied) == {"logits"}
    assert rel_diff(logits["numpy"], logits["mlx"]) < 1e-4


def test_demo_prefill_in_numpy_matches_serial_decoding(numpy_blas, spied):
    """On the trained demo model, a 96-row prompt window through numpy's BLAS stays within 1e-5
    (relative) of one-token serial decoding, whose linears are numpy matrix-vector products."""
    from strata_cli.options import LoadOptions
    from strata_cli.runtime import open_model

    model = open_model(LoadOptions(model="demo", dtype="float32")).model
    ids = mx.random.randint(0, model.config.vocab_size, (96,), key=mx.random.key(1)).tolist()
    engine = WindowEngine(model)
    serial = []
    for pos, token in enumerate(ids):
        serial.append(engine.run([token], pos).logits[0])
        engine.commit(1)
    serial = mx.stack(serial)
    assert set(spied) == {"logits"}
    spied.clear()
    window = WindowEngine(model).run(ids, 0).logits
    assert set(spied) == {"linear", "causal_attention"}
    per_row = mx.abs(window - serial).max(axis=1) / mx.abs(serial).max(axis=1)
    assert per_row.max().item() < 1e-5
    assert mx.array_equal(window.argmax(axis=1), serial.argmax(axis=1)).item()


def test_numpy_blas_runs_on_one_thread_unless_the_user_chose(monkeypatch):
    from threadpoolctl import threadpool_info

    calls = []
    monkeypatch.setattr(host_blas, "threadpool_limits", lambda **k: calls.append(k))
    host_blas.one_thread.cache_clear()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    host_blas.one_thread()
    assert calls == []
    host_blas.one_thread.cache_clear()
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    host_blas.one_thread()
    host_blas.one_thread()  # once per process
    assert calls == [{"limits": 1, "user_api": "blas"}]
    host_blas.one_thread.cache_clear()
    assert any(pool["user_api"] == "blas" for pool in threadpool_info())  # numpy's BLAS is one it can limit


def test_a_replaced_window_weight_is_seen(numpy_blas):
    """The numpy view of a weight is cached per module and remade when the weight is replaced."""
    layer = RowLinear(8, 4, bias=False)
    x = mx.random.normal((1, 2, 8), key=mx.random.key(6))
    before = layer(x)
    layer.weight = layer.weight * 2.0
    assert mx.array_equal(layer(x), before * 2.0).item()
