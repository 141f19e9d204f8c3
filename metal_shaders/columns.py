"""Column-mapped projections' layout: which weight row each output column reads, and where it lands.

A column-mapped kernel (rows_matvec's FMA forms, rows_mma's tensor-core forms) computes output
column j from weight row columns[j] and writes the columns in segments: column j of row r lands at
s·R + r·w + (j - s), s and w its segment's first column and width, so each segment of an R-row call
is one contiguous (R, w) array. A consumer's kernel then reads it as it is (a strided column slice
of one (R, N) output would cost MLX a copy first). With one segment the layout is the plain (R, N)
rows. Only where a value lands changes, never the arithmetic.
"""

from __future__ import annotations

import mlx.core as mx


def segment_index(row: str, column: str) -> str:
    """The C expression of the output index of (row, column) in a body with `col_map` (the
    layout's `data`), N (its column count) and R (the call's rows) in scope."""
    return (f"static_cast<size_t>(col_map[N + {column}]) * R + static_cast<size_t>({row}) * col_map[2 * N + {column}]"
            f" + ({column} - col_map[N + {column}])")


class ColumnLayout:
    """A column-mapped call's columns: `columns` (N,) the weight row of each output column, in
    segments split at `bounds` (column indices, increasing); `data` (3N,) uint32 is the kernels'
    col_map (the rows, then each column's segment start, then its segment's width), made once.
    `parts` cuts a call's output into its segments, each a contiguous (..., width) array."""

    __slots__ = ("data", "bounds", "N")

    def __init__(self, columns: mx.array, bounds=()):
        if columns.ndim != 1:
            raise ValueError(f"a column map is (N,), got {columns.shape}")
        self.N = N = columns.size
        self.bounds = tuple(int(b) for b in bounds)
        edges = (0, *self.bounds, N)
        if any(lo >= hi for lo, hi in zip(edges, edges[1:])):
            raise ValueError(f"segment bounds {self.bounds} do not split {N} columns")
        start = mx.concatenate([mx.full((hi - lo,), lo) for lo, hi in zip(edges, edges[1:])])
        width = mx.concatenate([mx.full((hi - lo,), hi - lo) for lo, hi in zip(edges, edges[1:])])
        self.data = mx.concatenate([columns.astype(mx.uint32), start.astype(mx.uint32), width.astype(mx.uint32)])
        mx.eval(self.data)

    @property
    def columns(self) -> mx.array:
        return self.data[: self.N]

    def parts(self, out: mx.array, lead: tuple[int, ...]) -> list[mx.array]:
        """A call's flat output (R·N,) -> its segments, (*lead, width) each (slices: no copy)."""
        R = out.size // self.N
        edges = (0, *self.bounds, self.N)
        pieces = mx.split(out, [R * b for b in self.bounds]) if self.bounds else [out]
        return [p.reshape(*lead, hi - lo) for p, lo, hi in zip(pieces, edges, edges[1:])]


def joined(parts: list[mx.array]) -> mx.array:
    """A column-mapped call's segments side by side: what the plain kernel's gathered columns give."""
    return mx.concatenate(parts, axis=-1)


def probe_column_map(N: int) -> mx.array:
    """The probes' column map over N weight rows: every row once, reordered, then three again, so
    there are more output columns than rows and a column tail (N + 3 is no multiple of 4 for N a
    multiple of 4)."""
    order = (mx.arange(N) * 7 + 3) % N  # a permutation while N is prime to 7
    return mx.concatenate([order, mx.array([0, N - 1, 5])]).astype(mx.uint32)


def probe_layout(N: int) -> ColumnLayout:
    """`probe_column_map(N)` in three segments (`probe_bounds`)."""
    columns = probe_column_map(N)
    return ColumnLayout(columns, probe_bounds(columns.size))


def probe_bounds(n: int) -> tuple[int, int]:
    """Split points of n columns into three segments (for the probes' 203 and 41 columns none
    a multiple of 4 wide: a warp's or a tile's columns cross from one segment into the next)."""
    return (n // 3 + 2, n - 3)
