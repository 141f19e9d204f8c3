"""The reference report's structural experiment ("qsa: real rollback defect"), rebuilt: a scalar-key
model of a rate-4 compressor tail, every (pos0, T, keep) case enumerated.

A case: cells 0..pos0-1 are committed serially; a window writes cells pos0..pos0+T-1 (rows from
`keep` on carry wrong keys, as rejected drafts do); commit keeps `keep` rows; serial writing then
continues with the true keys well past the window. The case passes when every block key pooled
(and not discarded as dead) equals serial decoding's. pos0 runs over 0..63 (16 of each pos0 % 4),
T over 1..8 and keep over 1..T: 2,304 cases, of which 320 satisfy the cap T <= 4 - pos0 % 4.

- the naive tail (slot `cell % 4`, pooled when `cell % 4 == 3`, never restored) fails 736 cases
  and passes all 320 capped ones: the report's counts exactly;
- the exact rollback (snapshot the tail before the window, restore it at commit and replay only
  the kept rows) passes all 2,304;
- the same for DeepSeek-V4's overlapping pair (a block key pools the previous block's first
  series and its own second series: an 8-slot ring), where the naive ring fails too and the cap
  and the exact rollback pass every case.
"""

import pytest

RATE = 4
POSITIONS = range(64)
MAX_T = 8
HORIZON = 3 * RATE * 2  # serial writing continues this far past the window: every block it touched closes


def truth(cell):
    return ("true", cell)


def wrong(cell):
    return ("wrong", cell)


class Tail:
    """Raw keys in a ring of `blocks * RATE` slots; a block key pools the last `blocks` blocks'
    slots when a block's last cell is written (blocks=1: the report's QSA tail; blocks=2: V4's
    overlapping pair)."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.slots = [None] * (blocks * RATE)
        self.pooled = {}

    def write(self, cell, key):
        self.slots[cell % len(self.slots)] = key
        if cell % RATE == RATE - 1:
            first = cell - len(self.slots) + 1
            self.pooled[cell // RATE] = tuple(
                self.slots[c % len(self.slots)] if c >= 0 else None for c in range(first, cell + 1))


def serial_blocks(blocks: int, end: int) -> dict:
    tail = Tail(blocks)
    for cell in range(end):
        tail.write(cell, truth(cell))
    return tail.pooled


def window_case(pos0: int, T: int, keep: int, *, blocks: int, exact: bool) -> bool:
    """Whether the pooled block keys equal serial decoding's after this window and the serial
    continuation."""
    tail = Tail(blocks)
    for cell in range(pos0):
        tail.write(cell, truth(cell))
    snapshot = list(tail.slots)
    for i in range(T):
        tail.write(pos0 + i, truth(pos0 + i) if i < keep else wrong(pos0 + i))
    length = pos0 + keep
    for block in [b for b in tail.pooled if b >= length // RATE]:  # blocks not complete: dead
        del tail.pooled[block]
    if exact:  # restore the snapshot, replay only the kept rows
        tail.slots = snapshot
        for cell in range(pos0, length):
            tail.write(cell, truth(cell))
    end = pos0 + T + HORIZON
    for cell in range(length, end):
        tail.write(cell, truth(cell))
    return tail.pooled == serial_blocks(blocks, end)


def enumerate_cases(*, blocks: int, exact: bool) -> dict:
    counts = {"cases": 0, "failing": 0, "capped": 0, "capped_passing": 0}
    for pos0 in POSITIONS:
        for T in range(1, MAX_T + 1):
            for keep in range(1, T + 1):
                ok = window_case(pos0, T, keep, blocks=blocks, exact=exact)
                counts["cases"] += 1
                counts["failing"] += not ok
                if T <= RATE - pos0 % RATE:  # safe_window's block cap
                    counts["capped"] += 1
                    counts["capped_passing"] += ok
    return counts


def test_naive_tail_reproduces_the_report_counts():
    counts = enumerate_cases(blocks=1, exact=False)
    assert counts == {"cases": 2304, "failing": 736, "capped": 320, "capped_passing": 320}


def test_exact_rollback_passes_every_case():
    assert enumerate_cases(blocks=1, exact=True)["failing"] == 0


@pytest.mark.parametrize("exact", [False, True], ids=["naive", "exact"])
def test_overlapping_pair_of_v4(exact):
    counts = enumerate_cases(blocks=2, exact=exact)
    assert counts["capped"] == counts["capped_passing"] == 320
    if exact:
        assert counts["failing"] == 0
    else:
        assert counts["failing"] > 0


def test_the_report_counterexample():
    """Committed cells end at 4, pos0 = 5, T = 4 (cells 5..8), keep 1: cell 8 overwrote cell 4's slot."""
    assert not window_case(5, 4, 1, blocks=1, exact=False)
    assert window_case(5, 4, 1, blocks=1, exact=True)
