"""The chunked gated-delta rule (model/gdn_chunked.py) against the exact per-row recurrence."""

import mlx.core as mx
import pytest

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.engine.window import WindowEngine
from strata_cli.model.gdn import gated_delta_scan, l2_normalize
from strata_cli.model.gdn_chunked import (
    CHUNK,
    GPU_CHUNK,
    MIN_CHUNKED_ROWS,
    chunked_gated_delta_scan,
    unit_lower_inverse,
)
from strata_cli.model.layer_state import GDNRows

RTOL = 1e-4  # relative to the largest reference magnitude, float32
LENGTHS = (1, 63, 64, 65, 1000)


def rel_diff(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


def rel_norm_diff(a: mx.array, b: mx.array) -> float:
    return (mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((b * b).sum())).item()


def random_rows(T: int, *, Hk=2, Hv=4, Dk=16, Dv=8, seed=0, decay=1.0) -> GDNRows:
    kq, kk, kv, kg, kb = mx.random.split(mx.random.key(seed), 5)
    q = l2_normalize(mx.random.normal((1, T, Hk, Dk), key=kq)) * Dk**-0.5
    k = l2_normalize(mx.random.normal((1, T, Hk, Dk), key=kk))
    v = mx.random.normal((1, T, Hv, Dv), key=kv)
    g = -decay * mx.exp(0.5 * mx.random.normal((1, T, Hv), key=kg))
    beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=kb))
    return GDNRows(q, k, v, g, beta)


@pytest.mark.parametrize("chunk", [CHUNK, GPU_CHUNK])
@pytest.mark.parametrize("T", LENGTHS)
def test_chunked_scan_matches_per_row_scan(T, chunk):
    rows = random_rows(T, seed=T)
    S0 = 0.3 * mx.random.normal((1, 4, 16, 8), key=mx.random.key(99))
    y_ref, S_ref = gated_delta_scan(rows, S0)
    y, S = chunked_gated_delta_scan(rows, S0, chunk=chunk)
    assert y.shape == y_ref.shape and S.shape == S_ref.shape
    assert rel_diff(y, y_ref) < RTOL
    assert rel_diff(S, S_ref) < RTOL


@pytest.mark.parametrize("chunk", [CHUNK, GPU_CHUNK])
@pytest.mark.parametrize("decay", [0.01, 30.0])  # almost no forgetting; forgetting within a row or two
def test_chunked_scan_holds_at_extreme_decay(decay, chunk):
    rows = random_rows(200, seed=3, decay=decay)
    S0 = mx.random.normal((1, 4, 16, 8), key=mx.random.key(5))
    y_ref, S_ref = gated_delta_scan(rows, S0)
    y, S = chunked_gated_delta_scan(rows, S0, chunk=chunk)
    assert rel_diff(y, y_ref) < RTOL and rel_diff(S, S_ref) < RTOL


def test_chunked_scan_would_notice_a_wrong_state():
    rows = random_rows(70)
    S0 = mx.random.normal((1, 4, 16, 8), key=mx.random.key(1))
    y_ref, _ = gated_delta_scan(rows, S0)
    y, _ = chunked_gated_delta_scan(rows, 0.9 * S0)
    assert rel_diff(y, y_ref) > RTOL


def test_unit_lower_inverse():
    A = mx.tril(mx.random.normal((3, CHUNK, CHUNK), key=mx.random.key(2)), k=-1) * 0.2
    L = A + mx.eye(CHUNK)
    inv = unit_lower_inverse(L)
    assert (mx.abs(L @ inv - mx.eye(CHUNK)).max().item()) < 1e-4
    assert (mx.abs(mx.triu(inv, k=1)).max().item()) == 0.0


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_next_config(max_position_embeddings=2048), seed=1)


@pytest.fixture(scope="module")
def token_by_token(model):
    """Logits and every state tensor after each of LENGTHS, from one-token windows (per-row scan)."""
    ids = mx.random.randint(0, model.config.vocab_size, (max(LENGTHS),), key=mx.random.key(7)).tolist()
    engine = WindowEngine(model)
    seen = {}
    for pos, token in enumerate(ids):
        out = engine.run([token], pos)
        engine.commit(1)
        if pos + 1 in LENGTHS:
            seen[pos + 1] = (out.logits[0], engine.state_tensors())
    return ids, seen


def assert_states_close(states, reference):
    """GDN states elementwise; attention KV as a whole (||a - b|| / ||b||): float rounding can move
    a near-tie in one row's top-k routing, which shifts that row's later keys by ~1e-3."""
    for layer, ref in zip(states, reference):
        assert layer.keys() == ref.keys()
        for name in ref:
            diff = rel_norm_diff if name in ("keys", "values") else rel_diff
            assert diff(layer[name], ref[name]) < RTOL, name


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_matches_token_by_token(model, token_by_token, n):
    ids, seen = token_by_token
    engine = WindowEngine(model)
    logits = engine.prefill(ids[:n])  # PREFILL_CHUNK rows at a time; 1000 spans two
    ref_logits, ref_states = seen[n]
    assert rel_diff(logits, ref_logits) < RTOL
    assert_states_close(engine.state_tensors(), ref_states)


def test_prefill_after_a_restored_prefix_crosses_chunk_boundaries(model, token_by_token):
    ids, seen = token_by_token
    engine = WindowEngine(model)
    engine.prefill(ids[:100])  # 100 is not a multiple of the chunk: later chunks start mid-way
    saved = engine.snapshot()
    engine.prefill(ids[100:400])  # move on, then come back
    engine.restore(saved)
    logits = engine.prefill(ids[100:1000], chunk=300)
    assert engine.length == 1000
    ref_logits, ref_states = seen[1000]
    assert rel_diff(logits, ref_logits) < RTOL
    assert_states_close(engine.state_tensors(), ref_states)


def test_decode_windows_keep_the_per_row_scan(model, monkeypatch):
    import strata_cli.model.gdn as gdn

    calls = []
    monkeypatch.setattr(gdn, "chunked_scan_over_streams", lambda rows, S: calls.append(len(rows)) or (None, None))
    engine = WindowEngine(model)
    engine.prefill(list(range(MIN_CHUNKED_ROWS - 1)))
    engine.run(list(range(8)), engine.length)
    engine.commit(8)
    assert calls == []


def test_default_chunk_is_the_cpu_one_here_and_the_gpu_one_elsewhere(monkeypatch):
    from strata_cli.model import gdn_chunked

    assert gdn_chunked.default_chunk() == CHUNK
    monkeypatch.setattr(gdn_chunked.mx, "default_device", lambda: mx.gpu)
    assert gdn_chunked.default_chunk() == GPU_CHUNK
