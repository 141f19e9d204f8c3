"""Launch strata's compiled CUDA kernels by a short key, so a launch does not cost what its binary weighs.

`mx.fast.precompiled_cuda_kernel` takes a kernel's whole binary (a cubin, 8-80 KB for strata's
kernels) at every call: nanobind copies it into a string, the primitive keeps a copy, and every
dispatch names the kernel's module by `std::hash` of it (mlx/backend/cuda/custom_kernel.cpp:
`{name}_{hash:x}`), one pass over the whole binary. A decode window launches about a hundred
such kernels, so that is most of the difference between a strata kernel's dispatch and a builtin
op's on the H200 (docs/benchmarks.md, "What a kernel launch costs the host").

Before MLX builds a module it looks for `<module name>.ptx` in its PTX cache directory
(`MLX_PTX_CACHE_DIR`; mlx/backend/cuda/jit_module.cpp, `read_cached_ptx`, precompiled or not)
and loads that file in place of what it was given. So `ModuleKeys.file` writes the binary there under
the module name of a short key (`strata-module:` and the binary's SHA-256), and the kernel is
launched with the key: MLX hashes and copies ~80 bytes, loads the same binary once per process,
and runs the same code. The name needs MLX's hash: libstdc++'s `std::hash<std::string>`
(`_Hash_bytes`, MurmurHash64A-like, seed 0xc70f6907), which `std_hash` computes.

Only where strata chose the directory MLX reads (`MLX_PTX_CACHE_DIR` set before MLX's first
compile: kernel_cache.py does that) and `STRATA_KERNEL_KEYS` is not 0, and only once a process
has launched one small kernel by its key and read back the right values (precompiled.py,
`verify_keys`, before its first kernel): a mismatch (another MLX naming its modules otherwise, a
directory MLX read before strata set it) leaves the whole binaries in use, never a failed launch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from . import kept

log = logging.getLogger("strata.kernels")

ENV = "STRATA_KERNEL_KEYS"
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
PREFIX = b"strata-module:"
_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` of `data` on a 64-bit target (`_Hash_bytes`)."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    whole = n & ~7
    h = (_SEED ^ (n * _MUL)) & _MASK
    for p in range(0, whole, 8):
        word = (shift_mix((int.from_bytes(data[p : p + 8], "little") * _MUL) & _MASK) * _MUL) & _MASK
        h = ((h ^ word) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * _MUL) & _MASK
    return shift_mix((shift_mix(h) * _MUL) & _MASK)


def module_name(name: str, source: bytes) -> str:
    """The module MLX files a precompiled kernel `name` of `source` under."""
    return f"{name}_{std_hash(source):x}"


def key_of(binary: bytes) -> bytes:
    """The short source a kernel is launched with in place of `binary`."""
    return PREFIX + hashlib.sha256(binary).hexdigest().encode()


class ModuleKeys:
    """The keys of this process's kernels, and whether keys are in use."""

    def __init__(self):
        self._keys: dict[tuple[str, bytes], bytes] = {}
        self._lock = threading.Lock()
        off = os.environ.get(ENV, "1") == "0"
        self.reason: str | None = f"{ENV}=0" if off else None
        self.verified: bool | None = None  # None: not checked in this process yet
        self.directory: Path | None = None  # MLX's PTX directory, as it was at the first file (MLX reads it once)

    @property
    def wanted(self) -> bool:
        """Whether keys may be used here (before the check): not turned off, a PTX directory set."""
        return self.reason is None and bool(os.environ.get(PTX_CACHE_ENV))

    @property
    def active(self) -> bool:
        return self.reason is None and bool(self.verified)

    def disable(self, reason: str) -> None:
        if self.reason is None:
            log.info("kernels launched with their whole binaries (%s)", reason)
            self.reason = reason

    def source_for(self, name: str, binary: bytes) -> bytes:
        """What to pass MLX as the compiled source of kernel `name`: its key, with the binary
        filed where MLX looks for the key's module, or `binary` itself where keys are off."""
        if not self.active:
            return binary
        key = self._keys.get((name, binary))
        if key is not None:
            return key
        with self._lock:
            try:
                key = self.file(name, binary)
            except OSError as e:
                self.disable(f"cannot write to {PTX_CACHE_ENV}: {e}")
                return binary
            self._keys[name, binary] = key
        return key

    def file(self, name: str, binary: bytes) -> bytes:
        """Write `binary` as the module of its key (unless a file of its size is there), the
        kernel list first and the binary last, each renamed into place: MLX reads a `.ptx` as whole."""
        key = key_of(binary)
        if self.directory is None:
            self.directory = Path(os.environ[PTX_CACHE_ENV])
        path = self.directory / f"{module_name(name, key)}.ptx"
        if path.is_file() and path.stat().st_size == len(binary):
            return key
        path.parent.mkdir(parents=True, exist_ok=True)
        kept.atomic_write(path.with_suffix(".txt"), f"{name}\t{name}\n".encode())
        kept.atomic_write(path, binary)
        return key

    def status(self) -> dict:
        return {"active": self.active, "verified": self.verified, "reason": self.reason, "kernels": len(self._keys)}


keys = ModuleKeys()
