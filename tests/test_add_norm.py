"""metal_shaders/add_norm.py: a pre-norm layer's residual add and RMSNorm in one kernel, its
reference, and where the decoder layer uses it (RMSNorm.add_and_norm).

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, a block's
threads at once, bfloat16 in software; tests/test_kernel_backends.py runs it behind the Metal
prelude too). Each row of an R-row call must equal its 1-row call bit for bit, h must equal
MLX's x + y bit for bit, and the normed h must stay within add_norm.TOLERANCE of the reference.
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import add_norm, backends, probe
from strata_cli.model.layers import RMSNorm, RowSplit


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.AddNormEmulator(tmp_path_factory.mktemp("add-norm-emulate"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H", [2048, 130])
def test_the_reference_is_mlx_add_then_its_fast_rms_norm_bit_for_bit_on_the_cpu(H, dtype):
    x, y, weight = add_norm.probe_inputs(H, dtype=dtype, seed=1)
    h, normed = add_norm.reference_add_norm(x[None], y[None], weight, 1e-6)  # (1, 8, H), as a window
    assert h.dtype == normed.dtype == dtype and h.shape == normed.shape == (1, 8, H)
    assert mx.array_equal(h[0], x + y).item()
    assert mx.array_equal(normed[0], mx.fast.rms_norm(x + y, weight, 1e-6)).item()
    assert mx.array_equal(normed[0, 1], mx.zeros((H,), dtype=dtype)).item()  # the zero row: 0 * rsqrt(eps)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H", [2048, 130])  # Qwen3-Next-80B's hidden size (8 a thread) and an odd one
def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator, H, dtype):
    """(kernel_emulate.py runs R = 1..8.)"""
    assert emulate.check_add_norm(emulator, H, rows=(1, 3, 8), dtype=dtype)


def test_the_emulated_bfloat16_h_is_mlx_add_bit_for_bit_where_rounding_ties(emulator):
    """x + y whose float32 sum lies exactly halfway between two bfloat16 values: the kernel's h
    rounds it to even as MLX's add does (one bit above 1 in the 9th place: 1 + 2^-8)."""
    x = mx.array([[1.0, 1.0078125, -1.0, 3.0] * 4], dtype=mx.bfloat16)
    y = mx.array([[2.0**-8, 2.0**-8, -(2.0**-8), 2.0**-7] * 4], dtype=mx.bfloat16)
    h, _ = emulator.run(x, y, mx.ones((16,), dtype=mx.bfloat16), 1e-6)
    assert mx.array_equal(h, x + y).item()
    assert h[0, :4].tolist() == [1.0, 1.015625, -1.0, 3.0]


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path):
    drifting = emulate.AddNormEmulator(tmp_path)
    drifting.source = add_norm.SOURCE.replace("float s = 0.0f;", "float s = 1e-3f * dims[0];")
    assert drifting.source != add_norm.SOURCE
    assert not emulate.check_add_norm(drifting, 130, rows=(3,))


def test_supported_shapes_and_launch():
    assert add_norm.supports(2048) and add_norm.supports(130) and add_norm.supports(8192)
    assert not add_norm.supports(8193) and not add_norm.supports(0)
    assert add_norm.per_thread(2048) == 8 and add_norm.per_thread(130) == 1 and add_norm.per_thread(2880) == 12
    threads = add_norm.THREADS
    assert add_norm.launch(3) == {"grid": (3 * threads, 1, 1), "threadgroup": (threads, 1, 1)}
    x, w = mx.zeros((1, 3, 64)), mx.zeros((64,))
    assert add_norm.takes(x, x, w)
    assert not add_norm.takes(x, mx.zeros((1, 1, 64)), w)  # a broadcast y
    assert not add_norm.takes(x, x.astype(mx.bfloat16), w)  # promoted dtypes
    assert not add_norm.takes(x, x, w.astype(mx.bfloat16))  # a weight in another dtype
    assert not add_norm.usable(mx.float16)  # float32 and bfloat16 only


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body (`emu.source`) with the
    launch the module asks for (grid, compiled PER, T, shapes as data)."""
    def make(name, inputs, outputs, body, header, *, ensure_row_contiguous=True):
        assert (body, header, inputs, outputs, ensure_row_contiguous) == (
            add_norm.SOURCE, add_norm.HEADER, ["dims", "eps", "x", "y", "weight"], ["h", "normed"], True)

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            R, H = np.array(inputs[0]).tolist()[:2]  # as the body indexes them (uploads pad kept inputs)
            eps, x, y, weight = inputs[1:]
            values = dict(template)
            assert values == {"T": x.dtype, "PER": add_norm.per_thread(H)}
            assert (grid, threadgroup) == tuple(add_norm.launch(R).values())
            assert output_dtypes == [x.dtype] * 2 and output_shapes == [x.shape] * 2
            calls.append(R)
            h, normed = emu.run(x.reshape(R, H), y.reshape(R, H), weight, eps[0].item())
            return [h.reshape(x.shape), normed.reshape(x.shape)]
        return launch
    return make


def qwen3_next_layer():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    layer = random_model(tiny_qwen3_next_config(), seed=5).model.layers[0]  # a GDN layer, a MoE block
    norm = layer.post_attention_layernorm
    norm.weight = 1.0 + 0.5 * mx.random.normal(norm.weight.shape, key=mx.random.key(11))
    mx.eval(layer.parameters())
    return layer


def tail_inputs(layer, T: int, dtype=mx.float32):
    """x, the GDN core's output and the tail's other input (z) for a T-row window."""
    H = layer.post_attention_layernorm.weight.shape[0]
    x = mx.random.normal((1, T, H), key=mx.random.key(T)).astype(dtype)
    _, tail_in = layer.head(x)
    mixer = layer.mixer
    mixed = mx.random.normal((1, T, mixer.num_v_heads, mixer.head_v_dim), key=mx.random.key(20 + T)).astype(dtype)
    return x, mixed, tail_in


def test_a_decoder_layers_tail_through_the_kernel_equals_mlx_ops_and_misses_no_operand(monkeypatch, emulate, emulator,
                                                                                       tmp_path):
    """The layer's tail, x + mixer.tail(...) then its feed-forward of the normed sum, with the
    (emulated) kernel equals its MLX ops' within float32 rounding, row by row as the 1-row calls;
    bodies that drop the residual x, the mixer's output or the norm's weight are caught."""
    layer = qwen3_next_layer()
    x, mixed, tail_in = tail_inputs(layer, 5)
    expected = layer.tail(x, mixed, *tail_in)  # the CPU: MLX's ops
    calls = []
    monkeypatch.setattr(add_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(add_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    got = layer.tail(x, mixed, *tail_in)
    assert calls == [5]
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()
    alone = mx.concatenate([layer.tail(x[:, t : t + 1], mixed[:, t : t + 1], *(a[:, t : t + 1] for a in tail_in))
                            for t in range(5)], axis=1)
    assert calls == [5] + [1] * 5
    assert mx.array_equal(got, alone).item()
    for broken in (add_norm.SOURCE.replace("xv[j] + ", ""),
                   add_norm.SOURCE.replace(" + yv[j]", ""),
                   add_norm.SOURCE.replace(" * wv[j]", "")):
        assert broken != add_norm.SOURCE
        emu = emulate.AddNormEmulator(tmp_path)
        emu.source = broken
        monkeypatch.setattr(add_norm, "gpu_kernel", emulated_kernel(emu, calls))
        assert not mx.allclose(layer.tail(x, mixed, *tail_in), expected, rtol=1e-2, atol=1e-3).item()


def test_the_tail_gives_the_same_bits_with_its_kept_inputs_uploaded(monkeypatch, emulator):
    """With uploads on, dims (R, H) and the epsilon are padded past MLX's 8-byte pool and copied
    to device memory: the kernel reads the same values, so the tail's bits do not move."""
    layer = qwen3_next_layer()
    x, mixed, tail_in = tail_inputs(layer, 3)
    calls = []
    monkeypatch.setattr(add_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(add_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    plain = layer.tail(x, mixed, *tail_in)
    monkeypatch.setattr(probe, "_upload", {"enabled": True, "device": mx.default_device(), "on": True})
    monkeypatch.setattr(probe, "_dims_cache", {})
    monkeypatch.setattr(probe, "_constants", {})
    uploaded = layer.tail(x, mixed, *tail_in)
    assert calls == [3, 3] and probe.dims(3, x.shape[-1]).size == 3
    assert mx.array_equal(uploaded, plain).item()


def test_a_bfloat16_layers_tail_through_the_kernel_stays_near_mlx_ops(monkeypatch, emulator):
    layer = qwen3_next_layer()
    layer.set_dtype(mx.bfloat16)
    x, mixed, tail_in = tail_inputs(layer, 3, mx.bfloat16)
    expected = layer.tail(x, mixed, *tail_in)
    calls = []
    monkeypatch.setattr(add_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(add_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    got = layer.tail(x, mixed, *tail_in)
    assert calls == [3] and got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), rtol=2e-2, atol=2e-2).item()


def test_mlx_ops_add_and_norm_prompt_chunks_other_dtypes_and_subclasses(monkeypatch):
    monkeypatch.setattr(add_norm, "usable", lambda dtype=None: dtype == mx.float32)

    def unexpected(*args, **kwargs):
        raise AssertionError("the add-norm kernel was called")

    monkeypatch.setattr(add_norm, "add_norm", unexpected)
    norm = RMSNorm(64, 1e-6)
    x = mx.random.normal((1, 9, 64), key=mx.random.key(0))
    h, normed = norm.add_and_norm(x, x)  # more rows than a window
    assert mx.array_equal(h, x + x).item() and mx.array_equal(normed, norm(x + x)).item()
    half = x[:, :2].astype(mx.float16)
    mx.eval(RMSNorm(64, 1e-6).add_and_norm(half, half))  # a dtype whose probe did not pass
    mx.eval(norm.add_and_norm(x[:, :2], x[:, :1]))  # a broadcast

    class Shifted(RMSNorm):
        def __call__(self, x):
            return super().__call__(x) + 1

    mx.eval(Shifted(64, 1e-6).add_and_norm(x[:, :2], x[:, :2]))
    monkeypatch.setattr(RowSplit, "mode", "never")
    mx.eval(norm.add_and_norm(x[:, :2], x[:, :2]))


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    assert not add_norm.usable()
    assert add_norm.status() == {"usable": False, "probed": True, "error": None}


def test_a_failing_probe_turns_the_kernel_off_and_the_norm_falls_back(caplog, failing_metal):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the norm adds and normalises with MLX's ops."""
    made = failing_metal(add_norm, "add-norm kernel")
    norm = RMSNorm(130, 1e-6)
    x, y, _ = add_norm.probe_inputs(130, rows=3)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        h, normed = norm.add_and_norm(x, y)
    assert "add-norm kernel disabled" in caplog.text
    assert add_norm.status()["error"] == "add_norm h differs from x + y (H=2048, mlx.core.float32)"
    assert made[0]["source"] == backends.source(backends.METAL, add_norm.SOURCE)
    assert made[0]["header"] == backends.header(backends.METAL, add_norm.HEADER)
    assert mx.array_equal(h, x + y).item() and mx.array_equal(normed, norm(x + y)).item()
    norm.add_and_norm(x, y)
    assert len(made) == 1  # decided once per process
