"""metal_shaders: the references the kernels are held to, and where the kernels may run.

The CUDA kernels themselves run only on a GPU (scripts/row_probe.py and `strata selftest` check
them there, docs/benchmarks.md records the runs); here the references are checked against MLX's
own operations, and the CPU is shown to never take the kernel path.
"""

import mlx.core as mx
import pytest

from metal_shaders import rows_matvec as kernels


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_quantized_reference_matches_mlx(bits, group_size):
    x = mx.random.normal((5, 128), key=mx.random.key(1))
    w = mx.random.normal((48, 128), key=mx.random.key(2)) * 0.1
    qw, qs, qb = mx.quantize(w, group_size, bits)
    expected = mx.quantized_matmul(x, qw, qs, qb, transpose=True, group_size=group_size, bits=bits)
    got = kernels.reference_qmatvec(x, qw, qs, qb, group_size=group_size, bits=bits)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


def test_dense_reference_matches_mlx():
    x = mx.random.normal((3, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    w = mx.random.normal((40, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    got = kernels.reference_matvec(x, w)
    assert got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), (x @ w.T).astype(mx.float32), atol=0.1, rtol=2e-2).item()


def test_supported_shapes():
    assert kernels.supports(2048) and not kernels.supports(100)
    assert kernels.supports(2048, group_size=64, bits=4) and kernels.supports(512, group_size=32, bits=8)
    assert not kernels.supports(2048, group_size=64, bits=3) and not kernels.supports(96, group_size=64, bits=4)


def test_the_cpu_never_takes_the_kernel_path():
    if mx.default_device() != mx.cpu:
        pytest.fail("this check is for the CPU test machine")
    assert kernels.kernels_usable() is False
    assert kernels.status() == {"usable": False, "error": None}
