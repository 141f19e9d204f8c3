"""`--suffix-draft auto` weighs disk reads when experts stream: the expert cache's measured read
time of a window's cold experts feeds the draft-length controller's `extra_cost` hook."""

import math

import pytest
from mock_models import CycleModel

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.experts.cache import DraftReadCost
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.speculative.controller import DraftController
from strata_cli.telemetry import DecodeStats, ExpertWindowStats

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]


def test_read_cost_learns_seconds_per_read_and_cold_experts_per_draft_row():
    cost = DraftReadCost(smoothing=0.5)
    assert cost(1) == 0.0 and cost(4) == math.inf  # before any decode window a draft is not taken blind
    cost.observe(ExpertWindowStats(), rows=1)
    assert cost(4) == 0.0  # a window without reads: reads are free so far
    spent = cost.observe(ExpertWindowStats(misses=4, late_wait_seconds=0.4, cold_beyond_root=3), rows=4)
    assert spent == pytest.approx(0.3)  # 3 cold experts beyond the root at 0.1 s a read
    assert cost(1) == 0.0 and cost(4) == pytest.approx(3 * 1.0 * 0.1) and cost(8) == pytest.approx(7 * 0.1)
    cost.observe(ExpertWindowStats(misses=2, late_wait_seconds=0.4, cold_beyond_root=0), rows=3)
    assert cost.seconds_per_read == pytest.approx(0.15) and cost.cold_per_draft_row == pytest.approx(0.5)
    assert cost(3) == pytest.approx(2 * 0.5 * 0.15)


def test_before_any_draft_a_draft_row_is_as_cold_as_a_root_row_and_auto_declines_when_reads_dominate():
    # Only one-row windows so far: 6 non-resident experts a row (4 misses, 2 prefetch hits), 20 ms a read.
    cost = DraftReadCost(smoothing=0.5)
    controller = DraftController(3)
    assert controller.choose(match_length=10, available=3, extra_cost=cost) == 0  # nothing measured: serial
    for _ in range(3):
        cost.observe(ExpertWindowStats(misses=4, prefetch_hits=2, late_wait_seconds=0.08), rows=1)
    assert cost.cold_per_draft_row is None and cost(3) == pytest.approx(2 * 6 * 0.02)
    for _ in range(6):  # one-row windows of 100 ms measured; the first is a warm-up
        controller.observe(T=1, keep=1, seconds=0.1)
    # The prior acceptance (0.5) makes drafts pay when reads are free...
    assert controller.choose(match_length=10, available=3) > 0
    # ...but not when each draft row brings 6 cold reads of 20 ms (120 ms, more than a window).
    assert controller.plan(match_length=10, available=3, extra_cost=cost).drafts == 0
    # A measured window with drafts replaces the prior: drafts that needed no cold expert are cheap.
    cost.observe(ExpertWindowStats(misses=4, late_wait_seconds=0.08, cold_beyond_root=0), rows=4)
    assert cost.cold_per_draft_row == 0.0 and cost(4) == 0.0


class MockExpertCache:
    """Stands in for an ExpertCache: a fixed read-cost prediction and per-window stats."""

    def __init__(self, seconds_per_draft_row):
        self.seconds_per_draft_row = seconds_per_draft_row
        self.asked = []
        self.last_window = None

    def draft_read_cost(self, T):
        self.asked.append(T)
        return (T - 1) * self.seconds_per_draft_row

    def begin_window(self, *, kind):
        self.kind = kind

    def end_window(self):
        self.last_window = ExpertWindowStats(draft_read_seconds=0.0)
        return self.last_window


class RecordingController(DraftController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_seconds = []

    def observe(self, **kwargs):
        self.extra_seconds.append(kwargs.get("extra_seconds"))
        super().observe(**kwargs)


def decode(seconds_per_draft_row):
    engine = WindowEngine(CycleModel())
    engine.expert_cache = MockExpertCache(seconds_per_draft_row)
    controller = RecordingController(7)
    stats = DecodeStats()
    tokens = [t for step in generate(engine, PROMPT, options=GenerateOptions(max_tokens=40),
                                     spec=SpecOptions(max_drafts=7, auto=True), eos_ids=(), stats=stats,
                                     controller=controller) for t in step.tokens]
    return tokens, stats.summary(), engine.expert_cache, controller


def test_reads_that_cost_seconds_turn_drafts_off_and_free_reads_leave_them_on():
    free, free_summary, free_cache, _ = decode(0.0)
    costly, costly_summary, costly_cache, controller = decode(10.0)
    assert costly == free  # the controller changes how many drafts run, never the output
    assert free_cache.asked and costly_cache.asked  # the decode loop asked the cache's prediction
    assert free_summary["drafts_offered"] > 0
    assert costly_summary["drafts_offered"] == 0 and costly_summary["drafts_declined"] > 0
    assert controller.extra_seconds and all(s == 0.0 for s in controller.extra_seconds)
