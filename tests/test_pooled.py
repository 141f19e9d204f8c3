"""metal_shaders/pooled.py: a window's ids joined from MLX's pooled pieces, and what the host reads
back split into them, each in one launch.

There is no GPU here: the bodies run through scripts/lab/kernel_emulate.py (g++, a thread at a
time), behind the CUDA prelude (the only backend that pools). They must give every value's bits
in order; the window, the sampler and the attention layers' per-step sizes must see the values
MLX's copies give.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import pooled, probe
from state_checks import one_window
from strata_cli.engine.window import WindowEngine


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.PooledEmulator(tmp_path_factory.mktemp("pooled-emulate"))


def test_the_emulated_copies_give_every_values_bits(emulate, emulator):
    """(kernel_emulate.py, at the probe's counts: 2, 4 and 8 pieces, the last full or not; int32
    joined, int32 / uint32 / float32 split. `--only pooled` runs every count from 3 to 16.)"""
    assert all(emulate.check_pooled(emulator, counts=pooled.PROBE_COUNTS))


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the bodies (`emu.sources`) with
    the launch, names, inputs and outputs pooled.py asks for."""
    def make(name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        kind = "join" if "_join_" in name else "split"
        k = len(inputs) if kind == "join" else len(outputs)
        assert name == f"strata_pool_{kind}_{k}_v1" and header == "" and ensure_row_contiguous
        assert body == (pooled.join_source if kind == "join" else pooled.split_source)(k)
        assert (inputs, outputs) == (([f"p{j}" for j in range(k)], ["out"]) if kind == "join"
                                     else (["values"], [f"o{j}" for j in range(k)]))

        def launch(*, inputs, grid, threadgroup, output_shapes, output_dtypes):
            n = sum(p.size for p in inputs) if kind == "join" else inputs[0].size
            assert (grid, threadgroup) == tuple(pooled.launch(n).values())
            calls.append((kind, n))
            if kind == "join":
                assert output_dtypes == [mx.int32] and all(p.dtype == mx.int32 for p in inputs)
                return [mx.array(emu.join([np.array(p).reshape(-1) for p in inputs])).reshape(output_shapes[0])]
            (values,) = inputs
            assert output_dtypes == [values.dtype] * k
            pieces = [mx.array(p) for p in emu.split(np.array(values), values.dtype)]
            assert [p.shape for p in pieces] == output_shapes
            return pieces
        return launch
    return make


@pytest.fixture
def kernels_on(monkeypatch, emulator):
    """The CUDA path on the CPU: uploads on, the pool's copies through the emulated kernels."""
    monkeypatch.setattr(probe, "_upload", {"enabled": True, "device": mx.default_device(), "on": True})
    monkeypatch.setattr(probe, "_dims_cache", {})
    monkeypatch.setattr(pooled, "_step_dims", {})
    monkeypatch.setattr(pooled, "usable", lambda dtype=None: True)
    calls = []
    monkeypatch.setattr(pooled, "gpu_kernel", emulated_kernel(emulator, calls))
    return calls


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 17])
def test_ids_are_joined_in_one_launch(kernels_on, n):
    values = [int(v) for v in np.random.default_rng(n).integers(0, 151_936, n)]
    ids = pooled.device_ints(values)
    assert ids.dtype == mx.int32 and ids.shape == (n,) and ids.tolist() == values
    row = pooled.device_ints(values, row=True)
    assert row.dtype == mx.int32 and row.shape == (1, n) and row.tolist() == [values]
    # at most POOL_INTS values: one pooled array; more than MAX_UPLOAD_INTS: one array, faulted once
    assert kernels_on == ([("join", n)] * 2 if pooled.POOL_INTS < n <= pooled.MAX_UPLOAD_INTS else [])


@pytest.mark.parametrize("dtype", [mx.uint32, mx.int32, mx.float32])
@pytest.mark.parametrize("n", [2, 3, 8, 16, 17])
def test_what_the_host_reads_is_split_in_one_launch(kernels_on, n, dtype):
    values = mx.array(np.random.default_rng(n).integers(-50, 151_936, n)).astype(dtype)
    pieces = pooled.host_pieces(values)
    assert all(p.dtype == dtype for p in pieces)
    assert [v for p in pieces for v in p.tolist()] == values.tolist()
    if n <= pooled.POOL_INTS:
        assert pieces == [values] and kernels_on == []
    elif n <= pooled.MAX_UPLOAD_INTS:
        assert all(p.nbytes <= 8 for p in pieces) and kernels_on == [("split", n)]
    else:  # a count no window reads: MLX's copies, a piece each
        assert all(p.nbytes <= 8 for p in pieces) and kernels_on == []


def test_other_dtypes_come_back_through_mlxs_copies(kernels_on):
    values = mx.array([0.5, -1.0, 2.0, 3.0], dtype=mx.bfloat16)
    pieces = pooled.host_pieces(values)
    assert [v for p in pieces for v in p.tolist()] == values.tolist() and kernels_on == []


def test_floats_keep_their_bits(kernels_on):
    probs = mx.array([0.25, -0.0, 1e-30, float("inf"), float("nan")], dtype=mx.float32)
    (back,) = pooled.host_lists(probs)
    assert np.array_equal(np.array(back, np.float32).view(np.uint32), np.array(probs).view(np.uint32))
    assert kernels_on == [("split", 5)]


def test_step_dims_are_joined_once_a_step(kernels_on):
    assert pooled.step_dims(1, 16, 2, 8, 517).tolist() == [1, 16, 2, 8, 517]
    assert pooled.step_dims(1, 16, 2, 8, 517).tolist() == [1, 16, 2, 8, 517]  # kept: no launch
    offset = pooled.step_dims(517, kind="offset")  # padded past the pool: 3 values, 2 pieces
    assert offset.tolist() == [517, 0, 0]
    assert kernels_on == [("join", 5), ("join", 3)]


def test_the_probe_passes_the_emulated_kernels_and_catches_broken_ones(monkeypatch, emulator, tmp_path, emulate):
    calls = []
    monkeypatch.setattr(pooled, "gpu_kernel", emulated_kernel(emulator, calls))
    assert pooled.check() is None and calls
    for kind, broken in (("join", lambda k: pooled.join_source(k).replace("[i & 1]", "[0]")),
                         ("split", lambda k: pooled.split_source(k).replace("[i & 1] = v", "[1 - (i & 1)] = v"))):
        emu = emulate.PooledEmulator(tmp_path)
        emu.sources[kind] = broken
        monkeypatch.setattr(pooled, "gpu_kernel", emulated_kernel(emu, calls))
        assert pooled.check() is not None


def test_off_the_gpu_the_copies_are_mlxs():
    assert not pooled.usable()
    assert pooled.status() == {"usable": False, "probed": True, "error": None}


def test_a_window_gives_the_same_logits_and_tokens_through_the_kernels(tiny_model, monkeypatch, emulator):
    """A 5-row window: its ids joined, its greedy tokens (MLX's argmax, as on a GPU) split."""
    monkeypatch.setattr(WindowEngine, "_host_logits", lambda self, rows: False)
    plain_logits, plain_tokens = one_window(tiny_model)
    calls = []
    monkeypatch.setattr(probe, "_upload", {"enabled": True, "device": mx.default_device(), "on": True})
    monkeypatch.setattr(pooled, "_step_dims", {})
    monkeypatch.setattr(pooled, "usable", lambda dtype=None: True)
    monkeypatch.setattr(pooled, "gpu_kernel", emulated_kernel(emulator, calls))
    logits, tokens = one_window(tiny_model)
    assert tokens == plain_tokens and np.array_equal(logits, plain_logits)
    assert calls == [("join", 5), ("split", 5)]
