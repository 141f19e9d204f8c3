"""Per-layer state and its rollback rules (docs/design.md, "State and its rollback rule").

Every state implements one protocol, `LayerState`:

- `begin(pos0, T, mode)` opens a window of `T` rows at absolute positions `pos0..pos0+T-1`;
- the model layer then reads and writes the state through the calls model/layer_state.py
  names (`KVState.update_and_fetch`, `GDNState.conv_window` / `GDNState.recur`);
- `commit(keep)` makes the state equal to serially processing the first `keep` rows;
- `abandon()` closes a WINDOW-mode window that keeps nothing (committed state never changed);
- `flush()` applies any deferred work, `snapshot()` / `restore()` save and bring back committed
  state (MLX arrays are immutable, so a snapshot is a tuple of references), and `tensors()`
  names the committed tensors, for checkpoints and for the rollback tests;
- `check_snapshot(snap, like, length)` says why a snapshot from outside (a session file) cannot
  be this layer's committed state, against `like`, the `ArraySpec`s of one this model made.

Further rows of the state table (sparse-attention indexer tail, PLE history, logit processors)
implement the same calls, so the window contract never changes when they arrive.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..model.layer_state import GDNRows, Scan, SSMRows
from ..rows_write import write_rows

KV_STEP = 256  # KV buffers grow in steps of this many cells, so shapes change rarely


class Mode(enum.Enum):
    """How a window's rows reach committed state."""

    WINDOW = "window"  # nothing commits until commit(keep)
    PARTIAL = "partial"  # the root row (always kept) commits inside the run
    COMMIT_ALL = "commit_all"  # prompt chunks: every row commits inside the run


class LayerState(Protocol):
    def begin(self, pos0: int, T: int, mode: Mode) -> None: ...
    def commit(self, keep: int) -> None: ...
    def abandon(self) -> None: ...
    def flush(self) -> None: ...
    def snapshot(self) -> tuple: ...
    def restore(self, snap: tuple) -> None: ...
    def tensors(self) -> dict[str, mx.array]: ...
    @staticmethod
    def check_snapshot(snap: tuple, like: tuple, length: int) -> str | None: ...


@dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one snapshot array, without its data."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @classmethod
    def of(cls, value):
        """`value`'s spec if it is an array; other slot values (ints, None) as they are."""
        return cls(tuple(value.shape), value.dtype) if isinstance(value, mx.array) else value


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def format_shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def slot_kind(value) -> str:
    if isinstance(value, mx.array):
        return f"an array {format_shape(value.shape)}"
    return "empty" if value is None else f"{type(value).__name__} {value!r}"


def check_array(name: str, value, like: ArraySpec, *, shape_text: str | None = None, fits=None) -> str | None:
    """Why `value` is not an array like `like` (shape and dtype), or None.

    Args:
        name: the slot's name, for the message.
        value: the restored slot value.
        like: the spec of the array this model puts there.
        shape_text: `like`'s shape as the message shows it (default: `like.shape`).
        fits: a test of the shape (default: equal to `like.shape`).
    """
    if not isinstance(value, mx.array):
        return f"{name} is {slot_kind(value)}, not an array"
    ok = fits(tuple(value.shape)) if fits else tuple(value.shape) == like.shape
    if not ok:
        return f"{name} has shape {format_shape(value.shape)}, this model's is {shape_text or format_shape(like.shape)}"
    if value.dtype != like.dtype:
        return f"{name} is {_dtype_name(value.dtype)}, this model's is {_dtype_name(like.dtype)}"
    return None


class KVState:
    """Attention keys and values; positional rollback.

    Cells past the committed length are stale: no mask ever reads them and later windows
    overwrite them, so a window writes its rows straight into the buffer and commit only moves
    the length. Writes go through `write_rows`, which never changes an array another reference
    (a snapshot) still holds.
    """

    def __init__(self):
        self.keys: mx.array | None = None  # (B, H_kv, capacity, D)
        self.values: mx.array | None = None
        self.length = 0
        self._window: tuple[int, int, Mode] | None = None
        # The CPU's host path: numpy copies of the buffers, with the arrays they copy (`_host_buffers`).
        self._host: tuple[mx.array, mx.array, np.ndarray, np.ndarray] | None = None

    @property
    def offset(self) -> int:
        """Absolute position of the open window's first row (its rotary offset)."""
        return self._window[0]

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        assert pos0 == self.length, (pos0, self.length)
        self._window = (pos0, T, mode)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the window's (B, H_kv, T, D) keys and values; return cells 0..pos0+T-1."""
        pos0, T, mode = self._window
        end = pos0 + T
        self._reserve(end, keys)
        self.keys = write_rows(self.keys, keys, pos0, axis=2)
        # One buffer when the layer reads its keys as values too (DeepSeek-V4's shared KV).
        self.values = self.keys if values is keys else write_rows(self.values, values, pos0, axis=2)
        if mode is Mode.PARTIAL:
            self.length = pos0 + 1
        elif mode is Mode.COMMIT_ALL:
            self.length = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def update_and_fetch_host(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`update_and_fetch` for numpy rows (B, H_kv, T, D), float32, as the CPU's host path
        computes: the same cells, from numpy copies of the buffers that the window's rows are
        written into as well (no copy of the committed cells a step), so the call never waits
        for its own write to the buffers, which MLX's stream thread runs meanwhile."""
        pos0 = self._window[0]
        end = pos0 + keys.shape[2]
        host_keys, host_values = self._host_buffers(pos0, end, keys)
        host_keys[:, :, pos0:end] = keys
        host_values[:, :, pos0:end] = values
        self.update_and_fetch(mx.array(keys), mx.array(values))
        mx.async_eval(self.keys, self.values)
        self._host = (self.keys, self.values, host_keys, host_values)
        return host_keys[:, :, :end], host_values[:, :, :end]

    def _host_buffers(self, pos0: int, end: int, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Numpy buffers holding cells 0..pos0-1 with room for `end`: the ones the last host call
        left while the state still holds the arrays it wrote (any other write, a restore or a
        reset replaces them), else the committed cells read back from the arrays once."""
        held = self._host
        valid = held is not None and held[0] is self.keys and held[1] is self.values
        if valid and held[2].shape[2] >= end:
            return held[2], held[3]
        B, H, _, D = like.shape
        capacity = -(-end // KV_STEP) * KV_STEP
        host_keys, host_values = np.empty((B, H, capacity, D), like.dtype), np.empty((B, H, capacity, D), like.dtype)
        if pos0:
            source = held[2:] if valid else (np.asarray(self.keys), np.asarray(self.values))
            host_keys[:, :, :pos0], host_values[:, :, :pos0] = source[0][:, :, :pos0], source[1][:, :, :pos0]
        return host_keys, host_values

    def _reserve(self, end: int, like: mx.array) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end <= capacity:
            return
        B, H, _, D = like.shape
        grown = -(-end // KV_STEP) * KV_STEP
        fresh = mx.zeros((B, H, grown - capacity, D), dtype=like.dtype)
        if self.keys is None:
            self.keys, self.values = fresh, fresh
        else:
            shared = self.values is self.keys
            self.keys = mx.concatenate([self.keys, fresh], axis=2)
            self.values = self.keys if shared else mx.concatenate([self.values, fresh], axis=2)

    def commit(self, keep: int) -> None:
        pos0, T, mode = self._window
        if mode is not Mode.COMMIT_ALL:
            self.length = pos0 + keep
        self._window = None

    def abandon(self) -> None:
        self._window = None  # the cells it wrote lie past the length: stale, overwritten later

    def flush(self) -> None:
        pass

    def snapshot(self) -> tuple:
        return (self.keys, self.values, self.length)

    def restore(self, snap: tuple) -> None:
        self.keys, self.values, self.length = snap
        self._window = None
        if self._host is not None and self._host[0] is not self.keys:
            self._host = None  # copies of other arrays: not held for nothing

    @staticmethod
    def check_snapshot(snap: tuple, like: tuple, length: int) -> str | None:
        """Why `snap` cannot be this state after `length` positions (`like`: `ArraySpec`s of
        one this model made), or None: keys and values (B, H_kv, capacity >= length, D) of the
        model's dtype, both of one shape, and the length slot equal to `length`."""
        if len(snap) != 3:
            return f"{len(snap)} slots, a KV state has 3 (keys, values, length)"
        keys, values, n = snap
        if length == 0 and keys is None and values is None and n == 0:
            return None
        if type(n) is not int or n != length:
            return f"length slot is {slot_kind(n)}, the checkpoint holds {length} positions"
        B, H, _, D = like[0].shape
        text = f"({B}, {H}, N, {D}) with N >= {length}"

        def fits(shape: tuple[int, ...]) -> bool:  # any capacity that holds the committed cells
            return len(shape) == 4 and (shape[0], shape[1], shape[3]) == (B, H, D) and shape[2] >= length

        problem = check_array("keys", keys, like[0], shape_text=text, fits=fits)
        problem = problem or check_array("values", values, like[1], shape_text=text, fits=fits)
        if problem is None and values.shape != keys.shape:
            problem = (f"values have shape {format_shape(values.shape)}, keys {format_shape(keys.shape)}: "
                       "they must match")
        return problem

    def tensors(self) -> dict[str, mx.array]:
        if self.keys is None:
            return {}
        return {
            "keys": self.keys[..., : self.length, :],
            "values": self.values[..., : self.length, :],
        }


class LatentKVState(KVState):
    """Multi-head latent attention's cache (DeepSeek-V3, Kimi): one array of cells, each the
    normalised KV latent and the rotated shared key side by side (B, 1, capacity, r + d_rope).

    Positional rollback, as `KVState`: a window writes its rows into the cells past the committed
    length and commit moves the length. There are no separate values (they are the latent, read
    back through the layer's own projections), so the values slot stays empty.
    """

    def update_and_fetch(self, cells: mx.array, values: None = None) -> tuple[mx.array, None]:
        """Write the window's (B, 1, T, W) cells; return cells 0..pos0+T-1 (and no values)."""
        pos0, T, mode = self._window
        end = pos0 + T
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end > capacity:
            B, H, _, W = cells.shape
            fresh = mx.zeros((B, H, -(-end // KV_STEP) * KV_STEP - capacity, W), dtype=cells.dtype)
            self.keys = fresh if self.keys is None else mx.concatenate([self.keys, fresh], axis=2)
        self.keys = write_rows(self.keys, cells, pos0, axis=2)
        if mode is Mode.PARTIAL:
            self.length = pos0 + 1
        elif mode is Mode.COMMIT_ALL:
            self.length = end
        return self.keys[..., :end, :], None

    @staticmethod
    def check_snapshot(snap: tuple, like: tuple, length: int) -> str | None:
        """Why `snap` cannot be this state after `length` positions, or None: cells
        (B, 1, capacity >= length, W) of the model's dtype, an empty values slot, the length."""
        if len(snap) != 3:
            return f"{len(snap)} slots, a latent KV state has 3 (cells, empty, length)"
        cells, values, n = snap
        if length == 0 and cells is None and values is None and n == 0:
            return None
        if type(n) is not int or n != length:
            return f"length slot is {slot_kind(n)}, the checkpoint holds {length} positions"
        if values is not None:
            return f"values slot is {slot_kind(values)}, a latent KV state keeps none"
        B, H, _, W = like[0].shape

        def fits(shape: tuple[int, ...]) -> bool:
            return len(shape) == 4 and (shape[0], shape[1], shape[3]) == (B, H, W) and shape[2] >= length

        return check_array("cells", cells, like[0], shape_text=f"({B}, {H}, N, {W}) with N >= {length}", fits=fits)

    def tensors(self) -> dict[str, mx.array]:
        if self.keys is None:
            return {}
        return {"latent": self.keys[..., : self.length, :]}


class GDNState:
    """Gated-delta-rule recurrent state `S` and the causal conv's input history.

    A window computes its rows from the committed state without changing it and keeps each
    row's recurrence inputs. `commit(keep)` folds only the kept rows into `S`: at once (eager),
    or by recording them and prepending the fold to the next window's scan (lazy). When every
    row is kept the run's own final state is the fold, so nothing is recomputed.
    The conv history is the last K-1 raw conv inputs; updating it is a slice, so commit always
    does it at once.
    """

    def __init__(self, conv_kernel: int, *, lazy: bool):
        self.num_history = conv_kernel - 1
        self.is_lazy = lazy
        self.S: mx.array | None = None  # (B, Hv, Dk, Dv), float32
        self.history: mx.array | None = None  # (B, K-1, C) raw conv inputs
        self.pending: GDNRows | None = None  # kept rows not yet folded into S (lazy)
        self._scan: Scan | None = None
        self._pending_scan: Scan | None = None  # the scan of the window `pending` came from
        self._window: tuple[int, int, Mode] | None = None
        self._joined: mx.array | None = None  # (B, K-1+T, C): history then the window's raw inputs
        self._joined_host: np.ndarray | None = None  # the same, where `conv_window_host` made it
        self._rows: GDNRows | None = None
        self._final: mx.array | None = None

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        self._window = (pos0, T, mode)

    def conv_window(self, raw: mx.array) -> mx.array:
        """Prepend the committed history to the window's raw conv inputs (B, T, C)."""
        return self.take_window(mx.concatenate([self.conv_history(raw), raw], axis=1))

    def conv_history(self, raw: mx.array) -> mx.array:
        """The committed history (B, K-1, C) before the window's raw conv inputs `raw` (B, T, C),
        for a kernel that joins them itself (`take_window` then takes its join)."""
        B, _, C = raw.shape
        if self.history is None:
            self.history = mx.zeros((B, self.num_history, C), dtype=raw.dtype)
        return self.history

    def take_window(self, joined: mx.array) -> mx.array:
        """This window's history and raw conv inputs joined, (B, K-1+T, C): kept for the history
        a commit leaves."""
        self._joined, self._joined_host = joined, None
        self._slide_history(joined.shape[1] - self.num_history)
        return joined

    def conv_window_host(self, raw: np.ndarray) -> np.ndarray:
        """`conv_window` for numpy rows (B, T, C), float32, as the CPU's host path computes: the
        same cells, joined in numpy; the history kept as arrays made from them, so that reading it
        back never waits on MLX's stream thread."""
        B, T, C = raw.shape
        if self.history is None:
            self.history = mx.array(np.zeros((B, self.num_history, C), dtype=raw.dtype))
        self._joined, self._joined_host = None, np.concatenate([np.asarray(self.history), raw], axis=1)
        self._slide_history(T)
        return self._joined_host

    def _slide_history(self, T: int) -> None:
        mode = self._window[2]
        if mode is Mode.COMMIT_ALL:
            self.history = self._history_after(T)
        elif mode is Mode.PARTIAL:
            self.history = self._history_after(1)

    def _history_after(self, n: int) -> mx.array:
        # The K-1 inputs before row n of the window: one slice of the joined window (one op;
        # concatenating history and kept rows again would be three), or a copy of the host's.
        if self._joined_host is not None:
            return mx.array(self._joined_host[:, n : n + self.num_history])
        return self._joined[:, n : n + self.num_history]

    def recur(self, rows: GDNRows, scan: Scan) -> mx.array:
        """Run the recurrence over the window's rows from committed state; returns outputs."""
        self._scan = scan
        S = self._start_state(rows)
        mode = self._window[2]
        if mode is Mode.COMMIT_ALL:
            y, self.S = scan(rows, S)
            return y
        if mode is Mode.PARTIAL:
            y0, self.S = scan(rows.rows(0, 1), S)
            if len(rows) == 1:
                self._rows, self._final = rows, self.S
                return y0
            y1, self._final = scan(rows.rows(1, len(rows)), self.S)
            self._rows = rows
            return mx.concatenate([y0, y1], axis=1)
        y, self._final = scan(rows, S)
        self._rows = rows
        return y

    def _start_state(self, rows: GDNRows) -> mx.array:
        if self.S is None:
            B, _, Hv, Dv = rows.v.shape
            self.S = mx.zeros((B, Hv, rows.k.shape[-1], Dv), dtype=mx.float32)
        self.flush()  # the lazy fold joins this window's graph
        return self.S

    def commit(self, keep: int) -> None:
        pos0, T, mode = self._window
        self._window = None
        if mode is Mode.COMMIT_ALL:
            return
        self.history = self._history_after(keep)
        start = 1 if mode is Mode.PARTIAL else 0
        if keep == T:
            self.S = self._final
        elif keep > start:
            kept = self._rows.rows(start, keep)
            if self.is_lazy:
                self.pending, self._pending_scan = kept, self._scan  # folded as the window ran them
            else:
                _, self.S = self._scan(kept, self.S)
        self._rows = self._final = self._joined = self._joined_host = None

    def abandon(self) -> None:
        self._window = None
        self._rows = self._final = self._joined = self._joined_host = None

    def flush(self) -> None:
        if self.pending is not None:
            _, self.S = self._pending_scan(self.pending, self.S)
            self.pending = self._pending_scan = None

    def snapshot(self) -> tuple:
        self.flush()
        return (self.S, self.history)

    def restore(self, snap: tuple) -> None:
        self.S, self.history = snap
        self.pending = None
        self._window = None

    KIND, STATE_NAME = "GDN", "recurrent state"  # how check_snapshot's messages name them

    @classmethod
    def check_snapshot(cls, snap: tuple, like: tuple, length: int) -> str | None:
        """Why `snap` cannot be this state after `length` positions (`like`: `ArraySpec`s of
        one this model made), or None: `S` and the conv history exactly as the model shapes
        them (S in float32, the history in the model's dtype)."""
        if len(snap) != 2:
            return f"{len(snap)} slots, a {cls.KIND} state has 2 ({cls.STATE_NAME}, conv history)"
        if length == 0 and snap[0] is None and snap[1] is None:
            return None
        return (check_array(cls.STATE_NAME, snap[0], like[0])
                or check_array("conv history", snap[1], like[1]))

    def tensors(self) -> dict[str, mx.array]:
        self.flush()
        if self.S is None:
            return {}
        return {"recurrent": self.S, "conv_history": self.history}


class Mamba2State(GDNState):
    """Mamba-2 (SSD) recurrent state `S` and the causal conv's input history.

    The GDN rule exactly (`GDNState`): a window runs its rows from the committed state without
    changing it and keeps each row's recurrence inputs (`SSMRows`: x, B, C, dt and the log-decay
    g = dt·A); commit folds only the kept rows into `S`, eagerly or lazily (the next window's
    scan starts with the fold, always with the scan of the window the rows came from), and
    partial mode commits the root row inside the run. The history is the last K-1 raw conv
    inputs (x, B, C before the conv), updated at commit by a slice. Only the rows and the shape
    of `S` differ, so only those are here.
    """

    KIND, STATE_NAME = "Mamba-2", "SSM state"

    def __init__(self, conv_kernel: int, *, lazy: bool):
        super().__init__(conv_kernel, lazy=lazy)
        self.S: mx.array | None = None  # (B, H, P, N), float32

    def _start_state(self, rows: SSMRows) -> mx.array:
        if self.S is None:
            B, _, H, P = rows.x.shape
            self.S = mx.zeros((B, H, P, rows.B.shape[-1]), dtype=mx.float32)
        self.flush()  # the lazy fold joins this window's graph
        return self.S
