"""strata_cli/cuda_driver.py: the driver calls MLX does not expose, answered None or False
wherever the driver cannot answer (here: no NVIDIA driver; its logic against a stand-in)."""

import ctypes

from strata_cli import cuda_driver


class FakeDriver:
    """libcuda's context calls: `current` the thread's context (None: none), `initialised`
    whether cuInit ran, `retain` the error code of retaining the primary context."""

    def __init__(self, *, current=None, initialised=True, retain=0, free=7 << 30):
        self.current, self.initialised, self.retain, self.free = current, initialised, retain, free
        self.made_current = []

    def cuCtxGetCurrent(self, ref):
        if not self.initialised:
            return 3  # CUDA_ERROR_NOT_INITIALIZED
        ref._obj.value = self.current
        return 0

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, dev):
        if self.retain:
            return self.retain
        ref._obj.value = 0x1234
        return 0

    def cuCtxSetCurrent(self, context):
        self.made_current.append(context.value)
        return 0

    def cuMemGetInfo_v2(self, free, total):
        free._obj.value, total._obj.value = self.free, 2 * self.free
        return 0


def test_a_thread_without_a_context_gets_the_primary_one():
    lib = FakeDriver()
    assert cuda_driver.has_context(lib) and lib.made_current == [0x1234]
    held = FakeDriver(current=0x99)
    assert cuda_driver.has_context(held) and held.made_current == []  # MLX's thread: as it is


def test_no_context_where_the_driver_was_never_initialised_or_refuses():
    assert not cuda_driver.has_context(FakeDriver(initialised=False))
    assert not cuda_driver.has_context(FakeDriver(retain=100))


def test_free_memory_asks_the_driver_and_is_none_where_it_cannot(monkeypatch):
    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver())
    assert cuda_driver.free_memory() == 7 << 30
    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver(initialised=False))
    assert cuda_driver.free_memory() is None
    monkeypatch.setattr(cuda_driver, "driver", lambda: None)
    assert cuda_driver.free_memory() is None


def test_the_driver_is_found_where_it_loads_and_none_answers_without_it():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert cuda_driver.driver() is None and cuda_driver.free_memory() is None
    else:
        assert cuda_driver.driver() is not None
