"""Row invariance: each row of a T-row window computes exactly what it computes alone.

On the CPU MLX's kernels are row-invariant as they are; on GPU backends `RowSplit` runs a small
window's matmuls and attention row by row (scripts/bench/row_probe.py measures why). Both paths are
checked here on the CPU, bit for bit: "auto" (what the CPU runs) and "always" (the GPU path).
"""

import random
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from strata_cli.engine.window import WindowEngine
from strata_cli.model.layers import (
    WINDOW_ROWS,
    CpuShortCalls,
    RowLinear,
    RowQuantizedLinear,
    RowSplit,
    by_row,
    stack,
    stack_rows,
    stacked,
)

PREFIX = 11


@pytest.fixture(params=["auto", "always"])
def row_split(request, monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", request.param)
    return request.param


def test_every_row_of_a_window_equals_its_serial_logits(next_model, row_split):
    assert_rows_equal_serial(next_model, row_split)


def test_gpu_forms_keep_every_row_serial(next_model, monkeypatch):
    """The forms a GPU runs (MLX's linears, not the CPU's numpy host path; rows split): the
    stacked projections (GDN [qkvz | ba], attention q/k/v, the MoE's) and their gathers and
    splits give each window row its serial logits, and the same bits as the linears apart."""
    monkeypatch.setattr(RowSplit, "mode", "always")
    monkeypatch.setattr(CpuShortCalls, "mode", "never")
    layers = next_model.model.layers
    assert all(stacked(layer.mixer, "_input_rows" if layer.is_linear else "_qkv_rows") is not None
               for layer in layers)
    x = mx.random.normal((1, WINDOW_ROWS, next_model.config.hidden_size), key=mx.random.key(3))
    for layer in layers:
        mixer = layer.mixer
        for T in (1, 3, WINDOW_ROWS):
            together = mixer.head(x[:, :T])
            rows = mixer.__dict__.pop("_input_rows" if layer.is_linear else "_qkv_rows")
            apart = mixer.head(x[:, :T])
            mixer.__dict__["_input_rows" if layer.is_linear else "_qkv_rows"] = rows
            # the same values (a stacked GDN head leaves z as its projection gives it, (B, T, Hv·Dv))
            assert all(mx.array_equal(a.reshape(-1), b.reshape(-1)).item()
                       for (_, a), (_, b) in zip(tree_flatten(together), tree_flatten(apart)))
            if layer.is_linear:  # and the gated norm takes either z to the same bits
                y = mx.random.normal((1, T, mixer.num_v_heads, mixer.head_v_dim), key=mx.random.key(T))
                (z_flat,), (z_heads,) = together[1], apart[1]
                assert z_flat.ndim == 3 and z_heads.ndim == 4
                assert mx.array_equal(mixer.tail_input(y, z_flat), mixer.tail_input(y, z_heads)).item()
    assert_rows_equal_serial(next_model, "gpu forms")


def assert_rows_equal_serial(model, label):
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
            np.testing.assert_array_equal(out[i], alone[i], err_msg=f"T={T} row {i} ({label})")


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


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_rows_equal_their_linears_apart(bits, bias, row_split):
    """Linears of one input stacked along their output rows (`StackedRows`: MoE router and shared
    expert, Qwen3.5's GDN projections, GPT-OSS q/k/v), plain or affine-quantized, with biases or
    not: every output of a window is its linear's own, bit for bit (a prompt-sized call's BLAS
    blocks by width, so there within rounding); the linears' arrays become row views of
    the stack (the state dict unchanged); a replaced array or linear makes the stack stale, never
    rebuilt in a call, until `stack_rows` stacks again; parts of different forms run apart."""
    owner = nn.Module()
    owner.stack_linears = lambda: stack(owner, "_rows", "a", "inner.b", "inner.c")
    owner.a, owner.inner = RowLinear(64, 48, bias=bias), nn.Module()
    owner.inner.b, owner.inner.c = RowLinear(64, 16, bias=bias), RowLinear(64, 4, bias=bias)
    for i, linear in enumerate(linears_of(owner)):
        linear.update(tree_map(lambda w, k=i: mx.random.normal(w.shape, key=mx.random.key(k)), linear.parameters()))
    if bits:
        nn.quantize(owner, group_size=32, bits=bits)
    before = dict(tree_flatten(owner.parameters()))
    windows = [mx.random.normal((1, rows, 64), key=mx.random.key(9)) for rows in (1, 5, 40)]
    alone = [[linear(x) for linear in linears_of(owner)] for x in windows]
    stack_rows(owner)
    rows = stacked(owner, "_rows")
    assert rows is not None
    for x, want in zip(windows, alone):
        same = mx.array_equal if x.shape[1] <= WINDOW_ROWS else partial(mx.allclose, atol=1e-4)
        assert all(same(got, w).item() for got, w in zip(rows(x), want))
    after = dict(tree_flatten(owner.parameters()))
    assert sorted(after) == sorted(before) and all(mx.array_equal(after[k], before[k]).item() for k in before)
    address = lambda a: np.asarray(a).__array_interface__["data"][0]  # noqa: E731
    starts = np.cumsum([0] + [linear.weight.nbytes for linear in linears_of(owner)])[:-1]
    assert [address(linear.weight) for linear in linears_of(owner)] == [address(rows.fused.weight) + s for s in starts]
    owner.inner.c.weight = owner.inner.c.weight + 0  # a replaced array: stale, dropped, not rebuilt
    assert stacked(owner, "_rows") is None and "_rows" not in owner.__dict__
    stack_rows(owner)
    assert stacked(owner, "_rows") is not None
    owner.inner.b = RowLinear(64, 16, bias=not bias)  # a replaced linear (quantizing, loading again)
    assert stacked(owner, "_rows") is None
    stack_rows(owner)
    assert stacked(owner, "_rows") is None  # parts of different forms: none kept, they run apart


def linears_of(owner: nn.Module) -> list[nn.Module]:
    return [owner.a, owner.inner.b, owner.inner.c]
