"""The Mamba-2 state kind (engine/state.py: Mamba2State): forced rejection at every position,
the chunked SSD prefill against the per-row recurrence, snapshots, prefix checkpoints and
session files.

Forced rejection, as tests/test_window_rollback.py does for GDN: for T = 2..8, every keep in
1..T, pos0 = 8 and 11 (state_checks.REJECTION_OFFSETS), lazy and eager fold, partial mode on
and off, the window's inputs are the true sequence up to `keep` and wrong tokens after it;
after commit(keep) every SSM state, conv history and KV cache and the next row's logits must
equal serial decoding's. The model is the tiny random Nemotron-H of hf_checkpoints.py (Mamba-2,
attention, MLP and MoE blocks), loaded from its Hugging Face layout.
"""

import random

import mlx.core as mx
import numpy as np
import pytest
from state_checks import (
    REJECTION_OFFSETS,
    check_checkpoint_round_trip,
    check_forced_rejections,
    max_state_diff,
    serial_decode,
)
from hf_checkpoints import checkpoint_root, hybrid_hf_checkpoint

from strata_cli.engine.state import Mamba2State, Mode
from strata_cli.engine.window import SnapshotError, WindowEngine
from strata_cli.model import load_model
from strata_cli.model.layer_state import SSMRows
from strata_cli.model.layers import WINDOW_ROWS, RowSplit
from strata_cli.model.mamba2 import CHUNK, ssd_chunked_scan, ssd_step_scan
from strata_cli.options import EngineOptions

TOL = 1e-5
SEQ_LEN = 40
SCAN_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(hybrid_hf_checkpoint(checkpoint_root(tmp_path_factory), "nemotron_h"))


@pytest.fixture(scope="module")
def serial(model):
    """Serial T=1 decoding of a fixed sequence: logits and committed state after each token."""
    return serial_decode(model, SEQ_LEN)


def test_the_model_has_every_state_kind(model):
    engine = WindowEngine(model)
    assert [type(s).__name__ for s in engine.states] == ["Mamba2State", "KVState", "Mamba2State"]
    engine.prefill([1, 2, 3])
    mamba = engine.state_tensors()[0]
    assert mamba["recurrent"].shape == (1, 4, 16, 16) and mamba["recurrent"].dtype == mx.float32
    assert mamba["conv_history"].shape == (1, 3, 64 + 2 * 2 * 16)  # K-1 raw inputs of x, B and C


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("fold", ["lazy", "eager"])
@pytest.mark.parametrize("pos0", REJECTION_OFFSETS, ids=lambda p: f"pos0={p}")
def test_forced_rejection_matches_serial(model, serial, fold, partial, pos0):
    options = EngineOptions(fold=fold, partial=partial)
    assert check_forced_rejections(model, options, serial, pos0, TOL) == sum(range(2, 9))


@pytest.mark.parametrize("fold,partial", [("lazy", False), ("eager", False), ("lazy", True)])
def test_padded_windows_match_serial(model, serial, fold, partial):
    """Windows padded to their row bucket (GPU backends' default): the same checks."""
    options = EngineOptions(fold=fold, partial=partial, pad_windows=True)
    assert check_forced_rejections(model, options, serial, 9, TOL) == sum(range(2, 9))


def test_wrong_rows_would_be_detected(model, serial):
    """The comparison is sharp: a committed row whose input was wrong shows in the SSM state."""
    seq, _, serial_states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:8])
    engine.run(seq[8:10] + [(seq[10] + 1) % model.config.vocab_size], 8)
    engine.commit(3)
    got, want = engine.state_tensors()[0], serial_states[10][0]
    assert float(mx.abs(got["recurrent"] - want["recurrent"]).max()) > 1e-3
    assert float(mx.abs(got["conv_history"] - want["conv_history"]).max()) > 1e-3


@pytest.mark.parametrize("fold", ["lazy", "eager"])
def test_chains_of_windows_match_serial(model, serial, fold):
    """Many windows in a row (lazy folds carried from window to window) stay on the serial path."""
    seq, serial_logits, serial_states = serial
    rng = random.Random(7)
    engine = WindowEngine(model, EngineOptions(fold=fold))
    engine.prefill(seq[:3])
    pos = 3
    while pos < SEQ_LEN - 1:
        T = min(rng.randint(1, 8), SEQ_LEN - pos)
        keep = rng.randint(1, T)
        out = engine.run(seq[pos : pos + keep] + [0] * (T - keep), pos)
        assert float(mx.abs(out.logits[0] - serial_logits[pos]).max()) <= TOL
        engine.commit(keep)
        pos += keep
    assert max_state_diff(engine.state_tensors(), serial_states[pos - 1]) <= TOL


def test_lazy_fold_before_a_prompt_chunk_repeats_the_windows_scan(model, serial):
    """Rows a decode window kept lazily are folded with that window's per-row scan even when the
    next forward is a prompt chunk that scans in chunked form: bit-identical to serial decoding."""
    seq = serial[0]
    serial_engine = WindowEngine(model)
    serial_engine.prefill(seq[:8])
    for pos in range(8, 11):
        serial_engine.run([seq[pos]], pos)
        serial_engine.commit(1)
    serial_engine.prefill(seq[11:35])
    engine = WindowEngine(model, EngineOptions(fold="lazy"))
    engine.prefill(seq[:8])
    engine.run(seq[8:11] + [0, 0], 8)
    engine.commit(3)
    engine.prefill(seq[11:35])  # 24 rows: the chunked scan
    for mine, theirs in zip(engine.state_tensors(), serial_engine.state_tensors()):
        for name in mine:
            assert mx.array_equal(mine[name], theirs[name]).item(), name


def test_partial_mode_commits_the_root_inside_the_run(model, serial):
    seq, _, serial_states = serial
    engine = WindowEngine(model, EngineOptions(partial=True))
    engine.prefill(seq[:10])
    engine.run(seq[10:13], 10)
    assert engine.length == 11
    assert max_state_diff([s.tensors() for s in engine.states], serial_states[10]) <= TOL  # before commit
    engine.commit(1)
    assert max_state_diff(engine.state_tensors(), serial_states[10]) <= TOL


@pytest.mark.parametrize("row_split", ["auto", "always"])
def test_every_row_of_a_window_equals_its_serial_logits(model, serial, row_split, monkeypatch):
    """Row invariance, bit for bit: "auto" is what the CPU runs, "always" the GPU backends' path."""
    monkeypatch.setattr(RowSplit, "mode", row_split)
    seq = serial[0]
    engine = WindowEngine(model)
    engine.prefill(seq[:11])
    start = engine.snapshot()
    alone = []
    for i in range(WINDOW_ROWS):
        alone.append(engine.run([seq[11 + i]], 11 + i).logits[0])
        engine.commit(1)
    engine.restore(start)
    together = engine.run(seq[11 : 11 + WINDOW_ROWS], 11).logits
    assert mx.array_equal(together, mx.stack(alone)).item()


# -- the chunked SSD form against the per-row recurrence -------------------------------------------


def random_rows(T: int, *, seed: int, H: int = 4, P: int = 8, G: int = 2, N: int = 16) -> SSMRows:
    keys = mx.random.split(mx.random.key(seed), 4)
    x = mx.random.normal((1, T, H, P), key=keys[0])
    B = mx.random.normal((1, T, G, N), key=keys[1]) / N**0.5
    C = mx.random.normal((1, T, G, N), key=keys[2]) / N**0.5
    dt = mx.exp(mx.random.uniform(np.log(0.001), np.log(0.5), (1, T, H), key=keys[3]))
    A = -mx.arange(1, H + 1, dtype=mx.float32)
    return SSMRows(x, B, C, dt, dt * A)


@pytest.mark.parametrize("T", [1, CHUNK - 1, CHUNK, CHUNK + 1, 1000])
@pytest.mark.parametrize("from_state", [False, True], ids=["zero", "restored"])
def test_chunked_scan_matches_the_step_recurrence(T, from_state):
    rows = random_rows(T, seed=T)
    S0 = (mx.random.normal((1, 4, 8, 16), key=mx.random.key(99)) if from_state
          else mx.zeros((1, 4, 8, 16)))
    y_step, S_step = ssd_step_scan(rows, S0)
    y_chunk, S_chunk = ssd_chunked_scan(rows, S0)
    assert y_chunk.shape == y_step.shape == (1, T, 4, 8)
    assert float(mx.abs(y_chunk - y_step).max()) <= SCAN_TOL * max(1.0, float(mx.abs(y_step).max()))
    assert float(mx.abs(S_chunk - S_step).max()) <= SCAN_TOL * max(1.0, float(mx.abs(S_step).max()))


@pytest.mark.parametrize("split", [1, 63, 64, 65])
def test_prefill_after_a_restored_prefix_matches_serial(model, serial, split):
    """A prompt prefilled in chunked form after restoring a prefix ends in serial decoding's state."""
    seq = (serial[0] * 4)[:100]
    serial_engine = WindowEngine(model)
    serial_last = None
    for pos, token in enumerate(seq):
        serial_last = serial_engine.run([token], pos).logits[0]
        serial_engine.commit(1)
    engine = WindowEngine(model)
    engine.prefill(seq[:split])
    snap = engine.snapshot()
    engine.prefill(seq[split:])  # overwritten by the restore
    engine.restore(snap)
    last = engine.prefill(seq[split:], chunk=512)
    assert float(mx.abs(last - serial_last).max()) <= 1e-4
    assert max_state_diff(engine.state_tensors(), serial_engine.state_tensors()) <= 1e-4


# -- snapshots, prefix checkpoints and session files -----------------------------------------------


def test_snapshot_restore_round_trip(model, serial):
    seq, serial_logits, _ = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:20])
    snap = engine.snapshot()
    engine.run(seq[20:25], 20)
    engine.commit(5)
    engine.run([1, 2, 3], 25)
    engine.commit(2)
    engine.restore(snap)
    assert engine.length == 20
    out = engine.run([seq[20]], 20)
    assert float(mx.abs(out.logits[0] - serial_logits[20]).max()) <= TOL


def test_check_snapshot_names_what_does_not_fit(model, serial):
    seq = serial[0]
    engine = WindowEngine(model)
    engine.prefill(seq[:12])
    good = engine.snapshot()
    engine.check_snapshot(good)
    S, history = good.states[0]
    for states, words in [
        (((S[..., :8], history), *good.states[1:]), r"layer 0 \(Mamba2State\): SSM state has shape \(1, 4, 16, 8\)"),
        (((S, history.astype(mx.float16)), *good.states[1:]), "conv history is float16"),
        (((S,), *good.states[1:]), "1 slots, a Mamba-2 state has 2"),
        (((None, history), *good.states[1:]), "SSM state is empty, not an array"),
    ]:
        with pytest.raises(SnapshotError, match=words):
            engine.check_snapshot(type(good)(good.length, states))


def test_prefix_checkpoint_and_session_round_trip(model, serial, tmp_path):
    check_checkpoint_round_trip(model, serial[0], tmp_path / "s.session", identity="nemotron-tiny", rejected=1)


def test_state_alone_follows_the_gdn_rule():
    """Mamba2State on its own: a window leaves committed state alone until commit, a lazy fold
    waits for the next window, and abandon keeps nothing."""
    def rows(T, seed):
        return random_rows(T, seed=seed, H=2, P=4, G=1, N=8)

    def window(state, pos0, r, mode=Mode.WINDOW):
        state.begin(pos0, len(r), mode)
        state.conv_window(mx.ones((1, len(r), 5)) * (pos0 + 1))
        return state.recur(r, ssd_step_scan)

    lazy, eager = Mamba2State(4, lazy=True), Mamba2State(4, lazy=False)
    first = rows(5, 1)
    for state in (lazy, eager):
        window(state, 0, first)
        state.commit(3)
    assert lazy.pending is not None and eager.pending is None
    assert mx.array_equal(lazy.snapshot()[0], eager.snapshot()[0]).item()  # the snapshot flushes
    before = eager.snapshot()
    window(eager, 3, rows(2, 2))
    eager.abandon()
    assert all(a is b for a, b in zip(eager.snapshot(), before))
