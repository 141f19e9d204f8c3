"""Acceptance rules for a verified window. Plain Python: no MLX import.

Greedy (temperature 0): with inputs [root, d1..dD] and the model's greedy outputs out[0..D],
draft d(i+1) is accepted while out[i] == d(i+1). keep = 1 + (accepted drafts); the window emits
out[0..keep-1], and out[keep-1] is the next root. When every draft matched, out[D] is the bonus
token. This emits exactly the tokens serial greedy decoding would, one window at a time.

Sampling (temperature > 0), with a deterministic draft: the rule is speculative sampling's —
accept d(i+1) with probability p_i(d(i+1)) under row i's processed distribution; at the first
rejection emit a draw from the residual (p_i with d(i+1) removed, renormalised); when every
draft is accepted, emit a draw from the last row. strata realises it by coupling: out[i] is the
row's own draw x_i ~ p_i (sampling.py, keyed by position) and the same `greedy_keep` accepts
while x_i == d(i+1). Then P(accept) = p_i(d(i+1)) exactly, and given a rejection x_i is
distributed as the residual (x_i != d(i+1)), so each emitted token has serial sampling's
distribution; and because the draw of a position does not depend on the draft, a seeded run
emits the same tokens as serial sampling with the same seed. `residual` states the rule on plain
probabilities (the tests check the coupling against it).
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


def residual(probs: Sequence[float], draft: int) -> list[float]:
    """The distribution a rejection of `draft` samples from: probs with `draft` removed,
    renormalised (all zero when the draft had probability 1, which is never rejected)."""
    rest = 1.0 - probs[draft]
    return [0.0 if t == draft or rest <= 0 else p / rest for t, p in enumerate(probs)]


def expected_keep_probs(draft_probs: Sequence[float], keep: int) -> list[float]:
    """Acceptance inputs for the controller when sampling: p_i(d(i+1)) of the drafts that were
    judged (1..keep, at most the window's drafts), instead of 0/1 outcomes."""
    return list(draft_probs[: min(keep, len(draft_probs))])


def stop_at_eos(emitted: Sequence[int], eos_ids: Collection[int]) -> int | None:
    """Index of the first end-of-sequence token among emitted outputs, or None."""
    for i, token in enumerate(emitted):
        if token in eos_ids:
            return i
    return None
