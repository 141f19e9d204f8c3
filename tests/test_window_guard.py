"""The transaction guard: every misuse of run/commit raises a clear WindowError."""

import pytest

from strata_cli.engine.window import WindowEngine, WindowError
from strata_cli.options import EngineOptions


@pytest.fixture(params=[False, True], ids=["whole", "partial"])
def engine(tiny_model, request):
    engine = WindowEngine(tiny_model, EngineOptions(partial=request.param))
    engine.prefill([1, 2, 3])
    return engine


def test_second_run_before_commit(engine):
    engine.run([4, 5], 3)
    with pytest.raises(WindowError, match="before commit"):
        engine.run([4], 3)


def test_commit_without_run(engine):
    with pytest.raises(WindowError, match="without an open run"):
        engine.commit(1)


def test_second_commit(engine):
    engine.run([4, 5], 3)
    engine.commit(1)
    with pytest.raises(WindowError, match="without an open run"):
        engine.commit(1)


@pytest.mark.parametrize("keep", [0, -1, 3, 1.0, None])
def test_keep_out_of_range(engine, keep):
    engine.run([4, 5], 3)
    with pytest.raises(WindowError, match="keep must be in 1..2"):
        engine.commit(keep)
    engine.commit(2)  # the run stays open after a refused commit


def test_window_must_start_at_committed_length(engine):
    with pytest.raises(WindowError, match="committed length is 3"):
        engine.run([4], 2)
    with pytest.raises(WindowError, match="committed length is 3"):
        engine.run([4], 4)


def test_empty_window_and_bad_ids(engine, tiny_model):
    with pytest.raises(WindowError, match="at least one token"):
        engine.run([], 3)
    with pytest.raises(WindowError, match="outside the vocabulary"):
        engine.run([tiny_model.config.vocab_size], 3)


def test_context_limit(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(max_context=6))
    engine.prefill([1, 2, 3, 4])
    with pytest.raises(WindowError, match="context limit of 6"):
        engine.run([1, 2, 3], 4)
    engine.run([1, 2], 4)
    engine.commit(2)
    assert engine.context_left(6) == 0


@pytest.mark.parametrize("action", ["snapshot", "restore", "prefill", "state_tensors"])
def test_state_access_during_open_run(engine, action):
    snap = engine.snapshot()
    engine.run([4], 3)
    with pytest.raises(WindowError, match="awaits commit"):
        if action == "restore":
            engine.restore(snap)
        elif action == "prefill":
            engine.prefill([1])
        else:
            getattr(engine, action)()
