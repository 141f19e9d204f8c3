"""strata_cli/host_arrays.py: the host's per-window arrays mapped for a CUDA GPU (checked on the
CPU with the CUDA check and the driver's advice stood in), and the kernels' sizes arrays kept
for the most recent shapes only."""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import probe
from strata_cli import host_arrays
from strata_cli.engine.window import WindowEngine


@pytest.fixture
def advice(monkeypatch):
    """CUDA as the backend, each advice (address, size) recorded; `advice.answer` is the driver's."""
    calls = []

    def advise(address, size):
        calls.append((address, size))
        return advise.answer

    advise.answer, advise.calls = True, calls
    monkeypatch.setattr(host_arrays.cuda_driver, "is_cuda", lambda: True)
    monkeypatch.setattr(host_arrays.cuda_driver, "host_mapped", lambda stay_on_host: None if stay_on_host else advise)
    monkeypatch.setattr(host_arrays, "_pages", host_arrays._Pages())
    return advise


def _address(array):
    return np.array(array, copy=False).__array_interface__["data"][0]


def test_off_cuda_it_is_mx_array(monkeypatch):
    monkeypatch.setattr(host_arrays, "_pages", host_arrays._Pages())
    a = host_arrays.host_array([[1, 2, 3, 4, 5]])
    assert a.dtype == mx.int32 and a.tolist() == [[1, 2, 3, 4, 5]]
    b = host_arrays.host_array([0.5, 2.0], mx.bfloat16)
    assert b.dtype == mx.bfloat16 and b.tolist() == [0.5, 2.0]
    assert host_arrays._pages.advise is None and not host_arrays._pages.mapped


def test_arrays_mlx_does_not_map_get_their_pages_mapped_once(advice):
    small = host_arrays.host_array([7, 8])  # 8 bytes: MLX's own mapped pool
    assert small.tolist() == [7, 8] and advice.calls == []
    tokens = host_arrays.host_array([[1, 2, 3, 4]])
    (address, size), = advice.calls
    assert address % host_arrays.PAGE == 0 and address <= _address(tokens) < _address(tokens) + 16 <= address + size
    host_arrays._pages.map(tokens)  # its page is mapped already: no second call
    assert len(advice.calls) == 1 and tokens.tolist() == [[1, 2, 3, 4]]
    gates = host_arrays.host_array([0.5] * 16, mx.bfloat16)  # no PEP 3118 format: its address all the same
    address = _address(gates.view(mx.uint16))
    assert gates.tolist() == [0.5] * 16 and address - address % host_arrays.PAGE in host_arrays._pages.mapped


def test_the_environment_turns_mapping_off(advice, monkeypatch):
    monkeypatch.setenv(host_arrays.ENV, "0")
    assert host_arrays.host_array([[1, 2, 3, 4]]).tolist() == [[1, 2, 3, 4]] and advice.calls == []


def test_a_driver_that_refuses_is_asked_no_more(advice):
    advice.answer = False
    for n in range(10):
        host_arrays.host_array(np.arange(n * 64, n * 64 + 64, dtype=np.int32))  # 256 bytes, a page apart or so
    assert len(advice.calls) == 8 and host_arrays._pages.advise is None
    assert host_arrays.host_array([1, 2, 3]).tolist() == [1, 2, 3]


def test_a_window_maps_its_token_ids_and_a_serial_step_needs_not(advice, next_model):
    engine = WindowEngine(next_model)
    engine.prefill([1, 2, 3])
    engine.run([4], 3), engine.commit(1)
    assert advice.calls == []  # one id: 4 bytes
    engine.run([5, 6, 7, 8], 4), engine.commit(4)
    assert len(advice.calls) == 1


def test_step_sizes_are_mapped_and_kept_for_one_step_and_shapes_are_kept_as_they_are(advice, monkeypatch):
    monkeypatch.setattr(probe, "_dims_cache", {})
    monkeypatch.setattr(probe, "_step_dims", [None, None])
    static = probe.dims(1, 16, 2, 64)  # read by every window: its page moves to the GPU once, as ever
    assert probe.dims(1, 16, 2, 64) is static and static.dtype == mx.int32 and advice.calls == []
    first = probe.step_dims(1, 16, 2, 1, 100)  # an attention kernel's cache length: new every step
    assert probe.step_dims(1, 16, 2, 1, 100) is first and first.tolist() == [1, 16, 2, 1, 100]
    assert len(advice.calls) == 1  # mapped: its one reader needs no page fault
    following = probe.step_dims(1, 16, 2, 1, 101)
    assert following.tolist() == [1, 16, 2, 1, 101] and probe._step_dims[1] is following
    assert len(probe._dims_cache) == 1  # the steps' sizes are not kept
