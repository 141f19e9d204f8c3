"""Acceptance rules for a verified window. Plain Python: no MLX import.

Greedy (temperature 0): with inputs [root, d1..dD] and the model's greedy outputs out[0..D],
draft d(i+1) is accepted while out[i] == d(i+1). keep = 1 + (accepted drafts); the window emits
out[0..keep-1], and out[keep-1] is the next root. When every draft matched, out[D] is the bonus
token. This emits exactly the tokens serial greedy decoding would, one window at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def greedy_keep(inputs: Sequence[int], outputs: Sequence[int]) -> int:
    """Inputs to commit: the root plus the drafts that match the previous row's output."""
    if len(outputs) != len(inputs) or not inputs:
        raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
    keep = 1
    while keep < len(inputs) and outputs[keep - 1] == inputs[keep]:
        keep += 1
    return keep


def stop_at_eos(emitted: Sequence[int], eos_ids: Collection[int]) -> int | None:
    """Index of the first end-of-sequence token among emitted outputs, or None."""
    for i, token in enumerate(emitted):
        if token in eos_ids:
            return i
    return None
