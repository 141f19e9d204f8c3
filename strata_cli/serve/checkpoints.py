"""Committed-state checkpoints keyed by the token prefix they hold, for prefix reuse.

A checkpoint is the engine's committed state after exactly `tokens` (a `WindowEngine.snapshot()`:
references to immutable MLX arrays, with pending lazy folds flushed). A request whose prompt
starts with a checkpoint's tokens restores it and prefills only the rest. The GDN recurrent
state cannot be rewound, so only a checkpoint whose tokens are a whole prefix of the prompt is
usable; where prompts diverge is learned from the checkpoints already held (see `plan`).

Plain Python and numpy: the snapshots are opaque here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Checkpoint:
    """The engine's committed state after processing exactly `tokens`."""

    tokens: tuple[int, ...]
    snapshot: Any  # engine.window.Snapshot, with snapshot.length == len(tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class CheckpointRing:
    """A bounded set of checkpoints, least recently used out first.

    Args:
        max_entries: most checkpoints held (at least 1).
        max_positions: most positions all checkpoints together hold; KV memory grows with it.
            A checkpoint longer than this is not kept.
    """

    def __init__(self, max_entries: int, max_positions: int):
        if max_entries < 1 or max_positions < 1:
            raise ValueError(f"max_entries ({max_entries}) and max_positions ({max_positions}) must be >= 1")
        self.max_entries = max_entries
        self.max_positions = max_positions
        self._entries: OrderedDict[tuple[int, ...], tuple[Checkpoint, np.ndarray]] = OrderedDict()
        self.positions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return (checkpoint for checkpoint, _ in self._entries.values())

    def add(self, tokens: Sequence[int], snapshot: Any) -> Checkpoint | None:
        """Keep the state after `tokens` (an existing entry for the same tokens is only touched).

        Returns:
            The checkpoint held, or None when it is longer than `max_positions`.
        """
        key = tuple(int(t) for t in tokens)
        if snapshot.length != len(key):
            raise ValueError(f"a snapshot of {snapshot.length} positions cannot key {len(key)} tokens")
        if not key or len(key) > self.max_positions:
            return None
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        checkpoint = Checkpoint(key, snapshot)
        self._entries[key] = (checkpoint, np.asarray(key, dtype=np.int64))
        self.positions += len(key)
        while len(self._entries) > self.max_entries or self.positions > self.max_positions:
            old, _ = self._entries.popitem(last=False)
            self.positions -= len(old)
        return checkpoint

    def longest_prefix(self, tokens: Sequence[int], *, max_length: int) -> Checkpoint | None:
        """The longest checkpoint whose tokens are a prefix of `tokens`, at most `max_length` long.

        A hit becomes the most recently used entry.
        """
        ids = np.asarray(tokens, dtype=np.int64)
        best = None
        for key, (checkpoint, key_ids) in self._entries.items():
            n = len(key)
            if n <= max_length and n <= len(ids) and (best is None or n > best.length):
                if common_prefix(key_ids, ids) == n:
                    best = checkpoint
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best

    def longest_common_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` some checkpoint shares (0 for none): where `tokens` diverge."""
        ids = np.asarray(tokens, dtype=np.int64)
        return max((common_prefix(key_ids, ids) for _, key_ids in self._entries.values()), default=0)


def plan(start: int, end: int, *, every: int, divergence: int = 0) -> list[int]:
    """Positions to checkpoint while prefilling from `start` to `end` (both committed lengths).

    Args:
        start: committed length restored (or 0).
        end: committed length the prefill reaches (the prompt minus its root); always planned.
        every: also plan every multiple of this in (start, end) (0 = none).
        divergence: where the prompt leaves every held checkpoint's tokens; planned when inside
            (start, end), so the next prompt that shares this prefix resumes exactly there.

    Returns:
        Increasing positions in (start, end], ending with `end`; empty when end <= start.
    """
    if end <= start:
        return []
    points = {end}
    if every > 0:
        points.update(range((start // every + 1) * every, end, every))
    if start < divergence < end:
        points.add(divergence)
    return sorted(points)
