"""Compressed-attention state (DeepSeek-V4's CSA and HCA branches) and its rollback rules.

A compressor closes a window of `rate` source rows into one compressed entry; with `overlap` (CSA
and its indexer) an entry pools the previous window's first series with its own window's second
one, so the rows of the last closed window are needed once more. That tail is not positional: it
holds rows of the open window and of the window before it, and serially it is overwritten as
windows close (docs/design.md, "State and its rollback rule"). Two ways keep it exact:

- `ReplayTail` (default): a window reads the committed tail and never changes it; it keeps the
  joined rows (tail + window rows), and `commit(keep)` makes the new tail from the committed one
  and the kept rows only. The compressed entries are positional (entry w depends on rows
  w*rate-rate .. w*rate+rate-1 only): a window writes the entries its rows close past the
  committed count, and commit truncates to the entries the kept rows close. Any T is safe.
- `RingTail`: the raw rows live in a ring of slots (`cell % slots`) written as rows arrive and
  never restored; exact only when a window never crosses a window boundary with a row it may
  reject, `T <= rate - pos0 % rate` (speculative/safe_window.py's block cap), which the engine then
  asks the planner for (`needs_block_cap`).

`CompressedAttentionState` is one DeepSeek-V4 attention layer's state: the sliding-window keys
(a positional `KVState`, the window applied by the layer's mask), the compressor's tail and, on
CSA layers, the lightning indexer's own compressor tail.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.layer_state import Pool
from ..rows_write import write_rows
from .state import ArraySpec, KVState, Mode, check_array, slot_kind

ENTRY_STEP = 64  # entry buffers grow in steps of this many entries


def tail_start(length: int, rate: int, overlap: bool) -> int:
    """First position the committed tail holds after `length` positions: the open window, and
    with `overlap` the closed window before it."""
    closed = length // rate
    return (closed - 1) * rate if overlap and closed else closed * rate


def _reserve(buffer: mx.array | None, end: int, like: mx.array) -> mx.array:
    """`buffer` (B, capacity, D) grown to hold `end` entries (like's batch, width and dtype)."""
    capacity = 0 if buffer is None else buffer.shape[1]
    if end <= capacity:
        return buffer
    B, _, D = like.shape
    grown = -(-end // ENTRY_STEP) * ENTRY_STEP
    fresh = mx.zeros((B, grown - capacity, D), dtype=like.dtype)
    return fresh if buffer is None else mx.concatenate([buffer, fresh], axis=1)


class CompressorTail:
    """What both tails share: the entry buffer (positional, append-only), the window bookkeeping,
    tensors and the snapshot checks. Subclasses keep the raw rows their own way."""

    def __init__(self, rate: int, dims: int, *, overlap: bool):
        self.rate, self.dims, self.overlap = rate, dims, overlap
        self.width = dims * (2 if overlap else 1)  # raw row width: two series with overlap
        self.entries: mx.array | None = None  # (B, capacity, D): entries 0..count-1 committed
        self.count = 0
        self.length = 0
        self._window: tuple[int, int, Mode] | None = None

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        assert pos0 == self.length, (pos0, self.length)
        self._window = (pos0, T, mode)

    def _write_entries(self, entries: mx.array, first: int) -> mx.array:
        """Write `entries` (B, m, D) at entry index `first`; return the buffer's first+m entries."""
        end = first + entries.shape[1]
        if entries.shape[1]:
            self.entries = _reserve(self.entries, end, entries)
            self.entries = write_rows(self.entries, entries, first, axis=1)
        return self.entries[:, :end] if self.entries is not None else entries

    def rows(self) -> tuple[mx.array, mx.array] | None:
        """The committed raw rows (kv, gate) of positions tail_start(length)..length-1."""
        raise NotImplementedError

    def snapshot(self) -> tuple:
        rows = self.rows()
        kv, gate = rows if rows is not None else (None, None)
        return (kv, gate, self.entries, self.count, self.length)

    def tensors(self) -> dict[str, mx.array]:
        rows = self.rows()
        if rows is None:
            return {}
        entries = self.entries[:, : self.count] if self.count else mx.zeros((rows[0].shape[0], 0, self.dims))
        return {"raw_kv": rows[0], "raw_gate": rows[1], "entries": entries}

    def flush(self) -> None:
        pass

    def check_snapshot(self, snap: tuple, length: int, *, batch: int, dtype: mx.Dtype, name: str) -> str | None:
        """Why `snap` cannot be this tail after `length` positions, or None: the raw rows
        (batch, n, width) with n = length - tail_start(length), the entry buffer
        (batch, >= length // rate, dims), the count and length slots, arrays in `dtype`."""
        if len(snap) != 5:
            return f"{name}: {len(snap)} slots, a compressor tail has 5 (raw kv, raw gate, entries, count, length)"
        kv, gate, entries, count, n = snap
        if length == 0 and kv is None and gate is None and entries is None and count == 0 and n == 0:
            return None
        if type(n) is not int or n != length:
            return f"{name}: length slot is {slot_kind(n)}, the checkpoint holds {length} positions"
        closed = length // self.rate
        if type(count) is not int or count != closed:
            return f"{name}: entry count is {slot_kind(count)}, {length} positions close {closed} entries"
        raw = ArraySpec((batch, length - tail_start(length, self.rate, self.overlap), self.width), dtype)
        problem = check_array(f"{name} raw kv", kv, raw) or check_array(f"{name} raw gate", gate, raw)
        if problem or closed == 0 and entries is None:
            return problem
        text = f"({batch}, N, {self.dims}) with N >= {closed}"
        return check_array(f"{name} entries", entries, ArraySpec((batch, closed, self.dims), dtype), shape_text=text,
                           fits=lambda s: len(s) == 3 and s[0] == batch and s[2] == self.dims and s[1] >= closed)


class ReplayTail(CompressorTail):
    """The exact rollback: the committed raw rows are never changed by a window; commit builds
    the new tail from them and the kept rows (the joined rows the window kept), so any window
    size is safe."""

    def __init__(self, rate: int, dims: int, *, overlap: bool):
        super().__init__(rate, dims, overlap=overlap)
        self.kv: mx.array | None = None  # (B, n, W) raw rows of tail_start(length)..length-1
        self.gate: mx.array | None = None
        self._joined: tuple[mx.array, mx.array] | None = None

    def rows(self):
        return None if self.kv is None else (self.kv, self.gate)

    def compress(self, kv: mx.array, gate: mx.array, pool: Pool) -> mx.array:
        """Add the window's raw rows (B, T, W); return every entry its rows close or were closed
        before (B, n, D). The committed tail is read, never changed."""
        pos0, T, _ = self._window
        if self.kv is not None:
            kv = mx.concatenate([self.kv, kv], axis=1)
            gate = mx.concatenate([self.gate, gate], axis=1)
        self._joined = (kv, gate)
        closed = (pos0 + T) // self.rate
        new = closed - self.count
        if new == 0:
            return self.entries[:, : self.count] if self.count else None
        has_prev = self.overlap and self.count > 0
        rows = (new + int(has_prev)) * self.rate
        return self._write_entries(pool(kv[:, :rows], gate[:, :rows], has_prev, self.count), self.count)

    def commit(self, keep: int) -> None:
        pos0, T, _ = self._window
        self._window = None
        kv, gate = self._joined
        self._joined = None
        length = pos0 + keep
        start = tail_start(pos0, self.rate, self.overlap)
        first = tail_start(length, self.rate, self.overlap) - start
        self.kv, self.gate = kv[:, first : length - start], gate[:, first : length - start]
        self.count, self.length = length // self.rate, length

    def abandon(self) -> None:
        self._window = self._joined = None

    def restore(self, snap: tuple) -> None:
        self.kv, self.gate, self.entries, self.count, self.length = snap
        self._window = self._joined = None


class RingTail(CompressorTail):
    """The capped rollback: raw rows in a ring of `rate` slots (2 * rate with `overlap`), row
    `cell` in slot `cell % slots`, written as a window runs and never restored; an entry pools
    the ring when its window's last row is written. Exact only for windows within one block
    (`T <= rate - pos0 % rate`): a row that crosses into the next block overwrites the slot of a
    committed row a later entry still needs (tests/test_tail_structure.py)."""

    def __init__(self, rate: int, dims: int, *, overlap: bool):
        super().__init__(rate, dims, overlap=overlap)
        self.slots = rate * (2 if overlap else 1)
        self.ring_kv: mx.array | None = None  # (B, slots, W)
        self.ring_gate: mx.array | None = None

    def rows(self):
        if self.ring_kv is None:
            return None
        cells = range(tail_start(self.length, self.rate, self.overlap), self.length)
        index = mx.array([c % self.slots for c in cells], mx.int32)
        return self.ring_kv[:, index], self.ring_gate[:, index]

    def compress(self, kv: mx.array, gate: mx.array, pool: Pool) -> mx.array:
        pos0, T, _ = self._window
        if self.ring_kv is None:
            B, _, W = kv.shape
            self.ring_kv = mx.zeros((B, self.slots, W), dtype=kv.dtype)
            self.ring_gate = mx.zeros((B, self.slots, W), dtype=gate.dtype)
        out = self.entries[:, : self.count] if self.count else None
        for i in range(T):
            cell = pos0 + i
            self.ring_kv = write_rows(self.ring_kv, kv[:, i : i + 1], cell % self.slots, axis=1)
            self.ring_gate = write_rows(self.ring_gate, gate[:, i : i + 1], cell % self.slots, axis=1)
            if cell % self.rate == self.rate - 1:
                block = cell // self.rate
                has_prev = self.overlap and block > 0
                cells = range(cell + 1 - (1 + int(has_prev)) * self.rate, cell + 1)
                index = mx.array([c % self.slots for c in cells], mx.int32)
                out = self._write_entries(pool(self.ring_kv[:, index], self.ring_gate[:, index], has_prev, block),
                                          block)
        return out

    def commit(self, keep: int) -> None:
        pos0, T, _ = self._window
        self._window = None
        self.length = pos0 + keep
        self.count = self.length // self.rate  # entries of blocks the kept rows did not close are dead

    def abandon(self) -> None:
        self._window = None  # the ring keeps what the window wrote: capped windows rewrite it

    def restore(self, snap: tuple) -> None:
        kv, gate, self.entries, self.count, self.length = snap
        self._window = None
        if kv is None:
            self.ring_kv = self.ring_gate = None
            return
        B, _, W = kv.shape
        self.ring_kv = mx.zeros((B, self.slots, W), dtype=kv.dtype)
        self.ring_gate = mx.zeros((B, self.slots, W), dtype=gate.dtype)
        cells = range(tail_start(self.length, self.rate, self.overlap), self.length)
        if len(cells):
            index = mx.array([c % self.slots for c in cells], dtype=mx.int32)
            self.ring_kv[:, index] = kv
            self.ring_gate[:, index] = gate


TAILS = {"replay": ReplayTail, "cap": RingTail}


class CompressedAttentionState:
    """One DeepSeek-V4 attention layer's state: the sliding-window keys (`window`, positional),
    the compressor's tail (`compressor`, CSA and HCA layers) and the indexer's (`indexer`, CSA).

    Its snapshot is the parts' slots in that order, flat (3 + 5 + 5): sessions store flat slots.
    """

    def __init__(self, *, compress_rate: int, head_dim: int, index_head_dim: int | None, rollback: str):
        tail = TAILS[rollback]
        self.window = KVState()
        has_indexer = index_head_dim is not None
        self.compressor = tail(compress_rate, head_dim, overlap=has_indexer) if compress_rate else None
        self.indexer = tail(compress_rate, index_head_dim, overlap=True) if has_indexer else None

    @property
    def parts(self) -> list:
        return [p for p in (self.window, self.compressor, self.indexer) if p is not None]

    @property
    def offset(self) -> int:
        return self.window.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.window.update_and_fetch(keys, values)

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        for part in self.parts:
            part.begin(pos0, T, mode)

    def commit(self, keep: int) -> None:
        for part in self.parts:
            part.commit(keep)

    def abandon(self) -> None:
        for part in self.parts:
            part.abandon()

    def flush(self) -> None:
        pass

    def snapshot(self) -> tuple:
        return tuple(slot for part in self.parts for slot in part.snapshot())

    def restore(self, snap: tuple) -> None:
        self.window.restore(snap[:3])
        for i, part in enumerate(self.parts[1:]):
            part.restore(snap[3 + 5 * i : 8 + 5 * i])

    def tensors(self) -> dict[str, mx.array]:
        out = {f"window.{k}": v for k, v in self.window.tensors().items()}
        for name in ("compressor", "indexer"):
            part = getattr(self, name)
            if part is not None:
                out.update({f"{name}.{k}": v for k, v in part.tensors().items()})
        return out

    def check_snapshot(self, snap: tuple, like: tuple, length: int) -> str | None:
        """Why `snap` cannot be this layer's state after `length` positions (`like`: the
        `ArraySpec`s of one this model made; the window keys give the batch and dtype), or None."""
        slots = 3 + 5 * (len(self.parts) - 1)
        if len(snap) != slots:
            return f"{len(snap)} slots, this compressed-attention layer has {slots}"
        problem = KVState.check_snapshot(snap[:3], like[:3], length)
        batch, dtype = like[0].shape[0], like[0].dtype
        for i, name in enumerate(n for n in ("compressor", "indexer") if getattr(self, n) is not None):
            problem = problem or getattr(self, name).check_snapshot(snap[3 + 5 * i : 8 + 5 * i], length, batch=batch,
                                                                    dtype=dtype, name=name)
        return problem
