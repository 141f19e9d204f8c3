"""metal_shaders/argmax_rows.py: a window's greedy tokens in two small kernels, written into
MLX's pool.

There is no GPU here: the bodies run through scripts/lab/kernel_emulate.py (g++, a block's lanes
at once), behind the CUDA prelude (the only backend that takes them). Each row's token must be
MLX's CUDA argmax's (`reference_argmax`: the lowest index of the largest value, NaN never chosen),
whatever the other rows; a window and a serial step must choose the tokens MLX's argmax chooses.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import argmax_rows, pooled
from state_checks import one_window
from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.ArgmaxEmulator(tmp_path_factory.mktemp("argmax-emulate"))


def test_the_emulated_kernels_give_mlxs_cuda_argmax(emulate, emulator):
    """(kernel_emulate.py: float32 and bfloat16, a short last chunk and 151,936 columns.)"""
    assert all(emulate.check_argmax(emulator))


def test_the_reference_is_the_lowest_index_of_the_largest_value_never_nan():
    rows = mx.array([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 0.5],
                     [float("-inf")] * 4, [float("nan")] * 4, [-1.0, float("-inf"), -1.0, -2.0]])
    assert argmax_rows.reference_argmax(rows) == [1, 1, 0, 0, 0]
    finite = mx.random.normal((6, 300), key=mx.random.key(1)).astype(mx.bfloat16)
    assert argmax_rows.reference_argmax(finite) == mx.argmax(finite, axis=-1).tolist()


def test_launches():
    C, chunks, rows = argmax_rows.launches(8, 151_936)
    assert C == 594 and chunks == {"grid": (149 * 128, 8, 1), "threadgroup": (128, 1, 1)}
    assert rows == {"grid": (32, 8, 1), "threadgroup": (32, 1, 1)}


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the two bodies with the launches,
    names, inputs and outputs argmax_rows asks for."""
    def make(name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        first = name == "strata_argmax_chunks_v1"
        k = len(outputs)
        assert first or name == f"strata_argmax_rows_{k}_v1"
        assert body == (argmax_rows.CHUNKS if first else argmax_rows.rows_source(k))
        assert inputs == ["dims", "neg_inf", "logits" if first else "part"]

        def launch(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template=None):
            R, V, C = np.array(inputs[0]).tolist()[:3]
            expected_C, chunks, rows = argmax_rows.launches(R, V)
            assert C == expected_C and np.array(inputs[1])[0] == -np.inf
            if first:
                assert dict(grid=grid, threadgroup=threadgroup) == chunks and output_dtypes == [mx.float32]
                assert dict(template) == {"T": inputs[2].dtype, "CHUNK": argmax_rows.CHUNK,
                                          "LANE_VALUES": argmax_rows.LANE_VALUES}
                calls.append(("chunks", R))
                return [mx.array(emu.chunks(inputs[2]))]
            assert dict(grid=grid, threadgroup=threadgroup) == rows and output_dtypes == [mx.uint32] * k
            tokens = emu.rows(np.array(inputs[2]), V)
            pieces = [mx.array(np.array(tokens[i:i + pooled.POOL_INTS], np.uint32)) for i in range(0, R, pooled.POOL_INTS)]
            assert [p.shape for p in pieces] == output_shapes
            calls.append(("rows", R))
            return pieces
        return launch
    return make


@pytest.fixture
def kernels_on(monkeypatch, emulator):
    """The CUDA path on the CPU: the argmax through the emulated kernels."""
    calls = []
    monkeypatch.setattr(argmax_rows, "usable", lambda dtype=None: True)
    monkeypatch.setattr(argmax_rows, "backend", lambda: "cuda")
    monkeypatch.setattr(argmax_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    return calls


def test_the_probe_passes_the_emulated_kernels_and_catches_broken_ones(monkeypatch, emulator, emulate, tmp_path):
    """(At the short width alone: the emulator's own check above takes 151,936 columns too.)"""
    monkeypatch.setattr(argmax_rows, "PROBE_COLUMNS", argmax_rows.PROBE_COLUMNS[:1])
    calls = []
    monkeypatch.setattr(argmax_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    assert argmax_rows.check() is None and ("chunks", 8) in calls and ("rows", 1) in calls
    for kind, broken in (("chunks", lambda: argmax_rows.CHUNKS.replace("if (v[j] > best)", "if (v[j] >= best)")),
                         ("rows", lambda k: argmax_rows.rows_source(k).replace("oa < at", "oa > at"))):
        emu = emulate.ArgmaxEmulator(tmp_path)
        emu.sources[kind] = broken  # a lane's last tie; a warp's highest index of a tie
        monkeypatch.setattr(argmax_rows, "gpu_kernel", emulated_kernel(emu, calls))
        assert argmax_rows.check() is not None, kind


def test_host_and_device_argmax_take_the_kernels_where_they_may(kernels_on):
    rows = argmax_rows.probe_rows(1317, mx.bfloat16)
    assert argmax_rows.host_argmax(rows) == argmax_rows.reference_argmax(rows)
    one = argmax_rows.device_argmax(rows[6:7])
    assert one.shape == (1, 1) and one.dtype == mx.uint32 and one.item() == 1316
    assert kernels_on == [("chunks", 8), ("rows", 8), ("chunks", 1), ("rows", 1)]
    many = mx.zeros((argmax_rows.MAX_UPLOAD_INTS + 1, 40))  # more rows than the pool takes: MLX's
    assert argmax_rows.host_argmax(many) == [0] * 17 and len(kernels_on) == 4


def test_off_cuda_the_argmax_is_mlxs():
    rows = mx.random.normal((3, 50), key=mx.random.key(2))
    assert not argmax_rows.takes(rows)
    assert argmax_rows.host_argmax(rows) == mx.argmax(rows, axis=-1).tolist()
    assert argmax_rows.device_argmax(rows[:1]).tolist() == mx.argmax(rows[:1], axis=-1, keepdims=True).tolist()


@pytest.fixture(scope="module")
def bf16_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    model = random_model(tiny_qwen3_next_config(), seed=3)
    model.set_dtype(mx.bfloat16)
    return model


def test_a_window_and_a_serial_step_choose_mlxs_tokens_through_the_kernels(bf16_model, monkeypatch, emulator):
    plain_logits, plain_tokens = one_window(bf16_model)
    engine = WindowEngine(bf16_model, EngineOptions())
    engine.prefill([3, 14, 15, 92, 65, 35])
    plain_step = engine.launch(89, engine.length).value()
    calls = []
    monkeypatch.setattr(argmax_rows, "usable", lambda dtype=None: True)
    monkeypatch.setattr(argmax_rows, "backend", lambda: "cuda")
    monkeypatch.setattr(argmax_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    logits, tokens = one_window(bf16_model)
    assert tokens == plain_tokens and np.array_equal(logits, plain_logits)
    engine = WindowEngine(bf16_model, EngineOptions())
    engine.prefill([3, 14, 15, 92, 65, 35])
    assert engine.launch(89, engine.length).value() == plain_step
    assert calls == [("chunks", 5), ("rows", 5), ("chunks", 1), ("rows", 1)]
