"""Draft-length controller for `--suffix-draft auto`: how many of a proposal's drafts to verify.

Plain Python: no MLX or numpy import.

The rule (docs/design.md, "Draft-length controller"). With conditional acceptance `a_i` of draft `i`
(given drafts 1..i-1 were accepted) and `q_i = a_1···a_i` (`q_0 = 1`), a window of `D` drafts
emits `E[keep](D) = Σ_{i=0..D} q_i` tokens on average and costs `C(D)` seconds. Starting from
`D = 0` (serial), a longer draft `D'` replaces the current choice `D` only when its marginal
expected output per marginal cost beats the current rate:

    (E(D') - E(D)) / (C(D') - C(D))  >  E(D) / C(D)

which is the same as `E(D')/C(D') > E(D)/C(D)`: the controller picks the draft length with the
best expected tokens per second, the shortest one on a tie (fewer rows, fewer expert reads). The
choice is made before the window runs, so a rejected longer draft never issues its reads. A
hysteresis (`switch_margin`, off by default) can keep the last drafting length unless another
promises a clearly better rate (changing the window size has a cost the per-T estimates miss).

Estimates, both learned online while decoding:

- **Acceptance** by (match-length bucket, draft-position bucket), from smoothed counts: a
  bucket's counts shrink toward what the other match buckets show at that position (each
  position toward the previous one, the first toward a prior, `AcceptancePrior`), scaled by
  how the bucket compared with them at the previous position (see `_curve`). Counts decay a
  little with every proposal (a bucket's own counts with every proposal from that bucket), so
  the estimate follows a request that changes phase (prose, then a copied block), and a bucket
  the controller stopped drafting for drifts back toward its parent and is tried again now
  and then.
- **Probes.** Estimates learn only from windows that verify drafts, so where the priors say no
  draft pays (a steep cost curve: on the CPU a window of 4 rows costs ~2.8 one-row steps) a
  bucket would never be tried, however well its drafts would do. A match bucket with almost
  no evidence of its own is given one draft after `probe_every` declined proposals, when that
  costs at most 4 one-row windows (cold-expert reads included, and the overlapped step a window
  replaces: on the CPU a probe inside a stretch of overlapped steps costs ~2.6): about one
  two-row window per 150 proposals where drafts do not pay, and where they do, the evidence
  to start drafting (on the demo model's agent transcript, 99% of drafts kept).
- **Window cost** by `T`: the median of the last few measured windows of that size, blended
  with a prior where there are few measurements. The prior is a cost *shape* (`CostPrior`:
  cost of `T` rows relative to one row), scaled to the measured windows. A measured curve —
  `scripts/bench/window_cost.py` output, or a plain JSON list of seconds for T = 1, 2, ... — can be the
  shape (`CostPrior.from_json`, `--draft-cost FILE`).

Hook for expert streaming: `choose(..., extra_cost=fn)` adds `fn(T)` predicted seconds (for
example the reads of the cold experts a window of `T` rows is expected to need beyond the
root's) to the cost of each candidate; `observe(..., extra_seconds=s)` says how much of a
measured window was that term, so the per-`T` base cost stays clean.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

# Upper edges (inclusive) of the match-length buckets; longer matches share the last bucket.
MATCH_BUCKET_EDGES = (5, 7, 11, 19, 31)
# Upper edges (inclusive) of the draft-position buckets (1-based position of a draft in a window).
POSITION_BUCKET_EDGES = (1, 2, 3, 5)
NUM_MATCH_BUCKETS = len(MATCH_BUCKET_EDGES) + 1
NUM_POSITION_BUCKETS = len(POSITION_BUCKET_EDGES) + 1

DEFAULT_PRIOR_ACCEPTANCE = 0.5
DEFAULT_PRIOR_STRENGTH = 2.0  # pseudo-observations behind the prior
DEFAULT_POOL_STRENGTH = 2.0  # pseudo-observations a bucket borrows from its parent estimate
DEFAULT_DECAY = 0.99  # count decay per proposal: a memory of about 100 proposals
DEFAULT_COST_SLOPE = 0.3  # prior cost of T rows: 1 + slope·(T-1) times the cost of one row
DEFAULT_COST_WINDOW = 16  # measured windows per T whose median is the measured cost
DEFAULT_COST_STRENGTH = 2.0  # pseudo-measurements behind the prior cost of each T
DEFAULT_COST_TRUST = 3  # samples of a T before its cost may exceed its prior (one slow window locks nothing out)
DEFAULT_SWITCH_MARGIN = 0.0  # hysteresis between drafting lengths (relative rate); off by default
DEFAULT_COST_MEMORY = 256  # windows after which a cost sample expires (a length not run lately is re-measured)
DEFAULT_WARMUP_WINDOWS = 1  # first windows of a request pay one-time costs: not cost samples
DEFAULT_STALL_FACTOR = 4.0  # a cost sample counts as at most this many times its T's current estimate
DEFAULT_PROBE_EVERY = 4  # declined proposals of a match bucket with no evidence of its own before one draft is tried
PROBE_EVIDENCE = 0.25  # a bucket's own (decayed) observations of its first draft below which it has no evidence
PROBE_COST_LIMIT = 4.0  # most one-row windows a probe may cost (cold-expert reads, an abandoned overlapped step)


class CostCurveError(ValueError):
    """A cost-curve file that cannot be used as the controller's cost prior."""


def match_bucket(match_length: int) -> int:
    """Bucket index of a suffix match length (0 for the shortest matches)."""
    return bisect_right(MATCH_BUCKET_EDGES, match_length - 1) if match_length > 0 else 0


def position_bucket(position: int) -> int:
    """Bucket index of a 1-based draft position in a window."""
    return bisect_right(POSITION_BUCKET_EDGES, position - 1)


@dataclass(frozen=True)
class AcceptancePrior:
    """What the controller believes about acceptance before it has seen a window.

    Args:
        mean: prior conditional acceptance of every draft (default 0.5).
        strength: how many observations the prior is worth (default 2).
    """

    mean: float = DEFAULT_PRIOR_ACCEPTANCE
    strength: float = DEFAULT_PRIOR_STRENGTH

    def __post_init__(self):
        if not 0.0 <= self.mean <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {self.mean}")
        if not self.strength > 0:
            raise ValueError(f"prior strength must be positive, got {self.strength}")


@dataclass(frozen=True)
class CostPrior:
    """Prior window cost by `T`, as a shape relative to a one-row window.

    `relative[t - 1]` is the cost of a window of `t` rows divided by the cost of one row; past
    the end of the list the last step is extended linearly. `seconds_per_row` optionally fixes
    the absolute scale of `T = 1` until windows are measured (the decision itself only needs
    the shape, since scaling every cost leaves the rule unchanged; the scale matters only next
    to an `extra_cost` term given in seconds).

    Args:
        relative: cost of T = 1, 2, ... rows relative to T = 1 (first entry 1.0).
        seconds_per_row: absolute cost of T = 1 in seconds, or None (default) for unknown.
        source: where the curve came from, for telemetry: "builtin" (default), "file:<path>",
            "calibrated" (measured at start on this device) or "cached" (an earlier calibration).
    """

    relative: tuple[float, ...] = (1.0, 1.0 + DEFAULT_COST_SLOPE)
    seconds_per_row: float | None = None
    source: str = "builtin"

    def __post_init__(self):
        if len(self.relative) < 1 or any(not (v > 0 and math.isfinite(v)) for v in self.relative):
            raise CostCurveError(f"relative costs must be positive and finite, got {self.relative}")
        if abs(self.relative[0] - 1.0) > 1e-9:
            raise CostCurveError(f"relative costs start at T = 1 with 1.0, got {self.relative[0]}")

    @classmethod
    def linear(cls, slope: float = DEFAULT_COST_SLOPE) -> "CostPrior":
        """Cost of T rows = (1 + slope·(T-1)) times one row."""
        if slope < 0:
            raise CostCurveError(f"cost slope must be non-negative, got {slope}")
        return cls(relative=(1.0, 1.0 + slope))

    @classmethod
    def from_seconds(cls, seconds: Sequence[float], *, source: str = "builtin") -> "CostPrior":
        """A measured curve: `seconds[t - 1]` is the cost of a window of `t` rows."""
        seconds = [float(s) for s in seconds]
        if not seconds or any(not (s > 0 and math.isfinite(s)) for s in seconds):
            raise CostCurveError(f"a cost curve needs positive seconds for T = 1, 2, ..., got {seconds}")
        return cls(relative=tuple(s / seconds[0] for s in seconds), seconds_per_row=seconds[0], source=source)

    @classmethod
    def from_json(cls, path: str | Path) -> "CostPrior":
        """Read a cost curve: `scripts/bench/window_cost.py` output, or a JSON list of seconds per T.

        The window_cost file holds `{"curve": [{"T": 1, "median_s": ...}, ...]}`; its T values
        must run 1, 2, 3, ... without gaps.

        Raises:
            CostCurveError: unreadable file, or a curve that does not start at T = 1.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CostCurveError(f"{path}: cannot read a cost curve ({e})") from None
        if isinstance(data, dict):
            rows = data.get("curve")
            if not isinstance(rows, list) or not rows:
                raise CostCurveError(f"{path}: expected a 'curve' list of {{T, median_s}} rows")
            try:
                ts = [int(row["T"]) for row in rows]
                seconds = [float(row["median_s"]) for row in rows]
            except (KeyError, TypeError, ValueError) as e:
                raise CostCurveError(f"{path}: curve rows need T and median_s ({e})") from None
            if ts != list(range(1, len(ts) + 1)):
                raise CostCurveError(f"{path}: curve T values must be 1, 2, 3, ... got {ts}")
        elif isinstance(data, list):
            seconds = data
        else:
            raise CostCurveError(f"{path}: expected a JSON object or list, got {type(data).__name__}")
        try:
            return cls.from_seconds(seconds, source=f"file:{path}")
        except (CostCurveError, TypeError, ValueError) as e:
            raise CostCurveError(f"{path}: {e}") from None

    def shape(self, T: int) -> float:
        """Relative cost of a window of `T` rows (T >= 1)."""
        if T <= len(self.relative):
            return self.relative[T - 1]
        last = self.relative[-1]
        step = last - self.relative[-2] if len(self.relative) > 1 else 0.0
        return last + max(step, 0.0) * (T - len(self.relative))


@dataclass(frozen=True)
class Plan:
    """One decision and what it rested on.

    Attributes:
        drafts: drafts to verify (0 = run the root alone).
        expected_keep: E[keep](D) for D = 0..available.
        cost: predicted seconds (or relative cost) of a window of D drafts, D = 0..available.
    """

    drafts: int
    expected_keep: tuple[float, ...]
    cost: tuple[float, ...]


class _Counts:
    """Decayed accepted/observed counts for one acceptance bucket."""

    __slots__ = ("accepted", "observed")

    def __init__(self):
        self.accepted = 0.0
        self.observed = 0.0


class DraftController:
    """Chooses the draft length per window from online acceptance and cost estimates.

    Use it as a pair of calls around each window: `choose` before the run (how many of the
    proposal's drafts to verify), `observe` after the commit (what the window cost and kept).

    Args:
        max_drafts: most drafts per window (the `auto:N` maximum).
        acceptance_prior: prior acceptance and its strength (default `AcceptancePrior()`).
        cost_prior: prior cost shape by T (default linear, 1 + 0.3·(T-1)).
        pool_strength: pseudo-observations a bucket borrows from its parent (default 2).
        decay: count decay per proposal, in (0, 1] (default 0.99; 1 = never forget).
        cost_window: measured windows per T whose median is that T's measured cost (default 16).
        cost_trust: samples of a T below which its estimate never exceeds its prior (default 3):
            until then the controller stays optimistic, so a single window slowed by something
            else (another process, a page fault) cannot stop a draft length from being tried.
        cost_memory: windows after which a cost sample is forgotten (default 256), so a length
            measured during a slow spell is measured again.
        switch_margin: a drafting length other than the last one chosen (for proposals of the
            same match-length bucket) must promise a rate this much higher to replace it
            (default 0: off). Near the optimum the rates are flat and noisy, and on MLX's CPU
            backend alternating window sizes cost each window 15-40% against a steady size,
            which the per-T estimates do not see; a margin trades that against converging less
            exactly (docs/history.md).
        cost_strength: pseudo-measurements behind each T's prior cost (default 2).
        warmup_windows: first windows whose time is not a cost sample (default 1: the first
            window of a request pays one-time costs).
        stall_factor: a measured window enters its T's cost samples as at most this many times
            that T's current estimate (default 4). One stall (a kernel compiled for a new shape,
            a page fault, another process) then moves a median by one sample of bounded size
            and cannot leak into the scale of the other T; a lasting slowdown is still learned,
            the estimate rising by up to this factor per refresh of the samples.
        probe_every: declined proposals of a match bucket, while it has almost no evidence of
            its own, after which one draft is verified anyway (default 4; 0: never probe).
    """

    def __init__(
        self,
        max_drafts: int,
        *,
        acceptance_prior: AcceptancePrior | None = None,
        cost_prior: CostPrior | None = None,
        pool_strength: float = DEFAULT_POOL_STRENGTH,
        decay: float = DEFAULT_DECAY,
        cost_window: int = DEFAULT_COST_WINDOW,
        cost_strength: float = DEFAULT_COST_STRENGTH,
        cost_trust: int = DEFAULT_COST_TRUST,
        cost_memory: int = DEFAULT_COST_MEMORY,
        switch_margin: float = DEFAULT_SWITCH_MARGIN,
        warmup_windows: int = DEFAULT_WARMUP_WINDOWS,
        stall_factor: float = DEFAULT_STALL_FACTOR,
        probe_every: int = DEFAULT_PROBE_EVERY,
    ):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be at least 1 for a controller, got {max_drafts}")
        if switch_margin < 0:
            raise ValueError(f"switch_margin must be non-negative, got {switch_margin}")
        if not stall_factor > 1.0:
            raise ValueError(f"stall_factor must be above 1, got {stall_factor}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if pool_strength <= 0 or cost_strength <= 0:
            raise ValueError("pool_strength and cost_strength must be positive")
        if cost_window < 1 or cost_memory < 1 or cost_trust < 0 or warmup_windows < 0 or probe_every < 0:
            raise ValueError("cost_window and cost_memory must be at least 1, cost_trust, warmup_windows and "
                             "probe_every non-negative")
        self.max_drafts = max_drafts
        self.acceptance_prior = acceptance_prior or AcceptancePrior()
        self.cost_prior = cost_prior or CostPrior.linear()
        self.pool_strength = pool_strength
        self.decay = decay
        self.cost_strength = cost_strength
        self.warmup_windows = warmup_windows
        self.cost_trust = cost_trust
        self.cost_memory = cost_memory
        self.switch_margin = switch_margin
        self.stall_factor = stall_factor
        self._cells = [[_Counts() for _ in range(NUM_POSITION_BUCKETS)] for _ in range(NUM_MATCH_BUCKETS)]
        self._pooled = [_Counts() for _ in range(NUM_POSITION_BUCKETS)]
        # T -> (window index, seconds) of its recent windows, oldest first
        self._costs: dict[int, deque[tuple[int, float]]] = {
            T: deque(maxlen=cost_window) for T in range(1, max_drafts + 2)
        }
        self._medians: dict[int, float] = {}  # T -> median of self._costs[T], for measured T only
        self._windows_seen = 0
        self._last_drafts = [0] * NUM_MATCH_BUCKETS  # last length chosen per match bucket (hysteresis)
        self.probe_every = probe_every
        self._declined = [0] * NUM_MATCH_BUCKETS  # proposals declined in a row per match bucket (probes)

    # -- estimates -----------------------------------------------------------------------------

    def acceptance(self, match_length: int, position: int) -> float:
        """Estimated conditional acceptance of the draft at 1-based `position` in a window whose
        proposal came from a suffix match of `match_length` tokens."""
        return self._curve(match_bucket(match_length))[position_bucket(position)]

    def _pooled_curve(self) -> list[float]:
        """Acceptance by position bucket over every match bucket (each position shrinks toward
        the previous one, the first toward the prior)."""
        pooled, estimate, strength = [], self.acceptance_prior.mean, self.acceptance_prior.strength
        for c in self._pooled:
            estimate = (c.accepted + strength * estimate) / (c.observed + strength)
            pooled.append(estimate)
            strength = self.pool_strength
        return pooled

    def _curve(self, mb: int) -> list[float]:
        """Acceptance estimates of match bucket `mb` for every position bucket.

        Each estimate is the bucket's own counts shrunk toward a parent. The parent comes from
        the other match buckets at that position (their pooled counts without this bucket's,
        so no evidence counts twice), each position shrunk toward the previous one and the
        first toward the prior; past the first position it is scaled by how this bucket
        compared with the others at the previous position. So a bucket with no data of its
        own at a position follows its own previous position, shaped like the others' curve:
        a kind of match rejected early is expected to be rejected more later too.
        """
        curve: list[float] = []
        others, strength = self.acceptance_prior.mean, self.acceptance_prior.strength
        for pb, (pool, own) in enumerate(zip(self._pooled, self._cells[mb])):
            previous = others
            accepted = max(pool.accepted - own.accepted, 0.0)
            observed = max(pool.observed - own.observed, 0.0)
            others = (accepted + strength * others) / (observed + strength)
            strength = self.pool_strength
            parent = others if pb == 0 else min(1.0, others * curve[-1] / previous) if previous > 0 else curve[-1]
            curve.append((own.accepted + self.pool_strength * parent) / (own.observed + self.pool_strength))
        return curve

    def window_cost(self, T: int) -> float:
        """Estimated seconds of a window of `T` rows.

        A measured T blends the median of its recent windows with its prior; the prior of any T
        is the prior shape scaled to the well-measured windows around it (the scale factor
        measured/shape is interpolated over T, and held past the measured ends), so an
        unmeasured T is predicted from its measured neighbours. Until a T has `cost_trust`
        samples its estimate does not exceed its prior.
        """
        prior = self._scale_near(T) * self.cost_prior.shape(T)
        measured = self._medians.get(T)
        if measured is None:
            return prior
        n = len(self._costs[T])
        blend = (n * measured + self.cost_strength * prior) / (n + self.cost_strength)
        return min(blend, prior) if n < self.cost_trust else blend

    def _scale_near(self, T: int) -> float:
        """Measured/shape scale at T, from the other well-measured T (else T itself when it is
        well measured, else any other measured T, else T itself).

        A T with a sample or two (perhaps one stall) scales the others only when nothing is well
        measured yet."""
        measured = sorted(self._medians.items())
        trusted = [(t, m) for t, m in measured if len(self._costs[t]) >= self.cost_trust]
        others = ([(t, m) for t, m in trusted if t != T] or trusted
                  or [(t, m) for t, m in measured if t != T] or measured)
        points = [(t, m / self.cost_prior.shape(t)) for t, m in others]
        if not points:
            return self.cost_prior.seconds_per_row or 1.0
        if T <= points[0][0]:
            return points[0][1]
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if T <= t1:
                return s0 + (s1 - s0) * (T - t0) / (t1 - t0)
        return points[-1][1]

    # -- decisions -----------------------------------------------------------------------------

    def plan(
        self, match_length: int, available: int, *, extra_cost: Callable[[int], float] | None = None
    ) -> Plan:
        """Apply the marginal rule to a proposal of `available` drafts from a match of
        `match_length` tokens.

        Args:
            match_length: the proposal's suffix match length (0 = no proposal).
            available: drafts the proposal offers after the window's safety caps.
            extra_cost: optional predicted extra seconds of a window of T rows (cold-expert
                reads beyond the root's, for example); default none.

        Returns:
            The `Plan`: the chosen number of drafts and the curves it compared.
        """
        available = max(0, min(available, self.max_drafts)) if match_length > 0 else 0
        curve = self._curve(match_bucket(match_length)) if available else []
        expected, q = [1.0], 1.0
        for i in range(1, available + 1):
            q *= curve[position_bucket(i)]
            expected.append(expected[-1] + q)
        cost = []
        for D in range(available + 1):
            c = self.window_cost(D + 1) + (extra_cost(D + 1) if extra_cost else 0.0)
            cost.append(max(c, 1e-12))
        best = 0
        for D in range(1, available + 1):
            gain, spend = expected[D] - expected[best], cost[D] - cost[best]
            rate = expected[best] / cost[best]
            # ΔE/ΔC > E/C; a longer draft that costs no more and gains anything is better.
            if gain > 0 and (spend <= 0 or gain / spend > rate):
                best = D
        last = self._last_drafts[match_bucket(match_length)]
        if best > 0 and 0 < last <= available and last != best:
            # Hysteresis: every new window size costs (buffers of a new shape, on some backends
            # a new kernel), so a drafting length stays unless another beats it by a margin.
            if expected[last] / cost[last] * (1 + self.switch_margin) >= expected[best] / cost[best]:
                best = last
        return Plan(drafts=best, expected_keep=tuple(expected), cost=tuple(cost))

    def choose(
        self, match_length: int, available: int, *, extra_cost: Callable[[int], float] | None = None
    ) -> int:
        """How many of the proposal's drafts to verify (0..available); see `plan`, and probes
        (the module docstring)."""
        plan = self.plan(match_length, available, extra_cost=extra_cost)
        drafts = plan.drafts
        if match_length > 0 and available > 0:
            mb = match_bucket(match_length)
            if drafts == 0 and self._probe_due(mb) and plan.cost[1] <= PROBE_COST_LIMIT * plan.cost[0]:
                drafts = 1
            self._declined[mb] = self._declined[mb] + 1 if drafts == 0 else 0
            self._last_drafts[mb] = drafts
        return drafts

    def _probe_due(self, mb: int) -> bool:
        """Whether match bucket `mb` has declined `probe_every` proposals in a row while its own
        evidence about its first draft is (all but) none."""
        return (self.probe_every > 0 and self._declined[mb] + 1 >= self.probe_every
                and self._cells[mb][0].observed < PROBE_EVIDENCE)

    # -- learning ------------------------------------------------------------------------------

    def observe(
        self,
        *,
        T: int,
        keep: int,
        seconds: float,
        match_length: int = 0,
        extra_seconds: float = 0.0,
        acceptance: Sequence[float] | None = None,
    ) -> None:
        """Learn from one finished window.

        Args:
            T: rows the window ran (root + drafts).
            keep: inputs the greedy verification kept (1 + accepted drafts), before any
                end-of-sequence cut.
            seconds: measured wall time of the window.
            match_length: the proposal's match length (0 when there was none); the window
                teaches acceptance only when it verified drafts.
            extra_seconds: the part of `seconds` that an `extra_cost` term accounts for.
            acceptance: when sampling, the probability p_i(d_i) each judged draft had of being
                accepted (speculative/acceptance.py), learned instead of the 0/1 outcome: the same
                expectation with less noise. None (default) = greedy 0/1 outcomes.
        """
        if not 1 <= keep <= T:
            raise ValueError(f"keep must be in 1..{T} (T), got {keep}")
        self._windows_seen += 1
        if self._windows_seen > self.warmup_windows and T in self._costs:
            sample = min(max(seconds - extra_seconds, 0.0), self.stall_factor * self.window_cost(T))
            self._costs[T].append((self._windows_seen, sample))
            self._medians[T] = median(s for _, s in self._costs[T])
        self._expire_costs()
        if match_length <= 0:
            return
        mb = match_bucket(match_length)
        if self.decay < 1.0:
            # The pooled counts forget per proposal; a match bucket's own counts per proposal
            # of that bucket, so a rare kind of match keeps what it learned while others run.
            for c in (*self._pooled, *self._cells[mb]):
                c.accepted *= self.decay
                c.observed *= self.decay
        # Drafts 1..keep-1 were accepted; draft `keep` (if it ran) was the first rejected; the
        # rest were never judged (conditional acceptance is only defined after an acceptance).
        for position in range(1, min(keep, T - 1) + 1):
            accepted = position < keep if acceptance is None else acceptance[position - 1]
            pb = position_bucket(position)
            for c in (self._cells[mb][pb], self._pooled[pb]):
                c.observed += 1.0
                c.accepted += float(accepted)

    def _expire_costs(self) -> None:
        oldest = self._windows_seen - self.cost_memory
        for T, samples in self._costs.items():
            if samples and samples[0][0] <= oldest:
                while samples and samples[0][0] <= oldest:
                    samples.popleft()
                if samples:
                    self._medians[T] = median(s for _, s in samples)
                else:
                    self._medians.pop(T, None)

    def snapshot(self) -> dict:
        """What the controller has learned, as plain data (for telemetry)."""
        return {
            "cost_prior": self.cost_prior.source,
            "acceptance_by_position": [round(a, 4) for a in self._pooled_curve()],
            "window_ms_by_T": {
                str(T): round(1000 * self.window_cost(T), 4) for T in range(1, self.max_drafts + 2)
            },
            "cost_samples_by_T": {str(T): len(s) for T, s in self._costs.items() if s},
        }
