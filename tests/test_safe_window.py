"""Tests for the safe-window helper (plain Python, no MLX)."""

import ast
import itertools
from pathlib import Path

import pytest

from strata_cli.speculative import safe_window as safe_window_module
from strata_cli.speculative.safe_window import QSA_BLOCK, safe_window

GRID = list(
    itertools.product(
        range(0, 9),  # num_drafts
        range(-2, 11),  # remaining_tokens
        range(-2, 11),  # context_left
        range(0, 12),  # pos0
        (False, True),  # block_cap
    )
)


def spelled_out(num_drafts, remaining_tokens, context_left, pos0, block_cap):
    if remaining_tokens <= 0 or context_left <= 0:
        return 0
    bounds = [1 + num_drafts, remaining_tokens, context_left]
    if block_cap:
        bounds.append(4 - pos0 % 4)
    return min(bounds)


def call(num_drafts, remaining_tokens, context_left, pos0, block_cap):
    return safe_window(
        num_drafts=num_drafts,
        remaining_tokens=remaining_tokens,
        context_left=context_left,
        pos0=pos0,
        block_cap=block_cap,
    )


def test_block_constant():
    assert QSA_BLOCK == 4


def test_matches_spelled_out_rule_on_grid():
    for args in GRID:
        assert call(*args) == spelled_out(*args), args


def test_each_bound_holds_and_is_tight():
    for num_drafts, remaining, context_left, pos0, block_cap in GRID:
        size = call(num_drafts, remaining, context_left, pos0, block_cap)
        if remaining <= 0 or context_left <= 0:
            assert size == 0
            continue
        assert 0 < size <= 1 + num_drafts
        assert size <= remaining and size <= context_left
        ends_in_block = pos0 // 4 == (pos0 + size - 1) // 4
        if block_cap:
            assert ends_in_block
        # Maximal: one more row would break some bound.
        bigger = size + 1
        assert (
            bigger > 1 + num_drafts
            or bigger > remaining
            or bigger > context_left
            or (block_cap and pos0 // 4 != (pos0 + bigger - 1) // 4)
        )


def test_without_block_cap_windows_may_cross_blocks():
    crossing = [
        args
        for args in GRID
        if not args[4] and call(*args) > 0 and args[3] // 4 != (args[3] + call(*args) - 1) // 4
    ]
    assert crossing
    assert call(num_drafts=7, remaining_tokens=10, context_left=10, pos0=3, block_cap=False) == 8


@pytest.mark.parametrize("pos0, cap", [(0, 4), (1, 3), (2, 2), (3, 1), (4, 4), (5, 3), (7, 1), (8, 4)])
def test_block_cap_by_position(pos0, cap):
    assert call(8, 100, 100, pos0, True) == cap
    assert call(8, 100, 100, pos0, False) == 9


def test_report_counterexample_is_refused():
    # The reference report's case: committed cells end at 4, pos0=5, T=4 would
    # write cell 8 over the tail slot of committed cell 4.
    assert call(3, 10, 10, 5, True) == 3


def test_zero_drafts_runs_root_only():
    assert call(0, 10, 10, 2, True) == 1
    assert call(0, 10, 10, 2, False) == 1


@pytest.mark.parametrize("remaining, context_left", [(0, 5), (5, 0), (-1, 5), (5, -3), (0, 0)])
def test_nothing_can_run(remaining, context_left):
    assert call(3, remaining, context_left, 0, True) == 0
    assert call(3, remaining, context_left, 0, False) == 0


def test_negative_num_drafts_raises():
    with pytest.raises(ValueError, match=r"num_drafts \(-1\)"):
        call(-1, 10, 10, 0, False)


def test_negative_pos0_raises():
    with pytest.raises(ValueError, match=r"pos0 \(-2\)"):
        call(2, 10, 10, -2, True)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        safe_window(2, 10, 10, 0, True)


def test_no_mlx_or_numpy_import():
    tree = ast.parse(Path(safe_window_module.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"mlx", "numpy"}


# -- a scalar model of the QSA indexer tail ---------------------------------


def pools_after_rejection(pos0, size, keep, *, until):
    """Block pools after a window of `size` rows at `pos0` keeps `keep` rows.

    A structural model of the indexer tail (after the reference report): cell c
    writes its raw key to slot c % 4, and writing cell c % 4 == 3 pools the four
    slots into the block key. Kept rows write the serial key ("ok", c); rejected
    rows write ("bad", c). Decoding then continues serially up to `until`.
    """
    tail = {c % 4: ("ok", c) for c in range(pos0 - pos0 % 4, pos0)}  # committed, incomplete block
    pools = {}

    def write(cell, key):
        tail[cell % 4] = key
        if cell % 4 == 3:
            pools[cell // 4] = tuple(tail.get(s) for s in range(4))

    for i in range(size):
        write(pos0 + i, ("ok" if i < keep else "bad", pos0 + i))
    for cell in range(pos0 + keep, until):
        write(cell, ("ok", cell))
    return {b: key for b, key in pools.items() if 4 * b + 3 < until}


def serial_pool(block):
    return tuple(("ok", c) for c in range(4 * block, 4 * block + 4))


def test_capped_windows_keep_the_indexer_tail_exact():
    num_failed = num_checked = 0
    for pos0 in range(4, 16):
        for size in range(1, 9):
            for keep in range(1, size + 1):
                pools = pools_after_rejection(pos0, size, keep, until=pos0 + 12)
                exact = all(key == serial_pool(b) for b, key in pools.items())
                is_safe = size <= call(8, 100, 100, pos0, True)
                num_checked += 1
                if is_safe:
                    assert exact, (pos0, size, keep)
                num_failed += not exact
    # Uncapped windows do corrupt the tail: the cap is needed, not just cautious.
    assert num_failed > 0 and num_checked > num_failed
    assert pools_after_rejection(5, 4, 1, until=8)[1][0] == ("bad", 8)
