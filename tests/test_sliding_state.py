"""The sliding-window ring (engine/sliding_state.py: SlidingKVState): forced rejection at every
offset of the ring, with sequences many windows long; the state alone against a plain list of
cells; snapshots, prefix checkpoints and session files; forged snapshots refused.

Forced rejection, as tests/test_mamba2_state.py does: for T = 2..8 and every keep in 1..T, the
window's inputs are the true sequence up to `keep` and wrong tokens after it; after commit(keep)
the committed cells a next row can see (every layer's), the next row's logits and the state
after it must equal serial decoding's. The model is strata's GPT-OSS module with a window of 4
(a ring of 4 + 8 - 1 = 11 cells); pos0 runs over 11 consecutive positions past 2W, so every
offset modulo the ring and modulo the window is a window's start.
"""

import random

import mlx.core as mx
import numpy as np
import pytest
from gpt_oss_checkpoints import strata_model
from state_checks import check_checkpoint_round_trip, check_forced_rejections, max_state_diff, serial_decode

from strata_cli.engine.sliding_state import SlidingKVState
from strata_cli.engine.state import Mode
from strata_cli.engine.window import SnapshotError, WindowEngine
from strata_cli.options import EngineOptions

W = 4
CAPACITY = W + 8 - 1
TOL = 1e-5
SEQ_LEN = 2 * W + CAPACITY + 12


@pytest.fixture(scope="module")
def model():
    return strata_model(W)


@pytest.fixture(scope="module")
def serial(model):
    return serial_decode(model, SEQ_LEN)


def test_the_model_keeps_a_ring_for_its_sliding_layers(model):
    engine = WindowEngine(model)
    assert [type(s).__name__ for s in engine.states] == ["SlidingKVState", "KVState"]
    engine.prefill(list(range(30)))
    ring = engine.states[0]
    assert ring.capacity == CAPACITY and ring.keys.shape[2] == CAPACITY
    assert engine.state_tensors()[0]["keys"].shape[2] == W - 1  # what a next row can see


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("pos0", range(2 * W, 2 * W + CAPACITY), ids=lambda p: f"pos0%{CAPACITY}={p % CAPACITY}")
def test_forced_rejection_matches_serial(model, serial, pos0, partial):
    options = EngineOptions(fold="lazy", partial=partial)
    assert check_forced_rejections(model, options, serial, pos0, TOL) == sum(range(2, 9))


@pytest.mark.parametrize("pos0", [1, W - 1, W, 2 * W + 3])
def test_forced_rejection_eager_and_early(model, serial, pos0):
    """Eager folds (nothing to fold here, the mode must not matter) and windows that start
    before the window has filled or wrap the ring on their first write."""
    assert check_forced_rejections(model, EngineOptions(fold="eager"), serial, pos0, TOL) == sum(range(2, 9))


@pytest.mark.parametrize("pos0", [2 * W, 2 * W + 5, 2 * W + CAPACITY - 1])
def test_padded_windows_match_serial(model, serial, pos0):
    """Windows padded to their row bucket (GPU backends): the padded rows write ring cells too,
    never kept, and never cells a later row can see (a bucket holds at most 8 rows)."""
    options = EngineOptions(fold="lazy", pad_windows=True)
    assert check_forced_rejections(model, options, serial, pos0, TOL) == sum(range(2, 9))


def test_wrong_rows_would_be_detected(model, serial):
    """The comparison is sharp: a committed row whose input was wrong shows in the ring's cells."""
    seq, _, serial_states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:12])
    engine.run(seq[12:14] + [(seq[14] + 1) % model.config.vocab_size], 12)
    engine.commit(3)
    got, want = engine.state_tensors()[0], serial_states[14][0]
    assert float(mx.abs(got["keys"] - want["keys"]).max()) > 1e-3


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_chains_of_windows_match_serial(model, serial, partial):
    """Many windows in a row, each keeping a random prefix, wrap the ring again and again."""
    seq, serial_logits, serial_states = serial
    rng = random.Random(7)
    engine = WindowEngine(model, EngineOptions(partial=partial))
    engine.prefill(seq[:2])
    pos = 2
    while pos < SEQ_LEN - 1:
        T = min(rng.randint(1, 8), SEQ_LEN - pos)
        keep = rng.randint(1, T)
        out = engine.run(seq[pos : pos + keep] + [0] * (T - keep), pos)
        for i in range(keep):
            assert float(mx.abs(out.logits[i] - serial_logits[pos + i]).max()) <= TOL
        engine.commit(keep)
        pos += keep
    assert max_state_diff(engine.state_tensors(), serial_states[pos - 1]) <= TOL


def test_abandoned_launch_leaves_the_ring_usable(model, serial):
    seq, serial_logits, _ = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:20])
    engine.launch(7, 20)
    engine.abandon()
    out = engine.run([seq[20]], 20)
    assert float(mx.abs(out.logits[0] - serial_logits[20]).max()) <= TOL


def test_long_runs_commit_only_their_kept_rows(model, serial):
    """A run longer than the ring's margin (the positional form, written at commit) that keeps
    only some rows ends in serial decoding's state."""
    seq, serial_logits, serial_states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:5])
    out = engine.run(seq[5:5 + 14] + [1, 2, 3], 5)  # 17 rows, 14 of them right
    for i in range(14):
        assert float(mx.abs(out.logits[i] - serial_logits[5 + i]).max()) <= TOL
    engine.commit(14)
    assert max_state_diff(engine.state_tensors(), serial_states[18]) <= TOL
    out = engine.run([seq[19]], 19)
    assert float(mx.abs(out.logits[0] - serial_logits[19]).max()) <= TOL


# -- the state alone, against a list of cells --------------------------------------------------------


def test_state_alone_matches_a_list_of_cells():
    """Random windows written into a ring of window 3 (capacity 10) and committed with random
    keeps: each row's visible cells, read through the mask, are exactly the last 3 positions
    of the committed-plus-own sequence, and tensors() lists the last 2 committed."""
    rng = random.Random(3)
    state = SlidingKVState(3)
    truth: list[float] = []  # committed cell values by position
    pos = 0
    while pos < 60:
        T = rng.randint(1, 8)
        values = [float(1000 * pos + i) for i in range(T)]
        cells = mx.array(values).reshape(1, 1, T, 1)
        state.begin(pos, T, Mode.WINDOW)
        keys, _, mask = state.update_and_fetch(cells, cells)
        assert keys.shape[2] == 10
        for t in range(T):
            seen = sorted(np.array(keys[0, 0, :, 0])[np.array(mask[t])].tolist())
            assert seen == sorted((truth + values[: t + 1])[-3:]), (pos, T, t)
        keep = rng.randint(1, T)
        state.commit(keep)
        truth += values[:keep]
        pos += keep
        assert np.array(state.tensors()["keys"]).reshape(-1).tolist() == truth[-2:]


# -- snapshots, prefix checkpoints and session files ------------------------------------------------


def test_check_snapshot_names_what_does_not_fit(model, serial):
    seq = serial[0]
    engine = WindowEngine(model)
    engine.prefill(seq[:12])
    good = engine.snapshot()
    engine.check_snapshot(good)
    keys, values, n = good.states[0]
    for states, words in [
        (((keys[:, :, :W], values, n), *good.states[1:]),
         rf"layer 0 \(SlidingKVState\): keys has shape \(1, 2, {W}, 16\), this model's is \(1, 2, {CAPACITY}, 16\)"),
        (((keys, values.astype(mx.float16), n), *good.states[1:]), "values is float16"),
        (((keys, values, 11), *good.states[1:]), "length slot is int 11, the checkpoint holds 12 positions"),
        (((keys, values), *good.states[1:]), "2 slots, a sliding KV state has 3"),
        (((None, values, n), *good.states[1:]), "keys is empty, not an array"),
    ]:
        with pytest.raises(SnapshotError, match=words):
            engine.check_snapshot(type(good)(good.length, states))


def test_prefix_checkpoint_and_session_round_trip(model, serial, tmp_path):
    check_checkpoint_round_trip(model, serial[0], tmp_path / "s.session", identity="gpt-oss-tiny", rejected=3)


def test_partial_mode_commits_the_root_inside_the_run(model, serial):
    """In partial mode the root row is committed state before commit, for short windows (the
    ring) and long runs (written at commit otherwise) alike."""
    seq, _, serial_states = serial
    for T in (3, 17):
        engine = WindowEngine(model, EngineOptions(partial=True))
        engine.prefill(seq[:10])
        engine.run(seq[10 : 10 + T], 10)
        assert engine.length == 11
        assert max_state_diff([s.tensors() for s in engine.states], serial_states[10]) <= TOL  # before commit
        engine.commit(1)
        assert max_state_diff(engine.state_tensors(), serial_states[10]) <= TOL
