"""What a model layer asks of its per-layer state: the protocol below the model code.

The layers never own state. The caller (the window engine, engine/state.py) passes one state
object per layer into every forward call, and decides which rows reach committed state and how
they roll back (docs/design.md, "State and its rollback rule"). This module only says what a
layer may call, so `model/` needs nothing from the engine — as mlx-lm's `models/cache.py` sits
below its models. GDN layers (`RecurrentState`) and Mamba-2 layers (`SSMState`) make the same two
calls, each with its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import mlx.core as mx
import numpy as np


class AttentionState(Protocol):
    """Keys and values of an attention layer."""

    @property
    def offset(self) -> int:
        """Absolute position of the window's first row (its rotary offset)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the window's (B, H_kv, T, D) keys and values; return every cell up to its end."""

    def update_and_fetch_host(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`update_and_fetch` for numpy rows (the CPU's host path): the same cells, in numpy."""


class SlidingAttentionState(Protocol):
    """Keys and values of a sliding-window attention layer (engine/sliding_state.py)."""

    @property
    def offset(self) -> int:
        """Absolute position of the window's first row (its rotary offset)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Write the window's (B, H_kv, T, D) keys and values; return the cells its rows attend
        over (B, H_kv, L, D) and a (T, L) bool mask of the cells each row sees."""


class LatentState(Protocol):
    """The compressed cells of a multi-head latent attention layer (DeepSeek-V3, Kimi)."""

    @property
    def offset(self) -> int:
        """Absolute position of the window's first row (its rotary offset)."""

    def update_and_fetch(self, cells: mx.array) -> tuple[mx.array, None]:
        """Write the window's (B, 1, T, W) cells; return every cell up to its end (and None)."""


@dataclass(frozen=True)
class GDNRows:
    """Per-row inputs of the gated-delta recurrence, after the causal conv.

    Shapes: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv).
    """

    q: mx.array
    k: mx.array
    v: mx.array
    g: mx.array
    beta: mx.array

    def __len__(self) -> int:
        return self.q.shape[1]

    def rows(self, start: int, stop: int) -> "GDNRows":
        return GDNRows(*(a[:, start:stop] for a in (self.q, self.k, self.v, self.g, self.beta)))


# scan(rows, state) -> (outputs (B, T, Hv, Dv), state after the last row)
Scan = Callable[[GDNRows, mx.array], tuple[mx.array, mx.array]]


class RecurrentState(Protocol):
    """The causal conv's input history and the gated-delta recurrent state of a GDN layer."""

    def conv_window(self, raw: mx.array) -> mx.array:
        """Prepend the committed history to the window's raw conv inputs (B, T, C)."""

    def conv_history(self, raw: mx.array) -> mx.array:
        """The committed history (B, K-1, C), for a kernel that joins it to `raw` itself."""

    def take_window(self, joined: mx.array) -> mx.array:
        """The window such a kernel joined, (B, K-1+T, C), kept as `conv_window` keeps its own."""

    def conv_window_host(self, raw: np.ndarray) -> np.ndarray:
        """`conv_window` for numpy rows (the CPU's host path): the same cells, in numpy."""

    def recur(self, rows: GDNRows, scan: Scan) -> mx.array:
        """Run `scan` over the window's rows from committed state; return the outputs."""


@dataclass(frozen=True)
class SSMRows:
    """Per-row inputs of the Mamba-2 (SSD) recurrence, after the causal conv, in float32.

    Shapes: x (B, T, H, P); B, C (B, T, G, N) (each group serves H/G consecutive heads);
    dt (B, T, H) after softplus and the limits; g = dt·A (B, T, H), the log of each row's decay.
    """

    x: mx.array
    B: mx.array
    C: mx.array
    dt: mx.array
    g: mx.array

    def __len__(self) -> int:
        return self.x.shape[1]

    def rows(self, start: int, stop: int) -> "SSMRows":
        return SSMRows(*(a[:, start:stop] for a in (self.x, self.B, self.C, self.dt, self.g)))


# scan(rows, state) -> (outputs (B, T, H, P), state (B, H, P, N) after the last row)
SSMScan = Callable[[SSMRows, mx.array], tuple[mx.array, mx.array]]


class SSMState(Protocol):
    """The causal conv's input history and the recurrent state of a Mamba-2 layer."""

    def conv_window(self, raw: mx.array) -> mx.array:
        """Prepend the committed history to the window's raw conv inputs (B, T, C)."""

    def recur(self, rows: SSMRows, scan: SSMScan) -> mx.array:
        """Run `scan` over the window's rows from committed state; return the outputs."""


# pool(kv, gate, has_prev, first) -> entries (B, m, D): kv, gate (B, (m + has_prev) * rate, W) are
# the raw rows of m closed compressor windows, preceded by the window before them when has_prev;
# `first` is the index of the first entry made (its window starts at position first * rate).
Pool = Callable[[mx.array, mx.array, bool, int], mx.array]


class CompressorState(Protocol):
    """A compressor's tail (DeepSeek-V4 CSA/HCA, and the lightning indexer's own compressor)."""

    def compress(self, kv: mx.array, gate: mx.array, pool: Pool) -> mx.array | None:
        """Add the window's raw rows (B, T, W); return every compressed entry closed so far,
        those the window's rows close included (B, n, D), or None while there is none."""


class CompressedAttentionState(AttentionState, Protocol):
    """A DeepSeek-V4 attention layer: positional sliding-window keys (`update_and_fetch`), and
    on compressed layers `compressor` (and on CSA layers `indexer`) tails."""

    compressor: CompressorState | None
    indexer: CompressorState | None
