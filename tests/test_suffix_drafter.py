"""Tests for the model-free suffix drafter (plain Python, no MLX)."""

import ast
import dataclasses
import random
from pathlib import Path

import pytest

from strata_cli.speculative import suffix_drafter
from strata_cli.speculative.suffix_drafter import (
    DEFAULT_MIN_MATCH,
    MAX_MATCH,
    POSITIONS_PER_TRIGRAM,
    Proposal,
    SuffixDrafter,
)

EMPTY = Proposal(tokens=(), match_length=0, position=-1)


def reference_best(history, *, max_positions=POSITIONS_PER_TRIGRAM, max_match=MAX_MATCH):
    """O(n^2) reference: (match_length, position) of the best candidate, or (0, -1).

    Scans every earlier end position of the last trigram that has a continuation
    token, keeps the `max_positions` most recent, extends each match backwards up
    to `max_match`, and picks the longest, then the most recent.
    """
    n = len(history)
    if n < 3:
        return 0, -1
    last = tuple(history[n - 3 :])
    ends = [p for p in range(2, n - 1) if tuple(history[p - 2 : p + 1]) == last]
    best = (0, -1)
    for p in ends[-max_positions:]:
        length = 0
        while length < max_match and p - length >= 0 and history[p - length] == history[n - 1 - length]:
            length += 1
        best = max(best, (length, p))  # tuple order: longest, then largest p
    return best


def reference_propose(history, max_drafts, min_match, **kwargs):
    length, p = reference_best(history, **kwargs)
    if max_drafts == 0 or length < min_match:
        return EMPTY
    return Proposal(tokens=tuple(history[p + 1 : p + 1 + max_drafts]), match_length=length, position=p)


# -- construction and basics -------------------------------------------------


def test_defaults_and_constants():
    assert (DEFAULT_MIN_MATCH, POSITIONS_PER_TRIGRAM, MAX_MATCH) == (4, 4, 64)
    d = SuffixDrafter()
    assert d.min_match == DEFAULT_MIN_MATCH
    assert d.max_positions == POSITIONS_PER_TRIGRAM
    assert len(d) == 0 and d.history == ()
    with pytest.raises(AttributeError):
        d.max_positions = 8  # the index was built with the old value


def test_history_len_and_generator_input():
    d = SuffixDrafter(iter([3, 1, 4]))
    d.append(1)
    d.extend(x for x in [5, 9])
    assert len(d) == 6
    assert d.history == (3, 1, 4, 1, 5, 9)
    assert isinstance(d.history, tuple)


@pytest.mark.parametrize("min_match", [-1, 0, 1, 2, MAX_MATCH + 1])
def test_min_match_out_of_range_raises(min_match):
    with pytest.raises(ValueError, match=rf"min_match \({min_match}\)"):
        SuffixDrafter(min_match=min_match)


@pytest.mark.parametrize("min_match", [3, MAX_MATCH])
def test_min_match_bounds_accepted(min_match):
    assert SuffixDrafter(min_match=min_match).min_match == min_match


def test_max_positions_zero_raises():
    with pytest.raises(ValueError, match=r"max_positions \(0\)"):
        SuffixDrafter(max_positions=0)


def test_min_match_is_keyword_only():
    with pytest.raises(TypeError):
        SuffixDrafter((), 3)


def test_proposal_is_frozen():
    p = SuffixDrafter([1, 2, 3, 4, 9, 1, 2, 3, 4]).propose(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tokens = ()


def test_no_mlx_or_numpy_import():
    # The house rule: drafting stays plain Python.
    tree = ast.parse(Path(suffix_drafter.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"mlx", "numpy"}


# -- short histories ---------------------------------------------------------


@pytest.mark.parametrize("tokens", [[], [7], [7, 7], [7, 7, 7], [1, 2], [1, 2, 3]])
@pytest.mark.parametrize("min_match", [3, 4])
def test_short_history_is_empty(tokens, min_match):
    assert SuffixDrafter(tokens, min_match=min_match).propose(4) == EMPTY


def test_four_equal_tokens_is_the_shortest_proposal():
    # "a a a a": the trigram ending at 2 has one continuation token; match of 3.
    assert SuffixDrafter([7] * 4, min_match=3).propose(4) == Proposal((7,), 3, 2)
    assert SuffixDrafter([7] * 4, min_match=4).propose(4) == EMPTY


# -- basic matches -----------------------------------------------------------


def test_basic_repeat():
    d = SuffixDrafter([1, 2, 3, 4, 5, 6, 1, 2, 3, 4])
    assert d.propose(2) == Proposal((5, 6), 4, 3)
    # The continuation may run into the current suffix.
    assert d.propose(10) == Proposal((5, 6, 1, 2, 3, 4), 4, 3)
    assert d.propose(1) == Proposal((5,), 4, 3)


def test_basic_repeat_stops_at_first_mismatch():
    d = SuffixDrafter([9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4])
    assert d.propose(3) == Proposal((5, 6, 8), 4, 4)


def test_proposal_tracks_appends():
    d = SuffixDrafter([1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert d.propose(3) == EMPTY  # match "1 2 3" is 3 < 4
    d.append(4)
    assert d.propose(3) == Proposal((5, 6, 1), 4, 3)
    d.append(5)
    assert d.propose(3) == Proposal((6, 1, 2), 5, 4)
    d.append(7)  # diverges from the past
    assert d.propose(3) == EMPTY


def match_of(length):
    """History whose best (only) candidate matches exactly `length` tokens.

    Layout: 50, c1..cL, 100, 60, c1..cL. The token before each copy differs
    (50 vs 60), so the backward extension stops at `length`. For length < 3
    there is no trigram candidate at all.
    """
    common = list(range(1, length + 1))
    return [50] + common + [100, 60] + common


@pytest.mark.parametrize("min_match", [3, 4, 5, 6])
def test_min_match_boundary(min_match):
    exact = match_of(min_match)
    assert SuffixDrafter(exact, min_match=min_match).propose(2) == Proposal(
        (100, 60), min_match, min_match
    )
    short = match_of(min_match - 1)
    assert SuffixDrafter(short, min_match=min_match).propose(2) == EMPTY
    if min_match - 1 >= 3:  # the shorter match exists; only the threshold rejects it
        assert SuffixDrafter(short, min_match=min_match - 1).propose(2).match_length == min_match - 1


# -- matches near the end of history ----------------------------------------


@pytest.mark.parametrize("period", [1, 2, 3, 4, 5])
def test_match_at_end_gives_short_continuation(period):
    # Periodic text after a distinct prefix: the most recent candidate ends one
    # period before the end, so only `period` tokens can follow it.
    cycle = list(range(1, period + 1))
    history = [50, 51] + cycle * (12 // period + 2)
    n = len(history)
    p = n - 1 - period
    got = SuffixDrafter(history).propose(8)
    assert got == Proposal(tuple(history[p + 1 :]), p - 1, p)
    assert len(got.tokens) == period < 8


def test_match_at_end_one_token():
    d = SuffixDrafter([5, 6, 7, 7, 7, 7])
    assert d.propose(4) == EMPTY  # the only candidate (end 4) matches 3 < 4
    d.append(7)
    # The newest candidate ends at n - 2: one token follows it.
    assert d.propose(4) == Proposal((7,), 4, 5)


# -- candidate selection -----------------------------------------------------


def test_longest_wins_over_recent():
    # Old copy "7 1 2 3 4" matches 5; newer "9 1 2 3 4" matches 4.
    history = [7, 1, 2, 3, 4, 10, 9, 1, 2, 3, 4, 11, 7, 1, 2, 3, 4]
    assert SuffixDrafter(history).propose(2) == Proposal((10, 9), 5, 4)


def test_tie_most_recent_wins():
    # Both copies match exactly 4 ("x 1 2 3 4" with x differing).
    history = [5, 1, 2, 3, 4, 10, 6, 1, 2, 3, 4, 11, 7, 1, 2, 3, 4]
    assert SuffixDrafter(history).propose(2) == Proposal((11, 7), 4, 10)


def test_tie_most_recent_wins_among_many():
    history = []
    for k in range(4):
        history += [20 + k, 1, 2, 3, 4, 30 + k]
    history += [99, 1, 2, 3, 4]
    assert SuffixDrafter(history).propose(1) == Proposal((33,), 4, 22)


def forgotten_history(num_newer):
    """A long match (5) followed by `num_newer` shorter matches (4) of the same trigram."""
    history = [7, 1, 2, 3, 4, 20]
    for k in range(num_newer):
        history += [30 + k, 1, 2, 3, 4, 40 + k]
    return history + [7, 1, 2, 3, 4]


def test_only_most_recent_positions_kept():
    # Four newer positions push the long, oldest match out of the index.
    history = forgotten_history(4)
    assert SuffixDrafter(history).propose(1) == Proposal((43,), 4, len(history) - 7)
    # With room for a fifth position, the long match wins: the construction is right.
    assert SuffixDrafter(history, max_positions=5).propose(1) == Proposal((20,), 5, 4)
    # With only three newer positions, the long match is still indexed.
    assert SuffixDrafter(forgotten_history(3)).propose(1) == Proposal((20,), 5, 4)


def test_max_positions_one_keeps_only_latest():
    history = forgotten_history(1)
    assert SuffixDrafter(history, max_positions=1).propose(1) == Proposal((40,), 4, 10)
    assert SuffixDrafter(history, max_positions=2).propose(1) == Proposal((20,), 5, 4)


def test_max_match_caps_extension():
    base = list(range(1000, 1070))  # 70 distinct tokens, longer than MAX_MATCH
    history = [9] + base + [1, 8] + base + [2, 9] + base
    # Uncapped, the older copy (preceded by 9, match 71) would beat the newer
    # (preceded by 8, match 70). Capped, both are MAX_MATCH: the newer wins.
    assert reference_best(history, max_match=10**6) == (71, 70)
    got = SuffixDrafter(history).propose(2)
    assert got == Proposal((2, 9), MAX_MATCH, 142)


# -- the current suffix and periodic text -----------------------------------


def test_current_suffix_is_never_its_own_match():
    for tokens in ([1, 2, 3], [1, 2, 3, 4], [5, 6, 7, 1, 2, 3], list(range(50))):
        d = SuffixDrafter(tokens, min_match=3)
        assert d.propose(4) == EMPTY


@pytest.mark.parametrize("period", [2, 3])
def test_periodic_text_proposes_the_period(period):
    cycle = [10 + k for k in range(period)]
    d = SuffixDrafter(cycle * 10)
    got = d.propose(6)
    assert got.tokens == tuple(cycle)
    assert got.position == len(d) - 1 - period
    # Once extended by the proposal, it proposes the period again.
    d.extend(got.tokens)
    assert d.propose(6).tokens == tuple(cycle)


def test_alternating_tokens():
    got = SuffixDrafter([1, 2, 1, 2, 1, 2]).propose(4)
    assert got == Proposal((1, 2), 4, 3)


# -- max_drafts --------------------------------------------------------------


def test_max_drafts_zero_is_empty():
    assert SuffixDrafter([1, 2, 3, 4, 5, 1, 2, 3, 4]).propose(0) == EMPTY


def test_max_drafts_negative_raises():
    with pytest.raises(ValueError, match=r"max_drafts \(-1\)"):
        SuffixDrafter([1, 2, 3, 4, 5, 1, 2, 3, 4]).propose(-1)


# -- equivalence and the brute-force reference ------------------------------


def random_sequences():
    seqs = []
    for alphabet in (2, 3, 4, 5):
        for seed in (0, 1):
            rng = random.Random(1000 * alphabet + seed)
            seqs.append([rng.randrange(alphabet) for _ in range(rng.randint(150, 200))])
    # Long repeats (matches past MAX_MATCH), with a few mutations.
    rng = random.Random(7)
    block = [rng.randrange(4) for _ in range(66)]
    seqs.append(block * 3)
    seq = block * 3
    for i in (20, 90, 150):
        seq[i] = 4
    seqs.append(seq)
    return seqs


SEQUENCES = random_sequences()


@pytest.mark.parametrize("seq", SEQUENCES[::3], ids=lambda s: f"len{len(s)}")
def test_extend_and_append_agree_at_every_prefix(seq):
    one_by_one = SuffixDrafter()
    for n in range(len(seq) + 1):
        built = SuffixDrafter(seq[:n])
        chunked = SuffixDrafter()
        for i in range(0, n, 7):
            chunked.extend(seq[i : min(i + 7, n)])
        assert built.history == one_by_one.history == chunked.history
        for max_drafts in (0, 1, 3, 8):
            want = built.propose(max_drafts)
            assert one_by_one.propose(max_drafts) == want
            assert chunked.propose(max_drafts) == want
        if n < len(seq):
            one_by_one.append(seq[n])


@pytest.mark.parametrize("seq_index", range(len(SEQUENCES)))
def test_matches_brute_force_reference(seq_index):
    seq = SEQUENCES[seq_index]
    drafters = {m: SuffixDrafter(min_match=m) for m in (3, 4, 5, 6)}
    num_proposals = 0
    for n in range(len(seq) + 1):
        history = seq[:n]
        length, p = reference_best(history)
        for min_match, d in drafters.items():
            for max_drafts in range(1, 6):
                want = reference_propose(history, max_drafts, min_match)
                assert d.propose(max_drafts) == want, (n, min_match, max_drafts)
                num_proposals += bool(want.tokens)
        if n < len(seq):
            for d in drafters.values():
                d.append(seq[n])
    assert num_proposals > 0  # the sequences do exercise proposals


@pytest.mark.parametrize("max_positions", [1, 2, 3, 5])
def test_matches_reference_for_other_position_counts(max_positions):
    for seq in SEQUENCES[::2]:
        d = SuffixDrafter(min_match=3, max_positions=max_positions)
        for n in range(len(seq) + 1):
            want = reference_propose(seq[:n], 5, 3, max_positions=max_positions)
            assert d.propose(5) == want, (n, max_positions)
            if n < len(seq):
                d.append(seq[n])


def test_proposal_invariants_on_random_text():
    for seq in SEQUENCES:
        d = SuffixDrafter(min_match=3)
        for token in seq:
            d.append(token)
            got = d.propose(5)
            if got.tokens:
                n = len(d)
                h = d.history
                assert 2 <= got.position <= n - 2  # never the current suffix itself
                assert 3 <= got.match_length <= MAX_MATCH
                assert h[got.position - 2 : got.position + 1] == h[n - 3 :]
                assert 0 < len(got.tokens) <= 5
            else:
                assert got == EMPTY
