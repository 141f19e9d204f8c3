"""scripts/lab/launch_cost.py runs on the CPU (its CUDA kernel chains skipped) and writes its report."""

import json

import mlx.core as mx

from metal_shaders import module_keys, precompiled
from scripts.lab import launch_cost


def test_the_launch_cost_script_runs_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    launch, keys, state = mx.fast.precompiled_cuda_kernel, module_keys.keys, dict(precompiled._state)
    report = launch_cost.main(["--dir", str(tmp_path / "models"), "--tag", "check"])
    assert set(report["chains_per_op"]) == {"builtin_add"}  # the kernels need CUDA
    assert report["chains_per_op"]["builtin_add"]["dispatch_us"] > 0
    assert set(report["window"]) == {"dtype", "T1", "T8"} and report["window"]["dtype"] == "float32"
    assert report["module_keys"]["active"] is False and report["gil"]["dispatch_s"] > 0
    assert json.loads((tmp_path / "check.json").read_text())["tree"] == report["tree"]
    python = report["call_python_us"]  # MLX's launch stood in: on any backend
    assert 0 < python["stand_in_us"] < python["precompiled_call_us"]
    assert set(report["host_array_us"]) == {"pool_2", "mx_array_8"}
    assert (mx.fast.precompiled_cuda_kernel, module_keys.keys, precompiled._state) == (launch, keys, state)
