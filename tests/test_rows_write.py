"""strata_cli/rows_write.py: rows land where asked along any axis, a snapshot of the buffer keeps
its values, and with no other holder the write reuses the buffer (MLX donates it)."""

import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from strata_cli.rows_write import write_rows


def _address(a: mx.array) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(a)))


@pytest.mark.parametrize("axis, start, n", [(0, 0, 1), (0, 5, 3), (1, 2, 2), (2, 7, 1), (2, 0, 8)])
def test_write_rows_writes_the_rows_and_leaves_a_snapshot_alone(axis, start, n):
    rng = np.random.default_rng(axis * 10 + start)
    before = rng.normal(size=(8, 4, 8, 3)).astype(np.float32)
    shape = list(before.shape)
    shape[axis] = n
    rows = rng.normal(size=shape).astype(np.float32)
    buffer = mx.array(before) + 0
    snapshot = buffer
    out = write_rows(buffer, mx.array(rows), start, axis=axis)
    want = before.copy()
    index = (slice(None),) * axis + (slice(start, start + n),)
    want[index] = rows
    assert np.array_equal(np.array(out), want)
    assert np.array_equal(np.array(snapshot), before)


def test_a_buffer_nothing_else_holds_is_written_in_place():
    buffer = mx.zeros((1, 2, 64, 16)) + 0
    mx.eval(buffer)
    address = _address(buffer)
    for step in range(5):
        buffer = write_rows(buffer, mx.full((1, 2, 1, 16), float(step + 1)), step, axis=2)
        mx.eval(buffer)
        assert _address(buffer) == address
    assert np.array(buffer)[0, 0, :6, 0].tolist() == [1, 2, 3, 4, 5, 0]


def test_no_module_writes_rows_by_the_dynamic_slice_update():
    """`mx.slice_update` with an index array copies the whole buffer on CUDA (docs/benchmarks.md,
    "The H100 loan of 2026-12-05"): eager writes go through `write_rows`."""
    root = Path(__file__).resolve().parents[1]
    calls = [f"{path.relative_to(root)}:{n}" for package in ("strata_cli", "metal_shaders")
             for path in sorted((root / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), start=1) if "mx.slice_update(" in line]
    assert calls == [], f"write with strata_cli.rows_write.write_rows instead: {calls}"
