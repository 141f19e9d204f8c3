"""The CUDA driver through ctypes, for what MLX does not expose (free device memory, memory
advice). Every call answers None or False where there is no driver or it refuses: callers then
do as they would without the answer."""

from __future__ import annotations

import ctypes


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
