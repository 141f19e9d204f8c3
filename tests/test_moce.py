"""Cache-aware routing (MoCE, experts/moce.py): opt-in, exact when its knobs say so, per-draft
knobs only on draft rows, a budget that is never exceeded, and labelled approximate.

The checkpoint is the small synthetic streamed Qwen3-Next of tests/stream_checkpoints.py (32
experts, top-4), float32 on the CPU.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from stream_checkpoints import TOP_K, build_pair

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.experts import moce
from strata_cli.options import (
    ConfigError,
    GenerateOptions,
    MoceOptions,
    SpecOptions,
    StreamOptions,
)
from strata_cli.runtime import load_checkpoint
from strata_cli.telemetry import DecodeStats

PROMPT = ([5, 17, 33, 2, 71, 9] + [40, 41, 42]) * 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("moce"))


def decode(path, *, slots=8, moce_options=None, drafts=3, tokens=24, prefetch="router"):
    model = load_checkpoint(path, stream=StreamOptions(resident_experts=slots, prefetch=prefetch),
                            moce=moce_options)
    stats = DecodeStats()
    steps = generate(WindowEngine(model), PROMPT, options=GenerateOptions(max_tokens=tokens),
                     spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats)
    ids = [t for step in steps for t in step.tokens]
    model.expert_cache.close()
    return ids, stats, model


# -- options -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(bonus=1.0), "--moce-bonus needs --moce-protect"),
    (dict(budget=2), "--expert-budget needs --moce-protect"),
    (dict(protect=-1), "--moce-protect must be >= 0"),
    (dict(protect=1, bonus=float("nan")), "--moce-bonus must be a finite number"),
    (dict(protect=1, draft_bonus=-0.5), "--draft-moce-bonus must be a finite number"),
    (dict(protect=1, draft_protect=0, budget=2), "--expert-budget needs --moce-protect and --draft-moce-protect >= 1"),
])
def test_options_are_checked_once(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MoceOptions(**kwargs)


def test_protect_above_top_k_is_refused(checkpoints):
    with pytest.raises(ConfigError, match=f"at most the model's experts per token \\({TOP_K}\\)"):
        load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=8), moce=MoceOptions(protect=TOP_K + 1))


def test_a_checkpoint_that_does_not_stream_refuses_moce(checkpoints):
    with pytest.raises(ConfigError, match="applies to a streamed checkpoint"):
        load_checkpoint(checkpoints[0], moce=MoceOptions(protect=1))


# -- the selection rule ------------------------------------------------------------------------

def random_case(seed, N=6, E=32):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(N, E)) * 2
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return p.astype(np.float32), rng.random(E) < 0.3


@pytest.mark.parametrize("options", [MoceOptions(protect=1, bonus=0.0), MoceOptions(protect=TOP_K, bonus=9.0),
                                     MoceOptions(protect=0)])
def test_bonus_zero_or_protect_k_picks_the_natural_top_k(options):
    for seed in range(10):
        p, resident = random_case(seed)
        inds, mask, natural = moce.select(p, resident, TOP_K, options, is_decode=True)
        assert mask.all()
        assert [set(r) for r in inds.tolist()] == [set(r) for r in natural.tolist()]


def test_a_bonus_prefers_residents_and_keeps_the_protected():
    p, resident = random_case(1)
    inds, mask, natural = moce.select(p, resident, TOP_K, MoceOptions(protect=1, bonus=50.0), is_decode=True)
    for r in range(len(p)):
        assert natural[r, 0] in inds[r]
        others = [e for e in inds[r] if e != natural[r, 0]]
        # A huge bonus fills every other slot with residents while there are enough of them.
        assert all(resident[e] for e in others), (r, others)
    assert any(set(inds[r]) != set(natural[r]) for r in range(len(p)))


def test_draft_knobs_change_only_draft_rows():
    p, resident = random_case(2)
    base = MoceOptions(protect=TOP_K)
    drafty = MoceOptions(protect=TOP_K, draft_protect=1, draft_bonus=50.0)
    a, _, _ = moce.select(p, resident, TOP_K, base, is_decode=True)
    b, _, _ = moce.select(p, resident, TOP_K, drafty, is_decode=True)
    assert set(a[0]) == set(b[0])
    assert any(set(a[r]) != set(b[r]) for r in range(1, len(p)))
    # Prompt chunks have no draft rows: the base knobs serve every row.
    c, _, _ = moce.select(p, resident, TOP_K, drafty, is_decode=False)
    assert [set(r) for r in c.tolist()] == [set(r) for r in a.tolist()]


def test_exact_prefill_routes_prompt_chunks_exactly_and_decode_windows_by_the_knobs(checkpoints, monkeypatch):
    options = MoceOptions(protect=1, bonus=50.0, exact_prefill=True)
    picks = {True: [], False: []}
    select = moce.select

    def recording(p, resident, top_k, opts, *, is_decode):
        out = select(p, resident, top_k, opts, is_decode=is_decode)
        picks[is_decode].append(all(set(a) == set(n) for a, n in zip(out[0].tolist(), out[2].tolist())))
        return out

    monkeypatch.setattr(moce, "select", recording)
    decode(checkpoints[1], slots=4, moce_options=options, drafts=0)
    assert picks[False] and all(picks[False])  # every prompt chunk took its natural top-k
    assert not all(picks[True])  # a huge bonus substitutes in decode windows


@pytest.mark.parametrize("kwargs, message", [
    (dict(exact_prefill=True), "--moce-exact-prefill needs --moce-protect"),
    (dict(protect=1, budget=1, exact_prefill=True), "--expert-budget (1) caps every window"),
    (dict(natural_prefetch=True), "--moce-natural-prefetch needs --moce-protect"),
    (dict(count_inflight=True), "--moce-count-inflight needs --moce-protect"),
])
def test_exact_prefill_is_checked(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        MoceOptions(**kwargs)


def budget_used(inds, mask, p, resident, options, is_decode):
    """Non-resident experts a window loads beyond every row's protected ones."""
    protected = set()
    for r in range(len(p)):
        J, _ = options.knobs(is_draft=is_decode and r > 0)
        protected.update(np.argsort(-p[r], kind="stable")[:J].tolist())
    loaded = {e for e in inds[mask].tolist() if not resident[e]}
    return len(loaded - protected)


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_is_never_exceeded(budget):
    options = MoceOptions(protect=1, bonus=0.5, budget=budget)
    for seed in range(20):
        p, resident = random_case(seed, N=8)
        inds, mask, _ = moce.select(p, resident, TOP_K, options, is_decode=True)
        assert budget_used(inds, mask, p, resident, options, True) <= budget
        assert mask[:, 0].all()  # every row keeps at least its protected expert


# -- end to end --------------------------------------------------------------------------------

def test_exact_knobs_reproduce_exact_routing_token_for_token(checkpoints):
    exact, exact_stats, _ = decode(checkpoints[1])
    assert "approximate" not in exact_stats.summary()
    for options in (MoceOptions(protect=1, bonus=0.0), MoceOptions(protect=TOP_K, bonus=5.0),
                    MoceOptions(protect=TOP_K, bonus=5.0, count_inflight=True)):
        ids, stats, _ = decode(checkpoints[1], moce_options=options)
        assert ids == exact, options
        summary = stats.summary()
        assert summary["approximate"] is True  # labelled even when the knobs happen to be exact
        assert summary["experts"]["moce"]["substitutions"] == 0


def test_routing_off_never_depends_on_residency(checkpoints):
    one, _, model = decode(checkpoints[1], slots=3)
    other, stats, _ = decode(checkpoints[1], slots=32)
    assert one == other
    assert all(m.routing_policy is None for _, m in model.named_modules() if hasattr(m, "top_k"))
    assert "moce" not in stats.summary()["experts"]


def test_moce_substitutes_and_saves_reads_within_the_budget(checkpoints, monkeypatch):
    options = MoceOptions(protect=1, bonus=3.0, budget=1)
    seen = []
    select = moce.select

    def recording(p, resident, top_k, opts, *, is_decode):
        out = select(p, resident, top_k, opts, is_decode=is_decode)
        seen.append(budget_used(out[0], out[1], p, resident, opts, is_decode))
        return out

    monkeypatch.setattr(moce, "select", recording)
    ids, stats, _ = decode(checkpoints[1], moce_options=options, prefetch="off")
    assert len(ids) == 24 and seen and max(seen) <= 1
    summary = stats.summary()
    assert summary["approximate"] is True
    assert summary["experts"]["moce"]["substitutions"] > 0
    assert summary["experts"]["moce"]["misses_saved"] > 0
    per_layer = summary["experts"]["per_layer"]
    assert sum(row["substitutions"] for row in per_layer) == summary["experts"]["moce"]["substitutions"]


def test_routing_policy_weights_padding_zero():
    """A padded slot (no candidate within the budget) adds nothing to the block's output."""
    from strata_cli.model.moe import SparseMoeBlock

    block = SparseMoeBlock(hidden_size=8, expert_size=4, num_experts=6, top_k=2, norm_topk_prob=True)
    x = mx.random.normal((3, 8), key=mx.random.key(0))
    probs = mx.softmax(block.gate(x).astype(mx.float32), axis=-1)
    top = mx.argmax(probs, axis=-1)
    block.routing_policy = lambda probs, k: (mx.stack([top, top], axis=1), mx.array([[1.0, 0.0]] * 3))
    _, weights = block.route(x)
    assert np.allclose(np.array(weights), [[1.0, 0.0]] * 3)


# -- MoCE-aware prefetch -----------------------------------------------------------------------

def test_prefetch_picks_are_the_picks_moce_routing_makes():
    for seed in range(10):
        p, resident = random_case(seed)
        exact = moce.prefetch_picks(p, resident, TOP_K, MoceOptions(protect=TOP_K))
        assert sorted(exact.tolist()) == sorted(np.argsort(-p, axis=-1)[:, :TOP_K].reshape(-1).tolist())
        options = MoceOptions(protect=1, bonus=50.0, draft_bonus=0.0)
        inds, mask, natural = moce.select(p, resident, TOP_K, options, is_decode=True)
        picks = moce.prefetch_picks(p, resident, TOP_K, options)
        assert picks.tolist() == inds[mask].tolist()
        # the root row (base knobs) reads no non-resident expert beyond its protected top-1
        assert {e for e in inds[0] if not resident[e]} <= {natural[0, 0]}


def record_prefetch(monkeypatch):
    """Every prefetch prediction of a decode: (block, predicted array, next block's residency, guess)."""
    from strata_cli.experts.cache import ExpertCache

    calls = []
    guess = ExpertCache._prefetch_guess

    def recording(self, i, ids, predicted):
        resident = self.resident_mask(self.paths[i + 1]).copy()
        out = guess(self, i, ids, predicted)
        calls.append((i, None if predicted is None else np.array(predicted), resident, np.array(out)))
        return out

    monkeypatch.setattr(ExpertCache, "_prefetch_guess", recording)
    return calls


def test_exact_routing_prefetch_is_unchanged_and_exact_knobs_predict_the_same(checkpoints, monkeypatch):
    calls = record_prefetch(monkeypatch)
    exact, exact_stats, model = decode(checkpoints[1])
    assert all(rule is None for rule in model.expert_cache._prefetch_rules)
    exact_calls, calls[:] = list(calls), []
    # exact routing's read-ahead is the next router's natural top-k: (N, k) ids
    assert exact_calls and all(g.shape[-1] == TOP_K and g.dtype == np.int64 for *_, g in exact_calls)
    ids, stats, model = decode(checkpoints[1], moce_options=MoceOptions(protect=TOP_K))
    assert ids == exact
    assert all(rule is not None for rule in model.expert_cache._prefetch_rules)
    assert len(calls) == len(exact_calls)
    for (i, _, _, want), (j, probs, _, got) in zip(exact_calls, calls):
        assert i == j and probs.shape[-1] == 32  # MoCE's rule gets the probabilities
        assert [sorted(r) for r in got.reshape(-1, TOP_K).tolist()] == [sorted(r) for r in want.tolist()]
    a, b = exact_stats.summary()["experts"], stats.summary()["experts"]
    # the prompt fills every slot, so no read-ahead is installed by when it finished: these cannot race
    for key in ("misses", "prefetch_hits"):
        assert a[key] == b[key], key
    assert readaheads_issued(exact_stats) == readaheads_issued(stats)
    stride = model.expert_cache._blocks[0].layout.stride
    for s in (a, b):  # bytes read ahead: the read-aheads that reached the disk, no more
        assert s["prefetched_bytes"] == stride * (s["prefetch_hits"] + s["wasted_prefetches"])


def readaheads_issued(stats: DecodeStats) -> dict[int, int]:
    """Per layer, the read-aheads a decode issued: each was picked (a prefetch hit), read and not
    picked (wasted), or still queued when its block routed (cancelled, never read). Which unpicked
    ones a reader thread had started by then is timing, so `prefetched_bytes` and
    `wasted_prefetches` vary between decodes that route alike; what was issued does not."""
    issued: dict[int, int] = {}
    for window in stats.windows:
        for row in window.experts.layers if window.experts else ():
            n = row["prefetch_hits"] + row["wasted_prefetches"] + row["cancelled_prefetches"]
            issued[row["layer"]] = issued.get(row["layer"], 0) + n
    return issued


def test_moce_prefetch_skips_the_natural_picks_moce_replaces(checkpoints, monkeypatch):
    calls = record_prefetch(monkeypatch)
    options = MoceOptions(protect=1, bonus=50.0)
    decode(checkpoints[1], moce_options=options)
    natural_cold = aware_cold = 0
    for _, probs, resident, guess in calls:
        assert guess.tolist() == moce.prefetch_picks(probs, resident, TOP_K, options).tolist()
        top1 = set(np.argmax(probs, axis=-1).tolist())
        # a huge bonus: every non-resident expert read ahead is some row's protected top-1
        assert {e for e in guess.tolist() if not resident[e]} <= top1
        natural = np.argsort(-probs, axis=-1, kind="stable")[:, :TOP_K]
        natural_cold += len({e for e in natural.reshape(-1).tolist() if not resident[e]})
        aware_cold += len({e for e in guess.tolist() if not resident[e]})
    assert calls and aware_cold < natural_cold
    calls[:] = []
    _, _, model = decode(checkpoints[1], moce_options=MoceOptions(protect=1, bonus=50.0, natural_prefetch=True))
    assert all(rule is None for rule in model.expert_cache._prefetch_rules)
    assert calls and all(g.shape[-1] == TOP_K and g.dtype == np.int64 for *_, g in calls)


# -- in-flight reads count as resident ---------------------------------------------------------

def record_masks(monkeypatch):
    """Every decode-window routing: (the mask MoCE routed by, the block's residency, its in-flight
    read-ahead), the last two read straight from the cache's slots and futures."""
    from strata_cli.experts.cache import ExpertCache

    seen, where = [], {}
    call = moce.MoceRouter.__call__
    select = moce.select

    def routing(self, probs, top_k):
        block = self.cache._blocks[self.cache._position[self.path]]
        where["now"] = (block.slot_of >= 0, np.isin(np.arange(len(block.slot_of)), list(block.inflight)))
        return call(self, probs, top_k)

    def recording(p, resident, top_k, opts, *, is_decode):
        now = where.pop("now", None)  # None: the prefetch rule's call for the next block
        if is_decode and now is not None:
            seen.append((resident.copy(), *now))
        return select(p, resident, top_k, opts, is_decode=is_decode)

    monkeypatch.setattr(moce.MoceRouter, "__call__", routing)
    monkeypatch.setattr(moce, "select", recording)
    return seen, ExpertCache


def test_off_routes_by_residency_only_and_never_asks_for_reads_in_flight(checkpoints, monkeypatch):
    seen, cache_class = record_masks(monkeypatch)

    def refuse(self, path):
        raise AssertionError("count_inflight off must not look at reads in flight")

    monkeypatch.setattr(cache_class, "inflight_mask", refuse)
    decode(checkpoints[1], slots=4, moce_options=MoceOptions(protect=1, bonus=3.0), drafts=0)
    assert seen and all((mask == resident).all() for mask, resident, _ in seen)
    assert any((inflight & ~resident).any() for _, resident, inflight in seen)  # there were some to ignore


def test_count_inflight_adds_the_reads_in_flight_to_the_residents(checkpoints, monkeypatch):
    seen, _ = record_masks(monkeypatch)
    options = MoceOptions(protect=1, bonus=3.0, count_inflight=True)
    ids, stats, _ = decode(checkpoints[1], slots=4, moce_options=options, drafts=0)
    assert seen and all((mask == (resident | inflight)).all() for mask, resident, inflight in seen)
    assert any((mask & ~resident).any() for mask, resident, _ in seen)
    assert stats.summary()["approximate"] is True
    # it acts only through reads in flight: without read-ahead the routing is the plain MoCE's
    off, _, _ = decode(checkpoints[1], slots=4, moce_options=MoceOptions(protect=1, bonus=3.0), prefetch="off")
    on, _, _ = decode(checkpoints[1], slots=4, moce_options=options, prefetch="off")
    assert on == off
