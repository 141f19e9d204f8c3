"""The draft-length controller against synthetic acceptance and cost curves whose optimum is known.

Closed form used below. With constant conditional acceptance `a` and window cost
`C(D) = c0 + c1·(D+1)` for D drafts, `E(D) = (1 - a^(D+1)) / (1 - a)`. Going from D to D+1 raises
the rate E/C exactly when `a^(D+1) / c1 > E(D) / C(D)`, i.e. when

    f(D) = a^(D+1) · ((1 - a)·(c0/c1 + D + 1) + 1) > 1.

f is strictly decreasing in D (f(D+1)/f(D) = a·(1 + (1-a)/((1-a)(c0/c1+D+1)+1)) < 1), so the
best draft length is the first D where f(D) <= 1, capped at the maximum.
"""

import json
import random

import pytest

from strata_cli.speculative.controller import (
    AcceptancePrior,
    CostCurveError,
    CostPrior,
    DraftController,
    match_bucket,
    position_bucket,
)

MAX = 7
CERTAIN = 1e9  # prior strength that no finite evidence moves


def optimum(a: float, c0: float, c1: float, max_drafts: int = MAX) -> int:
    """Closed-form best D for constant acceptance `a` and cost c0 + c1·T (see module docstring)."""
    if a >= 1.0:
        return max_drafts
    for D in range(max_drafts):
        if a ** (D + 1) * ((1 - a) * (c0 / c1 + D + 1) + 1) <= 1:
            return D
    return max_drafts


def rate(a: float, c0: float, c1: float, D: int) -> float:
    expected = sum(a**i for i in range(D + 1))
    return expected / (c0 + c1 * (D + 1))


def linear_costs(c0: float, c1: float, max_drafts: int = MAX) -> CostPrior:
    return CostPrior.from_seconds([c0 + c1 * T for T in range(1, max_drafts + 2)])


def known(a: float, costs: CostPrior) -> DraftController:
    """A controller that believes acceptance is exactly `a` and cost is exactly `costs`."""
    return DraftController(MAX, acceptance_prior=AcceptancePrior(a, CERTAIN), cost_prior=costs)


def test_hand_computed_example():
    # a = 0.8, C = 1 + 0.25·T: f(3) = 0.4096·2.6 = 1.065 > 1, f(4) = 0.32768·2.8 = 0.918 <= 1.
    assert optimum(0.8, 1.0, 0.25) == 4
    assert known(0.8, linear_costs(1.0, 0.25)).choose(match_length=8, available=MAX) == 4
    assert rate(0.8, 1.0, 0.25, 4) > max(rate(0.8, 1.0, 0.25, 3), rate(0.8, 1.0, 0.25, 5))


@pytest.mark.parametrize("a", [0.05, 0.2, 0.4, 0.55, 0.7, 0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("c0,c1", [(1.0, 0.05), (1.0, 0.25), (1.0, 1.0), (0.2, 1.0), (3.0, 0.5)])
def test_constant_acceptance_linear_cost_matches_closed_form(a, c0, c1):
    expected = optimum(a, c0, c1)
    chosen = known(a, linear_costs(c0, c1)).choose(match_length=10, available=MAX)
    assert chosen == expected
    # and the closed form really is the argmax of the rate
    rates = [rate(a, c0, c1, D) for D in range(MAX + 1)]
    assert rates[expected] == pytest.approx(max(rates))


def test_zero_acceptance_never_drafts():
    for costs in (linear_costs(1.0, 0.0001), CostPrior.from_seconds([1.0] * 8), linear_costs(1.0, 1.0)):
        assert known(0.0, costs).choose(match_length=20, available=MAX) == 0


def test_full_acceptance_flat_cost_drafts_the_maximum():
    flat = CostPrior.from_seconds([1.0] * 8)
    assert known(1.0, flat).choose(match_length=4, available=MAX) == MAX
    assert known(1.0, flat).choose(match_length=4, available=3) == 3  # never more than offered
    assert known(1.0, flat).choose(match_length=0, available=3) == 0  # no proposal, no drafts


def test_rejects_a_longer_draft_whose_marginal_rate_is_worse():
    # T = 2 costs as much as T = 1; every row after that costs a full second more. With a = 0.9,
    # one draft gains 0.9 tokens for free; the second gains 0.81 more for 1.0 more second:
    # 0.81 < E(1)/C(1) = 1.9, and no longer draft catches up (E grows by < 1 per extra second).
    costs = CostPrior.from_seconds([1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    plan = known(0.9, costs).plan(match_length=10, available=MAX)
    assert plan.drafts == 1
    gain = plan.expected_keep[2] - plan.expected_keep[1]
    spend = plan.cost[2] - plan.cost[1]
    assert gain / spend < plan.expected_keep[1] / plan.cost[1]


def test_a_cheap_longer_draft_beyond_an_expensive_one_is_taken():
    # Non-convex cost (e.g. a kernel that pads rows to 4): T = 2..4 cost the same.
    costs = CostPrior.from_seconds([1.0, 1.6, 1.6, 1.6, 3.0, 3.0, 3.0, 3.0])
    assert known(0.7, costs).choose(match_length=10, available=MAX) == 3


def test_extra_cost_hook_shortens_the_draft():
    ctrl = known(0.8, linear_costs(1.0, 0.1))
    free = ctrl.choose(match_length=10, available=MAX)
    # Cold experts: every row beyond the root costs 0.5 s more.
    costly = ctrl.choose(match_length=10, available=MAX, extra_cost=lambda T: 0.5 * (T - 1))
    assert costly < free
    assert costly == optimum(0.8, 1.0 - 0.5, 0.1 + 0.5)


def simulate(ctrl, *, accept, cost, windows, rng, match_length=12):
    """Run `windows` synthetic windows: every proposal offers MAX drafts; draft i is accepted
    with probability accept(i) (given the previous ones were); a window of T rows costs cost(T)."""
    chosen = []
    for _ in range(windows):
        D = ctrl.choose(match_length, MAX)
        keep = 1
        while keep <= D and rng.random() < accept(keep):
            keep += 1
        ctrl.observe(T=D + 1, keep=keep, seconds=cost(D + 1) * rng.uniform(0.97, 1.03), match_length=match_length)
        chosen.append(D)
    return chosen


@pytest.mark.parametrize(
    "a,c0,c1",
    [(0.95, 1.0, 0.05), (0.9, 1.0, 0.25), (0.6, 1.0, 0.3), (0.2, 1.0, 0.5), (0.0, 1.0, 0.3)],
)
def test_learning_converges_from_the_priors(a, c0, c1):
    """From the default priors, 200 windows are enough to land on (or next to) the optimum."""
    rng = random.Random(1)
    ctrl = DraftController(MAX)  # default priors: acceptance 0.5, cost 1 + 0.3·(T-1)
    chosen = simulate(ctrl, accept=lambda i: a, cost=lambda T: c0 + c1 * T, windows=200, rng=rng)
    best = optimum(a, c0, c1)
    late = chosen[-50:]
    # The learned choice earns within 3% of the best rate (near the optimum the rate is flat).
    achieved = sum(rate(a, c0, c1, D) for D in late) / len(late)
    assert achieved >= 0.97 * rate(a, c0, c1, best), (best, late)
    assert abs(ctrl.choose(12, MAX) - best) <= 1


def test_learning_separates_match_length_buckets():
    """Short matches are junk, long matches are copies: the controller drafts only for the latter."""
    rng = random.Random(2)
    ctrl = DraftController(MAX)
    cost = lambda T: 1.0 + 0.2 * T  # noqa: E731
    chosen = {4: [], 40: []}
    for _ in range(400):
        short = rng.random() < 0.5
        m = 4 if short else 40
        a = 0.05 if short else 0.95
        D = ctrl.choose(m, MAX)
        keep = 1
        while keep <= D and rng.random() < a:
            keep += 1
        ctrl.observe(T=D + 1, keep=keep, seconds=cost(D + 1), match_length=m)
        chosen[m].append(D)
    # Short matches: only an occasional probe (the bucket is re-tried as its evidence ages).
    assert sum(chosen[4][-100:]) / 100 < 0.3
    assert min(chosen[40][-50:]) == MAX


def test_forgetting_lets_a_rejected_bucket_be_tried_again():
    """After a junk phase the controller stops drafting; when copying starts it comes back."""
    rng = random.Random(3)
    ctrl = DraftController(MAX)
    cost = lambda T: 1.0 + 0.2 * T  # noqa: E731
    junk = simulate(ctrl, accept=lambda i: 0.0, cost=cost, windows=100, rng=rng)
    assert sum(d > 0 for d in junk[-50:]) <= 10  # rare probes only
    copy = simulate(ctrl, accept=lambda i: 0.97, cost=cost, windows=300, rng=rng)
    assert min(copy[-20:]) >= 5


# The demo model's window costs on the 2-core CPU (ms for T = 1..8, `--stats` of auto): a draft
# pays only at high acceptance, which the 0.5 prior does not promise.
CPU_WINDOW_MS = [16.1, 25.5, 36.9, 44.5, 56.4, 63.8, 73.4, 83.4]


def steep(T: int) -> float:
    return CPU_WINDOW_MS[T - 1]


@pytest.mark.parametrize("probe_every", [16, 0])
def test_a_bucket_the_priors_never_draft_for_is_probed(probe_every):
    """With CPU-steep costs a bucket with no evidence is never drafted for from the priors
    alone; probes give it the evidence (99% of drafts kept) and auto reaches the best length.
    Without probes (probe_every=0) it stays serial for good."""
    rng = random.Random(4)
    ctrl = DraftController(MAX, cost_prior=CostPrior.from_seconds(CPU_WINDOW_MS), probe_every=probe_every)
    assert ctrl.choose(40, MAX) == 0  # the priors alone: no draft pays
    chosen = simulate(ctrl, accept=lambda i: 0.99, cost=steep, windows=300, rng=rng)
    if probe_every == 0:
        assert max(chosen) == 0
        return
    best = max(range(MAX + 1), key=lambda D: sum(0.99**i for i in range(D + 1)) / steep(D + 1))
    assert best > 0 and 0 < chosen.index(1) < 2 * probe_every
    late = chosen[-50:]
    achieved = sum(sum(0.99**i for i in range(D + 1)) / steep(D + 1) for D in late) / len(late)
    assert achieved >= 0.97 * sum(0.99**i for i in range(best + 1)) / steep(best + 1), late


def test_probes_are_rare_where_drafts_do_not_pay():
    """Rejected drafts: after a probe the bucket has evidence for ~140 proposals, so probes
    cost about one two-row window per 150 proposals."""
    rng = random.Random(5)
    ctrl = DraftController(MAX, cost_prior=CostPrior.from_seconds(CPU_WINDOW_MS))
    chosen = simulate(ctrl, accept=lambda i: 0.0, cost=steep, windows=600, rng=rng)
    assert max(chosen) == 1 and 2 <= sum(chosen) <= 600 // 140 + 1


def test_cost_is_learned_per_T_and_prior_is_scaled_to_measurements():
    ctrl = DraftController(3, cost_prior=CostPrior.from_seconds([1.0, 2.0, 3.0, 4.0]), warmup_windows=0)
    for _ in range(20):
        ctrl.observe(T=1, keep=1, seconds=0.010)
    # Unmeasured T follow the prior's shape at the measured scale.
    assert ctrl.window_cost(1) == pytest.approx(0.010)
    assert ctrl.window_cost(3) == pytest.approx(0.030)
    for _ in range(20):
        ctrl.observe(T=3, keep=1, seconds=0.012)
    # 16 measurements (the median window) against 2 pseudo-measurements of the scaled prior.
    assert ctrl.window_cost(3) == pytest.approx((16 * 0.012 + 2 * 0.030) / 18)
    # T = 2 sits between two measured T: its scale is interpolated (0.010/1 and 0.012/3).
    assert ctrl.window_cost(2) == pytest.approx(2.0 * (0.010 + 0.004) / 2)


def test_evidence_counts_once():
    """One rejection moves the estimate as one observation against the prior (0.5 worth 2), not
    twice (once in its match bucket and again in the pool the bucket shrinks toward)."""
    ctrl = DraftController(MAX)
    ctrl.observe(T=2, keep=1, seconds=0.01, match_length=10)
    assert ctrl.acceptance(10, 1) == pytest.approx((0 + 2 * 0.5) / (1 + 2), rel=0.02)


def test_hysteresis_keeps_the_last_length_within_the_margin():
    # rates of D = 3 and D = 4 are within 1%: with a margin the last choice stays.
    costs = CostPrior.from_seconds([1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75])
    plain = known(0.8, costs)
    best = plain.choose(10, MAX)
    sticky = DraftController(MAX, acceptance_prior=AcceptancePrior(0.8, CERTAIN), cost_prior=costs,
                             switch_margin=0.05)
    assert best == 3
    assert sticky.choose(10, 2) == 2  # only 2 offered: 2 becomes the last choice
    assert sticky.choose(10, MAX) == 2  # rate(2) is within 5% of rate(3): it stays
    sticky.choose(10, 1)  # 1 offered: the last choice is now 1, whose rate is 15% lower
    assert sticky.choose(10, MAX) == 3


def test_one_slow_window_does_not_lock_a_length_out():
    """A window slowed by something else (another process) must not stop T from being tried."""
    flat = CostPrior.from_seconds([1.0] * 8)
    ctrl = DraftController(MAX, acceptance_prior=AcceptancePrior(0.9, CERTAIN), cost_prior=flat, warmup_windows=0)
    for _ in range(20):
        ctrl.observe(T=1, keep=1, seconds=0.01)
    ctrl.observe(T=8, keep=8, seconds=0.5)  # 50x slower, once
    assert ctrl.window_cost(8) <= 0.01 + 1e-12 and ctrl.choose(10, MAX) == MAX
    # Slow every time: now it is believed, within a few windows (each sample counts as at most
    # stall_factor times the current estimate, so the estimate climbs rather than jumps).
    for believed_after in range(1, 9):
        ctrl.observe(T=8, keep=8, seconds=0.5)
        if ctrl.choose(10, MAX) < MAX:
            break
    assert believed_after <= 6 and ctrl.window_cost(8) > 0.04


GPU_LIKE = [0.004 * (1 + 0.15 * t) for t in range(MAX + 1)]  # flat: drafting pays, as on the H200


def _drafting(prior, *, stall_at=None, stall_T=None, windows=60, p=0.6, stall_factor=4.0) -> list[int]:
    """Drafts chosen per window for a request with acceptance p and cost GPU_LIKE; window
    `stall_at` (run at `stall_T` rows) takes 50x its cost."""
    rng = random.Random(0)
    ctrl = DraftController(MAX, cost_prior=prior, stall_factor=stall_factor)
    chosen = []
    for w in range(windows):
        drafts = ctrl.choose(12, MAX)
        T = stall_T if w == stall_at else drafts + 1
        keep = 1
        while keep < T and rng.random() < p:
            keep += 1
        seconds = GPU_LIKE[T - 1] * (1 + 0.05 * rng.random()) * (50 if w == stall_at else 1)
        ctrl.observe(T=T, keep=keep, seconds=seconds, match_length=12)
        chosen.append(drafts)
    return chosen


@pytest.mark.parametrize("prior", ["builtin", "calibrated"])
def test_one_stall_turns_drafting_off_for_a_few_windows_at_most(prior):
    """One 50x window anywhere in a request (any T) costs at most a few drafting windows: the
    median per T ignores it, the sample is clipped (stall_factor), and a T with a sample or two
    does not rescale the well-measured ones."""
    cost_prior = None if prior == "builtin" else CostPrior.from_seconds(GPU_LIKE)
    baseline = _drafting(cost_prior)
    assert min(baseline[1:]) > 0  # drafting pays on this device
    worst = 0
    for stall_at in (2, 3, 5, 10, 30):
        for stall_T in (1, 2, 5, 8):
            chosen = _drafting(cost_prior, stall_at=stall_at, stall_T=stall_T)
            lost = [w for w in range(stall_at + 1, len(chosen)) if chosen[w] == 0 < baseline[w]]
            worst = max(worst, len(lost))
    assert worst <= (1 if prior == "calibrated" else 3)


def test_a_barely_measured_T_does_not_rescale_well_measured_ones():
    ctrl = DraftController(MAX, cost_prior=CostPrior.from_seconds(GPU_LIKE), warmup_windows=0)
    for _ in range(16):
        ctrl.observe(T=2, keep=1, seconds=GPU_LIKE[1])
    before = [ctrl.window_cost(T) for T in range(1, MAX + 2)]
    ctrl.observe(T=6, keep=1, seconds=50 * GPU_LIKE[5])  # first window of T=6, stalled
    after = [ctrl.window_cost(T) for T in range(1, MAX + 2)]
    assert after == pytest.approx(before, rel=1e-9)


def test_stall_factor_is_checked():
    with pytest.raises(ValueError, match="stall_factor"):
        DraftController(3, stall_factor=1.0)


def test_cost_samples_expire():
    ctrl = DraftController(3, cost_prior=CostPrior.from_seconds([1.0] * 4), warmup_windows=0, cost_memory=50)
    for _ in range(5):
        ctrl.observe(T=4, keep=1, seconds=0.1)  # measured during a slow spell
    for _ in range(60):
        ctrl.observe(T=1, keep=1, seconds=0.01)
    assert ctrl.window_cost(4) == pytest.approx(0.01)  # forgotten: back to the scaled prior
    assert ctrl.snapshot()["cost_samples_by_T"] == {"1": 16}


def test_first_window_is_warmup_not_a_cost_sample():
    ctrl = DraftController(3, cost_prior=CostPrior.from_seconds([1.0, 1.0, 1.0, 1.0]))
    ctrl.observe(T=1, keep=1, seconds=5.0)  # graph building, first allocations
    ctrl.observe(T=1, keep=1, seconds=0.01)
    assert ctrl.window_cost(1) < 0.02


def test_observe_validates_keep():
    with pytest.raises(ValueError, match="keep must be in 1..3"):
        DraftController(3).observe(T=3, keep=4, seconds=0.1)


def test_buckets():
    assert [match_bucket(m) for m in (0, 3, 4, 5, 6, 7, 8, 11, 12, 19, 20, 31, 32, 64)] == [
        0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5
    ]
    assert [position_bucket(p) for p in range(1, 8)] == [0, 1, 2, 3, 3, 4, 4]


def test_cost_curve_files(tmp_path):
    curve = {"curve": [{"T": t, "median_s": 0.01 * (1 + 0.5 * (t - 1))} for t in range(1, 5)]}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(curve))
    prior = CostPrior.from_json(path)
    assert prior.shape(3) == pytest.approx(2.0)
    assert prior.shape(6) == pytest.approx(3.5)  # extended linearly past T = 4
    assert prior.seconds_per_row == pytest.approx(0.01)
    listed = tmp_path / "list.json"
    listed.write_text("[0.02, 0.03]")
    assert CostPrior.from_json(listed).shape(2) == pytest.approx(1.5)
    bad = tmp_path / "bad.json"
    for text, message in [
        ('{"curve": [{"T": 2, "median_s": 1}]}', "must be 1, 2, 3"),
        ("[0, 1]", "positive"),
        ("{", "cannot read"),
        ('"x"', "expected a JSON object or list"),
    ]:
        bad.write_text(text)
        with pytest.raises(CostCurveError, match=message):
            CostPrior.from_json(bad)


# -- in the decode loop ----------------------------------------------------------------------------


def _decode(model, prompt, spec, max_tokens=120, controller=None):
    from strata_cli.decode import generate
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import GenerateOptions
    from strata_cli.telemetry import DecodeStats

    stats = DecodeStats()
    tokens = []
    for step in generate(WindowEngine(model), prompt, options=GenerateOptions(max_tokens=max_tokens), spec=spec,
                         eos_ids=(), stats=stats, controller=controller):
        tokens += step.tokens
    return tokens, stats.summary()


def test_auto_learns_to_draft_long_on_a_perfect_drafter():
    """CycleModel's greedy output is exactly what the drafter proposes: auto ends up at the maximum."""
    from test_decode import PROMPT, CycleModel

    from strata_cli.options import SpecOptions

    serial, _ = _decode(CycleModel(), PROMPT, SpecOptions())
    # Flat cost, so the only thing to learn is that drafts are always accepted.
    ctrl = DraftController(MAX, cost_prior=CostPrior.from_seconds([1.0] * 8))
    auto, summary = _decode(CycleModel(), PROMPT, SpecOptions(max_drafts=MAX, auto=True), controller=ctrl)
    assert auto == serial
    assert summary["drafts_kept"] == summary["drafts_offered"] > 0
    assert summary["window_T_histogram"].get(str(MAX + 1), 0) >= 5
    assert summary["controller"]["acceptance_by_position"][0] > 0.8


def test_auto_keeps_output_serial_on_a_looping_random_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.options import SpecOptions

    model = random_model(tiny_qwen3_next_config(vocab_size=16), seed=0)
    rng = random.Random(0)
    for _ in range(3):
        prompt = [rng.randrange(16) for _ in range(12)]
        serial, _ = _decode(model, prompt, SpecOptions(), max_tokens=80)
        auto, summary = _decode(model, prompt, SpecOptions(max_drafts=4, auto=True), max_tokens=80)
        assert auto == serial
        assert summary["drafts_proposed"] == summary["drafts_offered"] + summary["drafts_declined"]


def test_suffix_draft_auto_on_the_cli():
    from click.testing import CliRunner

    from strata_cli.cli import cli

    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "8", "--suffix-draft", "auto:3", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert set(stats["controller"]) == {"cost_prior", "acceptance_by_position", "window_ms_by_T",
                                        "cost_samples_by_T"}
    assert stats["experts"] is None  # no streaming engine: not measured (not zero)
    for value, message in [("auto:0", "auto:N"), ("auto:8", "auto:N"), ("fast", "expected 0..7")]:
        bad = CliRunner().invoke(cli, ["generate", "x", "--suffix-draft", value])
        assert bad.exit_code == 2 and message in bad.output
    cost = CliRunner().invoke(cli, ["generate", "x", "--draft-cost", __file__])
    assert cost.exit_code != 0 and "cannot read a cost curve" in cost.output
