"""The CPU prompt path's MLX matmul forms: blocked causal attention, cached contiguous
transposes, two streams. Each test here runs them with numpy's BLAS off (`HostBlas.mode` "mlx");
tests/test_host_blas.py checks the numpy forms."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.engine.window import WindowEngine
from strata_cli.model import moe
from strata_cli.model.attention import QUERY_BLOCK, causal_attention_cpu
from strata_cli.model.host_blas import HostBlas
from strata_cli.model.layers import PREFILL_MIN_ROWS, RowLinear, transposed
from strata_cli.model.moe import SwitchGLU, gather_matmul, glu_by_expert

TOL = 1e-6  # relative, float32: the same sums as the reference calls


@pytest.fixture(autouse=True)
def mlx_blas(monkeypatch):
    monkeypatch.setattr(HostBlas, "mode", "mlx")


def rel_diff(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def qkv(T: int, P: int, Hq: int, Hkv: int, D: int = 16, seed: int = 0):
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((1, Hq, T, D), key=kq), mx.random.normal((1, Hkv, P + T, D), key=kk),
            mx.random.normal((1, Hkv, P + T, D), key=kv))


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2)])
@pytest.mark.parametrize("T,P", [(16, 0), (127, 0), (128, 5), (129, 200), (300, 37)])
@pytest.mark.parametrize("block", [QUERY_BLOCK, 32])
def test_blocked_attention_matches_sdpa(T, P, heads, block):
    q, k, v = qkv(T, P, *heads, seed=T + P)
    scale = q.shape[-1] ** -0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    out = causal_attention_cpu(q, k, v, scale, block=block)
    assert out.shape == ref.shape
    assert rel_diff(out, ref) < TOL


def test_blocked_attention_would_notice_a_wrong_mask():
    q, k, v = qkv(130, 20, 4, 2)
    scale = q.shape[-1] ** -0.5
    unmasked = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    shifted = mx.fast.scaled_dot_product_attention(q, k[:, :, :-1], v[:, :, :-1], scale=scale, mask="causal")
    out = causal_attention_cpu(q, k, v, scale)
    assert rel_diff(out, unmasked) > 1e-2
    assert rel_diff(out[:, :, :-1], shifted[:, :, 1:]) > 1e-2


def test_prompt_chunks_take_the_blocked_form_and_windows_do_not(monkeypatch):
    import strata_cli.model.attention as attention

    calls = []
    real = attention.causal_attention_cpu
    monkeypatch.setattr(attention, "causal_attention_cpu", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    model = random_model(tiny_qwen3_next_config(), seed=2)
    engine = WindowEngine(model)
    engine.prefill(list(range(40)), chunk=20)
    assert calls and set(calls) == {20}
    calls.clear()
    engine.run(list(range(8)), engine.length)
    assert calls == []


def test_transposed_is_cached_per_weight_array_and_is_no_parameter():
    layer = RowLinear(32, 24, bias=False)
    names = [k for k, _ in tree_flatten(layer.parameters())]
    first = transposed(layer, "weight")
    assert transposed(layer, "weight") is first
    assert mx.array_equal(first, layer.weight.T)
    assert [k for k, _ in tree_flatten(layer.parameters())] == names
    layer.load_weights([("weight", mx.ones((24, 32)))])
    again = transposed(layer, "weight")
    assert again is not first and mx.array_equal(again, mx.ones((32, 24)))


def test_prompt_sized_linear_matches_nn_linear():
    layer = RowLinear(32, 24, bias=True)
    x = mx.random.normal((2, PREFILL_MIN_ROWS, 32), key=mx.random.key(3))
    ref = nn.Linear.__call__(layer, x)
    assert rel_diff(layer(x), ref) < TOL


def test_prompt_experts_with_cached_transposes_match_the_plain_gather():
    glu = SwitchGLU(32, 16, 6)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        setattr(glu, name, 0.2 * mx.random.normal(glu[name].shape, key=mx.random.key(10 + i)))
    x = mx.random.normal((40, 32), key=mx.random.key(4))
    inds = mx.random.randint(0, 6, (40, 2), key=mx.random.key(5))
    ref = glu_by_expert(x, inds, lambda name, xs, experts, is_sorted: gather_matmul(xs, glu[name], experts,
                                                                                    is_sorted=is_sorted))
    out = glu(x, inds)
    assert "_transposed" in glu.__dict__  # the prompt path took the cached form
    assert rel_diff(out, ref) < TOL


def test_prompt_chunks_are_512_rows_on_the_cpu_and_2048_on_a_gpu(monkeypatch):
    """The CPU keeps PREFILL_CHUNK; GPU backends take GPU_PREFILL_CHUNK (measured faster on the H200)."""
    import mlx.core as mx

    from strata_cli.engine import window
    from strata_cli.options import PREFILL_CHUNK

    assert window.default_prefill_chunk() == PREFILL_CHUNK == 512
    monkeypatch.setattr(window.mx, "default_device", lambda: mx.gpu)
    assert window.default_prefill_chunk() == window.GPU_PREFILL_CHUNK == 2048


def test_prompt_chunks_multiply_quantized_experts_dequantized(monkeypatch):
    """On the CPU a prompt chunk's quantized expert bank is dequantized once and multiplied in
    float32 (faster than MLX's CPU quantized gather); the same products within rounding."""
    w = mx.random.normal((6, 32, 64), key=mx.random.key(1)) * 0.1
    q, s, b = mx.quantize(w, 32, 8)
    experts = mx.array(sorted([0, 0, 1, 2, 2, 2, 3, 5] * 3), dtype=mx.uint32)
    x = mx.random.normal((experts.size, 1, 64), key=mx.random.key(2))
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = moe.gather_qmatmul(x, q, s, b, experts, group_size=32, bits=8)
    plain = mx.gather_qmm(x, q, s, b, rhs_indices=experts, transpose=True, group_size=32, bits=8, sorted_indices=True)
    assert calls == [1] and mx.allclose(out, plain, atol=1e-5).item()
    monkeypatch.setattr(moe, "CPU_PROMPT_DEQUANTIZE_BYTES", 0)  # a bank too large to dequantize
    assert mx.array_equal(moe.gather_qmatmul(x, q, s, b, experts, group_size=32, bits=8), plain).item()


# -- two CPU streams: a prompt chunk's matmuls, attention blocks and GDN heads split over cores ------

@pytest.fixture
def one_stream(monkeypatch):
    """Undo the split: every module that spreads work over `prompt_streams` gets the default one."""
    from strata_cli.model import attention, gdn_chunked, layers

    def patch():
        for module in (layers, attention, gdn_chunked):
            monkeypatch.setattr(module, "prompt_streams", lambda: (mx.default_stream(mx.cpu),))
    return patch


def test_prompt_streams_one_per_core_up_to_two():
    import os

    from strata_cli.model.layers import prompt_streams

    assert len(prompt_streams()) == min(2, os.cpu_count()) and all(s.device == mx.cpu for s in prompt_streams())


def test_split_prompt_work_gives_the_same_bits(one_stream):
    """Rows (linears, routed-expert picks), attention blocks and GDN heads computed on two
    streams give exactly what one stream gives."""
    from strata_cli.model.gdn_chunked import chunked_scan_over_streams
    from strata_cli.model.layer_state import GDNRows

    linear = RowLinear(48, 40, bias=True)
    x = mx.random.normal((2, 75, 48), key=mx.random.key(1))
    q, keys, values = qkv(300, 37, 4, 2)
    keys_ = mx.random.split(mx.random.key(2), 5)
    B, T, Hk, Hv, D = 1, 70, 2, 4, 16
    k = mx.random.normal((B, T, Hk, D), key=keys_[0])
    rows = GDNRows(mx.random.normal((B, T, Hk, D), key=keys_[1]), k / mx.linalg.norm(k, axis=-1, keepdims=True),
                   mx.random.normal((B, T, Hv, D), key=keys_[2]), -mx.random.uniform(shape=(B, T, Hv), key=keys_[3]),
                   mx.random.uniform(shape=(B, T, Hv), key=keys_[4]))
    S0 = mx.random.normal((B, Hv, D, D), key=keys_[0]) * 0.1

    def everything():
        return [linear(x), causal_attention_cpu(q, keys, values, 0.25), *chunked_scan_over_streams(rows, S0)]

    split = everything()
    one_stream()
    alone = everything()
    assert all(mx.array_equal(a, b).item() for a, b in zip(split, alone))
    assert rel_diff(split[0], x @ linear.weight.T + linear.bias) < TOL
