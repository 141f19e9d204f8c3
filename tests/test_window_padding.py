"""Windows padded to row buckets (1, 2, 4, 8 rows) and shapes warmed on first use.

A padded window's real rows must compute exactly what the unpadded window's rows compute (row
invariance, bit for bit on the CPU, on the CPU path and on the GPU path `RowSplit` "always"
runs), padded rows are never committed, and the padded engine passes the same forced-rejection
checks against serial decoding. With padding, four compiled shapes serve every window size and
every keep; warming a shape on scratch state changes nothing a request sees.
"""

import random

import mlx.core as mx
import numpy as np
import pytest
from state_checks import check_forced_rejections, max_state_diff, serial_decode

from strata_cli.decode import generate
from strata_cli.engine.window import WINDOW_BUCKETS, WindowEngine, row_bucket
from strata_cli.model.host_blas import HostBlas
from strata_cli.model.layers import RowSplit
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.telemetry import DecodeStats

PREFIX = 11
TOL = 1e-5


@pytest.fixture(params=["auto", "always"])
def row_split(request, monkeypatch):
    monkeypatch.setattr(RowSplit, "mode", request.param)
    return request.param


def test_row_buckets():
    assert [row_bucket(T) for T in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 9]
    assert WINDOW_BUCKETS == (1, 2, 4, 8)


def test_padding_defaults_off_on_the_cpu(tiny_model):
    assert mx.default_device().type == mx.cpu
    engine = WindowEngine(tiny_model)
    assert not engine.pads_windows and not engine.warms_on_first_use
    assert engine.window_rows(3, 0) == 3
    assert WindowEngine(tiny_model, EngineOptions(pad_windows=True)).window_rows(3, 0) == 4


@pytest.mark.parametrize("fold,partial", [("lazy", False), ("eager", False), ("lazy", True)])
def test_padded_rows_change_no_real_row_bit_for_bit(next_model, row_split, fold, partial):
    """Every T = 1..8 and every keep: the real rows' logits, the committed state and the next
    row's logits of a padded engine equal an unpadded engine's exactly."""
    model = next_model
    rng = random.Random(3)
    tokens = [rng.randrange(model.config.vocab_size) for _ in range(PREFIX + 10)]
    engines = {pad: WindowEngine(model, EngineOptions(fold=fold, partial=partial, pad_windows=pad))
               for pad in (False, True)}
    starts = {}
    for pad, engine in engines.items():
        engine.prefill(tokens[:PREFIX])
        starts[pad] = engine.snapshot()
    padded_some = False
    for T in range(1, 9):
        for keep in range(1, T + 1):
            results = {}
            for pad, engine in engines.items():
                engine.restore(starts[pad])
                out = engine.run(tokens[PREFIX : PREFIX + T], PREFIX)
                assert out.logits.shape[0] == T and len(out.tokens) == T
                engine.commit(keep)
                state = engine.state_tensors()
                nxt = engine.run([tokens[PREFIX + keep]], PREFIX + keep)
                engine.commit(1)
                results[pad] = (np.array(out.logits), out.tokens, state, np.array(nxt.logits), engine.state_tensors())
            padded_some |= engines[True].window_rows(T, PREFIX) > T
            plain, padded = results[False], results[True]
            where = f"T={T} keep={keep} ({row_split}, {fold}, partial={partial})"
            np.testing.assert_array_equal(padded[0], plain[0], err_msg=where)
            assert padded[1] == plain[1], where
            assert max_state_diff(padded[2], plain[2]) == 0.0, where
            np.testing.assert_array_equal(padded[3], plain[3], err_msg=where + " next row")
            assert max_state_diff(padded[4], plain[4]) == 0.0, where
    assert padded_some


@pytest.fixture(scope="module")
def serial(tiny_model):
    return serial_decode(tiny_model, 40)


@pytest.mark.parametrize("fold,partial", [("lazy", False), ("eager", False), ("lazy", True)])
def test_padded_forced_rejections_match_serial(tiny_model, serial, fold, partial):
    options = EngineOptions(fold=fold, partial=partial, pad_windows=True)
    assert check_forced_rejections(tiny_model, options, serial, 9, TOL) == sum(range(2, 9))


def test_a_padded_row_is_never_committed(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(pad_windows=True))
    engine.prefill([1, 2, 3])
    engine.run([4, 5, 6], 3)  # runs 4 rows
    from strata_cli.engine.window import WindowError

    with pytest.raises(WindowError, match="1..3"):
        engine.commit(4)
    engine.commit(3)
    assert engine.length == 6


def test_padding_stops_at_the_context_limit(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(pad_windows=True, max_context=16))
    assert engine.window_rows(3, 12) == 4
    assert engine.window_rows(3, 13) == 3  # 4 rows would pass the last position
    engine.prefill(list(range(13)))
    out = engine.run([1, 2, 3], 13)
    assert len(out.tokens) == 3
    engine.commit(3)
    assert engine.length == 16


def _fresh_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(), seed=11)


def _signature(value):
    if isinstance(value, mx.array):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    return type(value).__name__


def _count_compiled_shapes(monkeypatch, pad: bool, keeps) -> dict:
    """Distinct input signatures each compiled layer function saw (one `mx.compile` trace each)
    while windows of T = 1..8 ran with the keeps `keeps(T)`."""
    seen: dict[str, set] = {}
    real = mx.compile

    def counting(fn, **options):
        compiled = real(fn, **options)
        name = f"{id(getattr(fn, '__self__', fn))}.{fn.__name__}"

        def call(*args):
            seen.setdefault(name, set()).add(_signature(args))
            return compiled(*args)

        return call

    monkeypatch.setattr(mx, "compile", counting)
    # The compiled layer ends a GPU runs: on the CPU short calls take the numpy host path instead.
    monkeypatch.setattr(HostBlas, "windows", False)
    engine = WindowEngine(_fresh_model(), EngineOptions(pad_windows=pad))
    engine.prefill([5, 6, 7, 8])
    start = engine.snapshot()
    for T in range(1, 9):
        for keep in keeps(T):
            for _ in range(2):  # the first call of a setting runs eager (compiled.py); the second traces
                engine.restore(start)
                engine.run([9] * T, 4)
                engine.commit(keep)
                engine.run([1], 4 + keep)
                engine.commit(1)
    monkeypatch.setattr(mx, "compile", real)
    return {name: len(sigs) for name, sigs in seen.items()}


def test_padding_leaves_four_compiled_shapes_and_keep_adds_none(monkeypatch):
    plain = _count_compiled_shapes(monkeypatch, False, lambda T: [1])
    padded = _count_compiled_shapes(monkeypatch, True, lambda T: [1])
    padded_every_keep = _count_compiled_shapes(monkeypatch, True, lambda T: range(1, T + 1))
    assert plain and set(plain.values()) == {8}  # one trace per window size, per layer function
    assert set(padded.values()) == {len(WINDOW_BUCKETS)}
    assert sum(padded_every_keep.values()) == sum(padded.values())
    print(f"compiled shapes over all layer functions: {sum(plain.values())} unpadded, "
          f"{sum(padded.values())} padded")


def test_warm_on_first_use_touches_no_state(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(pad_windows=True))
    engine.warms_on_first_use = True  # what a GPU backend gets by default
    engine.prefill([3, 1, 4, 1, 5])
    before = engine.state_tensors()
    assert engine.needs_warm(3, 5)
    assert engine.ensure_warm(3, 5) > 0.0
    assert engine.length == 5 and max_state_diff(engine.state_tensors(), before) == 0.0
    assert not engine.needs_warm(4, 5) and engine.ensure_warm(4, 5) == 0.0  # the same bucket
    assert engine.needs_warm(5, 5)
    assert engine.warm_rows >= {1, 4}  # the warm-up's fold ran a one-row window too


def test_a_window_too_near_the_end_to_pad_warms_its_own_shape(tiny_model):
    engine = WindowEngine(tiny_model, EngineOptions(pad_windows=True, max_context=16))
    engine.warms_on_first_use = True
    engine.prefill(list(range(13)))
    assert engine.window_rows(3, 13) == 3 and engine.needs_warm(3, 13)
    engine.ensure_warm(3, 13)
    assert 3 in engine.warm_rows and 4 not in engine.warm_rows and not engine.needs_warm(3, 13)
    assert engine.pads_windows and engine.length == 13


def test_lazy_warm_up_in_decoding_is_outside_windows_and_changes_no_output(tiny_model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 4

    def decode(lazy: bool):
        engine = WindowEngine(tiny_model, EngineOptions(pad_windows=True))
        engine.warms_on_first_use = lazy
        stats = DecodeStats()
        tokens = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=24),
                                         spec=SpecOptions(max_drafts=4), eos_ids=(), stats=stats)
                  for t in step.tokens]
        return tokens, stats

    lazy_tokens, lazy_stats = decode(True)
    eager_tokens, eager_stats = decode(False)
    assert lazy_tokens == eager_tokens
    assert eager_stats.shape_warmup_seconds == 0.0
    assert lazy_stats.shape_warmup_seconds > 0.0
    assert {w.T for w in lazy_stats.windows if w.T > 1}  # drafts ran, on warmed shapes
