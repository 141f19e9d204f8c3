"""Rows written into a buffer in place of its old ones, by MLX's static slice update.

`out[..., start:start + n, ...] = rows` builds MLX's SliceUpdate, which reuses the buffer when
nothing else holds it, so a write costs its rows. `mx.slice_update` with the start as an index
array (DynamicSliceUpdate) copied the whole buffer on CUDA (MLX 0.32.4, an H100): one KV row into
a 134 MB buffer took 735 µs against 179, one expert record into 512-slot banks 1.04 ms against
0.19 (docs/benchmarks.md). The offset is a copy's argument on every backend, so a new one builds
no kernel; it is a constant in a trace, so `mx.compile`d code keeps the dynamic form (state writes
stay eager here).
"""

from __future__ import annotations

import mlx.core as mx


def write_rows(buffer: mx.array, rows: mx.array, start: int, axis: int) -> mx.array:
    """`buffer` with `rows` at start..start+n-1 along `axis` (n = rows.shape[axis]), lazily; the
    array `buffer` itself is unchanged (a snapshot holding it keeps its values)."""
    out = mx.array(buffer)  # a handle of its own: the assignment rewrites only this one
    out[(slice(None),) * axis + (slice(start, start + rows.shape[axis]),)] = rows
    return out
