"""Whether MLX runs on CUDA, and the CUDA driver through ctypes for what MLX does not expose
(free device memory, memory advice). Every driver call answers None or False where there is no
driver or it refuses: callers then do as they would without the answer."""

from __future__ import annotations

import ctypes
from typing import Callable

import mlx.core as mx


def is_cuda() -> bool:
    """Whether the default device is a GPU of MLX's CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and cuda.is_available()


def driver() -> ctypes.CDLL | None:
    """libcuda, or None where it cannot be loaded (no NVIDIA driver)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def has_context(lib: ctypes.CDLL) -> bool:
    """Whether this thread has a current context, giving it the device's primary context (the
    one MLX uses) where it has none: driver calls from a thread MLX has not used need one."""
    context = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(context)) != 0:
        return False  # the driver was never initialised in this process
    if context.value:
        return True
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), 0) or lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), dev):
        return False
    return lib.cuCtxSetCurrent(context) == 0


def free_memory() -> int | None:
    """Bytes free on GPU 0 now (`cuMemGetInfo`), or None where the driver cannot say."""
    lib = driver()
    if lib is None or not hasattr(lib, "cuMemGetInfo_v2") or not has_context(lib):
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
        return None
    return free.value


def host_mapped() -> Callable[[int, int], bool] | None:
    """`advise(address, size) -> advised`: keep a managed range in host memory (`cuMemAdvise`
    SET_PREFERRED_LOCATION: the host writes it often) and map it for GPU 0 (SET_ACCESSED_BY), so
    that the GPU reads it over the bus instead of faulting its pages over; None when there is no
    driver to ask (then the range works as MLX made it, its pages migrating)."""
    lib = driver()
    if lib is None or not hasattr(lib, "cuMemAdvise_v2"):
        return None
    advise = lib.cuMemAdvise_v2

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    advise.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, Location]
    advise.restype = ctypes.c_int
    set_preferred_location, set_accessed_by = 3, 5  # CU_MEM_ADVISE_*
    host, device = 2, 1  # CU_MEM_LOCATION_TYPE_*

    def run(address: int, size: int) -> bool:
        # advice is a hint: a refusal leaves the range as MLX made it, correct and slower
        if not has_context(lib):
            return False
        if advise(address, size, set_preferred_location, Location(host, 0)):
            return False
        return not advise(address, size, set_accessed_by, Location(device, 0))

    return run
