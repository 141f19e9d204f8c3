"""Sliding-window attention keys and values kept in a ring: `SlidingKVState`.

A row at position p sees the keys of positions p-W+1..p (W, the window, counts the row itself,
as transformers' sliding mask does). The state keeps them in a ring of C cells, position q in
cell q % C. A ring is not positional: a window's rows are written before any row attends, so a
window that wraps the ring writes over cells of older positions, and a rejected draft's cell
is not simply "past the length". The ring is sized so that this never costs a cell anyone can
still see: a window of T rows at pos0 overwrites positions pos0-C..pos0+T-1-C, and every row at
or after pos0 needs positions from pos0-W+1 on; C = W + max_rows - 1 keeps the two apart for
every T <= max_rows. So, as for `KVState`, a window writes straight into the ring, commit only
moves the length, and a rejected row's cell is never visible (its old position had left every
later row's window; the next window at that position rewrites it).

Which cells a row sees is a function of its position alone (`visible`), so a row reads the
same cells, in the same places, whether it runs alone (serial decoding) or inside a window.
Runs longer than max_rows (prompt chunks) attend over the committed window in positional order
followed by the run's own rows, and leave the ring alone until commit, which writes the last
C kept rows.
Attention sinks and the softmax are the layer's business; the state hands out cells and masks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..model.layers import WINDOW_ROWS
from ..rows_write import write_rows
from .state import Mode, check_array, format_shape, slot_kind


class SlidingKVState:
    """Keys and values of a sliding-window attention layer, in a ring of W + max_rows - 1 cells.

    Args:
        window: W, the positions a row sees counting itself.
        max_rows: the most rows a decode window has (the ring's margin).
    """

    def __init__(self, window: int, *, max_rows: int = WINDOW_ROWS):
        if window < 1 or max_rows < 1:
            raise ValueError(f"window ({window}) and max_rows ({max_rows}) must be positive")
        self.window, self.max_rows = window, max_rows
        self.capacity = window + max_rows - 1
        self.keys: mx.array | None = None  # (B, H_kv, capacity, D)
        self.values: mx.array | None = None
        self.length = 0
        self._window: tuple[int, int, Mode] | None = None
        self._pending: tuple[mx.array, mx.array] | None = None  # a long run's rows, written at commit
        self._masks: dict[tuple[int, int], mx.array] = {}  # (pos0 % capacity, T) -> mask, once the window is full

    @property
    def offset(self) -> int:
        """Absolute position of the open window's first row (its rotary offset)."""
        return self._window[0]

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        assert pos0 == self.length, (pos0, self.length)
        self._window = (pos0, T, mode)
        self._pending = None

    def visible(self, pos0: int, T: int) -> mx.array:
        """(T, capacity) bool: the ring cells row t (at position pos0+t) sees."""
        full = pos0 >= self.window - 1  # every row sees W cells: the mask depends on pos0 % capacity only
        key = (pos0 % self.capacity, T)
        if full and key in self._masks:
            return self._masks[key]
        p = np.arange(pos0, pos0 + T)[:, None]
        back = (p - np.arange(self.capacity)[None, :]) % self.capacity  # how far back each cell's position is
        mask = mx.array(back < np.minimum(self.window, p + 1))
        if full:
            self._masks[key] = mask
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Write the window's (B, H_kv, T, D) keys and values; return the cells its rows attend
        over and a (T, L) bool mask of the cells each row sees."""
        pos0, T, mode = self._window
        if self.keys is None:
            B, H, _, D = keys.shape
            self.keys = self.values = mx.zeros((B, H, self.capacity, D), dtype=keys.dtype)
        if T > self.max_rows:
            return self._long_run(keys, values)
        self.keys, self.values = self._written(pos0, keys, values)
        if mode is Mode.PARTIAL:
            self.length = pos0 + 1
        elif mode is Mode.COMMIT_ALL:
            self.length = pos0 + T
        return self.keys, self.values, self.visible(pos0, T)

    def _written(self, pos0: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The ring with positions pos0.. written (at most `capacity` rows); `write_rows`
        never changes an array a snapshot still holds."""
        T = keys.shape[2]
        ring_k, ring_v = self.keys, self.values
        done = 0
        while done < T:  # at most two runs: up to the ring's end, then from its start
            cell = (pos0 + done) % self.capacity
            n = min(T - done, self.capacity - cell)
            ring_k = write_rows(ring_k, keys[:, :, done : done + n], cell, axis=2)
            ring_v = write_rows(ring_v, values[:, :, done : done + n], cell, axis=2)
            done += n
        return ring_k, ring_v

    def _long_run(self, keys: mx.array, values: mx.array):
        pos0, T, mode = self._window
        first = max(0, pos0 - self.window + 1)  # the oldest committed position row 0 sees
        cells = mx.array(np.arange(first, pos0) % self.capacity)
        all_k = mx.concatenate([self.keys[:, :, cells], keys], axis=2)
        all_v = mx.concatenate([self.values[:, :, cells], values], axis=2)
        key_pos = np.arange(first, pos0 + T)[None, :]
        row_pos = np.arange(pos0, pos0 + T)[:, None]
        mask = mx.array((key_pos <= row_pos) & (key_pos > row_pos - self.window))
        self._pending = (keys, values)
        if mode is Mode.PARTIAL:  # the root row is committed state now; commit rewrites it with the rest
            self.keys, self.values = self._written(pos0, keys[:, :, :1], values[:, :, :1])
            self.length = pos0 + 1
        elif mode is Mode.COMMIT_ALL:
            self.length = pos0 + T
        return all_k, all_v, mask

    def commit(self, keep: int) -> None:
        pos0, T, mode = self._window
        if self._pending is not None:  # a long run: its last C kept rows go into the ring now
            keys, values = self._pending
            start = max(0, keep - self.capacity)
            self.keys, self.values = self._written(pos0 + start, keys[:, :, start:keep], values[:, :, start:keep])
        self.length = pos0 + keep
        self._window = self._pending = None

    def abandon(self) -> None:
        self._window = self._pending = None  # its cells are invisible to every later row until rewritten

    def flush(self) -> None:
        pass

    def snapshot(self) -> tuple:
        return (self.keys, self.values, self.length)

    def restore(self, snap: tuple) -> None:
        self.keys, self.values, self.length = snap
        self._window = self._pending = None

    @staticmethod
    def check_snapshot(snap: tuple, like: tuple, length: int) -> str | None:
        """Why `snap` cannot be this state after `length` positions (`like`: `ArraySpec`s of one
        this model made), or None: keys and values exactly of the ring's shape and the model's
        dtype, and the length slot equal to `length`."""
        if len(snap) != 3:
            return f"{len(snap)} slots, a sliding KV state has 3 (keys, values, length)"
        keys, values, n = snap
        if length == 0 and keys is None and values is None and n == 0:
            return None
        if type(n) is not int or n != length:
            return f"length slot is {slot_kind(n)}, the checkpoint holds {length} positions"
        problem = check_array("keys", keys, like[0]) or check_array("values", values, like[1])
        if problem is None and values.shape != keys.shape:
            problem = (f"values have shape {format_shape(values.shape)}, keys {format_shape(keys.shape)}: "
                       "they must match")
        return problem

    def tensors(self) -> dict[str, mx.array]:
        """The committed cells a next row can see (the last W-1 positions), in positional order:
        what serial decoding and any rolled-back window must agree on."""
        if self.keys is None:
            return {}
        cells = mx.array(np.arange(max(0, self.length - self.window + 1), self.length) % self.capacity)
        return {"keys": self.keys[:, :, cells], "values": self.values[:, :, cells]}
