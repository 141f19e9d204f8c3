"""Where a GPU backend's compiled kernels outlive the process, and whether this process starts cold.

MLX's CUDA backend compiles each kernel module with NVRTC (to the GPU's own SASS when NVRTC knows
the GPU, else to PTX) and keeps it as a file in `MLX_PTX_CACHE_DIR`, by default
`$TMPDIR/mlx/<MLX version>/ptx`: a directory a reboot or a fresh machine empties, and one named by
the MLX version only, so a home shared by two GPU models would hand one the other's SASS. Unless
the user set `MLX_PTX_CACHE_DIR`, strata points it at the user cache, one directory per MLX
version and GPU (`prepare_kernel_cache`, before the first kernel is built: MLX reads the variable
once, at its first compile).

What MLX does not keep: kernels made with `mx.fast.cuda_kernel` (metal_shaders/) are compiled in
every process that runs them (MLX builds them with its disk cache off); NVRTC-built SASS needs no
driver JIT, so the CUDA driver's compute cache (`CUDA_CACHE_PATH`) holds nothing for MLX on a GPU
NVRTC knows. strata keeps those itself, with its kernels' probe verdicts, in `<kernel dir>/strata`
(`strata_dir`; metal_shaders/kept.py, precompiled.py, probe.py), on any GPU backend.
docs/benchmarks.md, "Start-up on the H200", measures each part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from metal_shaders import kept

from .calibrate import backend_name, cache_dir
from .cuda_driver import is_cuda

PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
COLD_NOTICE = ("strata: compiling GPU kernels for this machine, once (kept in {path}); "
               "the first run takes a minute or more")


@dataclass(frozen=True)
class KernelCache:
    """The compiled-kernel cache of this process.

    Attributes:
        path: where MLX keeps compiled kernels; None off a CUDA backend (nothing is kept).
        chosen_by: "user" (`MLX_PTX_CACHE_DIR` was set), "strata" (set here) or "none".
        cold: nothing is compiled there yet, so this process builds every kernel it runs.
    """

    path: Path | None
    chosen_by: str
    cold: bool

    @property
    def notice(self) -> str | None:
        """The one line to tell the user before a cold cache's first compile, else None."""
        return COLD_NOTICE.format(path=self.path) if self.cold else None

    def as_dict(self) -> dict:
        return {"path": None if self.path is None else str(self.path), "chosen_by": self.chosen_by,
                "cold": self.cold}


def default_kernel_dir(backend: str, directory: Path | None = None) -> Path:
    """strata's kernel directory for this MLX version and `backend` ("gpu:NVIDIA H200")."""
    safe = "".join(c if c.isalnum() or c in ".-" else "-" for c in f"mlx-{mx.__version__}-{backend}")
    return (directory or cache_dir()) / "kernels" / safe


def strata_dir(backend: str, directory: Path | None = None) -> Path:
    """Where strata keeps its own compiled kernels and probe verdicts for this MLX version and GPU
    (beside MLX's modules, whoever chose MLX's directory)."""
    return default_kernel_dir(backend, directory) / "strata"


def prepare_kernel_cache(*, cuda: bool | None = None, directory: Path | None = None) -> KernelCache:
    """Set `MLX_PTX_CACHE_DIR` to strata's default unless the user set it (CUDA backends only),
    and say whether anything is compiled there yet.

    Args:
        cuda: whether MLX runs on CUDA (default: `is_cuda()`).
        directory: strata's cache directory (default `calibrate.cache_dir()`).
    """
    if mx.default_device().type == mx.gpu or cuda:
        kept.configure(strata_dir(backend_name(), directory))
    if not (is_cuda() if cuda is None else cuda):
        return KernelCache(path=None, chosen_by="none", cold=False)
    chosen = os.environ.get(PTX_CACHE_ENV)
    default = default_kernel_dir(backend_name(), directory)
    if chosen:  # the user's, or strata's own from an earlier call in this process
        path, chosen_by = Path(chosen), "strata" if Path(chosen) == default else "user"
    else:
        path, chosen_by = default, "strata"
        try:
            path.mkdir(parents=True, exist_ok=True)
            os.environ[PTX_CACHE_ENV] = str(path)
        except OSError:  # an unwritable home: MLX's own default directory
            path, chosen_by = Path(os.environ.get("TMPDIR") or "/tmp") / "mlx" / mx.__version__ / "ptx", "none"
    # MLX splits a long module name into subdirectories, so a compiled module may lie deeper.
    # Cold: neither MLX nor strata has compiled anything for this machine yet.
    ours = kept.directory()
    cold = next(path.rglob("*.ptx"), None) is None and (ours is None or next(ours.rglob("*.bin"), None) is None)
    return KernelCache(path=path, chosen_by=chosen_by, cold=cold)
