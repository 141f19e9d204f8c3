"""The compiled-kernel cache across processes (kernel_cache.py) and the first run's notice: strata
points MLX's kernel cache at the user cache per MLX version and GPU unless the user chose a
directory, and says it is compiling only when that cache is empty on a CUDA backend."""

import io
import os

import mlx.core as mx
import pytest
from click.testing import CliRunner
from rich.console import Console

from metal_shaders import kept
from strata_cli import kernel_cache, kernel_warm
from strata_cli.cli import cli
from strata_cli.kernel_cache import PTX_CACHE_ENV, prepare_kernel_cache
from strata_cli.options import EngineOptions, LoadOptions
from strata_cli.runtime import open_model
from strata_cli.terminal import WarmUpBar


@pytest.fixture(autouse=True)
def _no_user_cache_dir(monkeypatch):
    monkeypatch.delenv(PTX_CACHE_ENV, raising=False)
    monkeypatch.setattr(kept, "_directory", None)  # prepare_kernel_cache sets it: not for later tests


def test_the_cpu_keeps_nothing_and_sets_nothing():
    assert mx.default_device().type == mx.cpu and not kernel_cache.is_cuda()
    cache = prepare_kernel_cache()
    assert cache.path is None and not cache.cold and cache.notice is None
    assert PTX_CACHE_ENV not in os.environ


def test_cuda_gets_a_directory_per_mlx_version_and_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "backend_name", lambda: "gpu:NVIDIA H200")
    cache = prepare_kernel_cache(cuda=True, directory=tmp_path)
    assert cache.chosen_by == "strata" and cache.cold
    assert cache.path == tmp_path / "kernels" / f"mlx-{mx.__version__}-gpu-NVIDIA-H200"
    assert os.environ[PTX_CACHE_ENV] == str(cache.path) and cache.path.is_dir()
    assert "compiling GPU kernels for this machine, once" in cache.notice
    again = prepare_kernel_cache(cuda=True, directory=tmp_path)  # a second model in the same process
    assert again.chosen_by == "strata" and again.path == cache.path
    # MLX puts a long module name's file in subdirectories: a compiled module anywhere counts
    (cache.path / "abc").mkdir()
    (cache.path / "abc" / "def.ptx").write_bytes(b"\x7fELF")
    monkeypatch.delenv(PTX_CACHE_ENV)
    warm = prepare_kernel_cache(cuda=True, directory=tmp_path)
    assert not warm.cold and warm.notice is None
    monkeypatch.setattr(kernel_cache, "backend_name", lambda: "gpu:NVIDIA A100")
    monkeypatch.delenv(PTX_CACHE_ENV)
    other = prepare_kernel_cache(cuda=True, directory=tmp_path)
    assert other.path != warm.path and other.cold  # another GPU never loads this one's SASS


def test_a_users_own_directory_is_kept(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "x.ptx").write_text("ptx")
    monkeypatch.setenv(PTX_CACHE_ENV, str(mine))
    cache = prepare_kernel_cache(cuda=True, directory=tmp_path / "strata")
    assert cache.chosen_by == "user" and cache.path == mine and not cache.cold
    assert os.environ[PTX_CACHE_ENV] == str(mine)
    assert not (tmp_path / "strata").exists()


def test_open_model_on_the_cpu_announces_nothing_and_warms_nothing():
    lines, progress = [], []
    runtime = open_model(LoadOptions(), EngineOptions(max_context=64), announce=lines.append,
                         warm_progress=lambda done, total: progress.append((done, total)))
    assert lines == [] and progress == [] and runtime.warmup_seconds == 0.0 and runtime.warmup_by_rows == {}
    assert runtime.kernel_cache.as_dict() == {"path": None, "chosen_by": "none", "cold": False}


def test_open_model_with_warm_shapes_times_each_shape():
    progress = []
    runtime = open_model(LoadOptions(), EngineOptions(max_context=64, warm_shapes=True, pad_windows=True),
                         warm_progress=lambda done, total: progress.append((done, total)))
    assert list(runtime.warmup_by_rows) == [1, 2, 4, 8]
    assert progress == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert runtime.warmup_seconds >= sum(runtime.warmup_by_rows.values()) > 0


def test_a_cold_cache_is_announced_before_loading_and_warms_the_first_shape(monkeypatch):
    """What a CUDA machine's first run does, with the CPU standing in for it."""
    from strata_cli import runtime as runtime_module
    from strata_cli.kernel_cache import KernelCache

    events = []
    monkeypatch.delenv(kernel_warm.ENV, raising=False)
    monkeypatch.setattr(runtime_module, "prepare_kernel_cache",
                        lambda: KernelCache(path=None, chosen_by="strata", cold=True))
    real_load = runtime_module.load_checkpoint
    monkeypatch.setattr(runtime_module, "load_checkpoint", lambda *a, **k: events.append("load") or real_load(*a, **k))
    from strata_cli.engine import window

    monkeypatch.setattr(window, "on_gpu", lambda: True)  # engines pad and warm shapes on first use
    runtime = open_model(LoadOptions(), EngineOptions(max_context=64), announce=lambda line: events.append(line),
                         warm_progress=lambda done, total: events.append((done, total)))
    assert "compiling GPU kernels" in events[0] and events[1] == "load"
    assert events[2:] == [(0, 1), (1, 1)] and list(runtime.warmup_by_rows) == [1]


def test_the_warm_up_bar_prints_one_line_and_draws_only_on_a_terminal():
    out = io.StringIO()
    bar = WarmUpBar(Console(file=out, width=200))
    bar(0, 4)  # nothing announced: no bar
    bar.announce("strata: compiling GPU kernels for this machine, once (kept in /x)")
    bar(0, 4)
    bar(4, 4)
    bar.close()
    assert out.getvalue() == "strata: compiling GPU kernels for this machine, once (kept in /x)\n"


def test_generate_on_the_cpu_says_nothing_about_kernels():
    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "3", "--max-context", "64"])
    assert result.exit_code == 0 and "compiling" not in result.stderr
