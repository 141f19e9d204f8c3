"""Window planning: how many drafts the next window verifies, and which.

The drafter proposes; the safe window caps the proposal by the token budget, the context and
the engine's block rule (safe_window.py); the draft-length controller, under `auto`, chooses
how many of the rest are worth their cost (controller.py) — before any expert read is issued.
The planner also learns from what ran: each window's cost and keep go to the controller, each
emitted token to the drafter. Plain Python: no MLX import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .controller import DraftController
from .drafters import SHARED_CACHE, Drafter
from .safe_window import QSA_BLOCK, safe_window
from .suffix_drafter import EMPTY_PROPOSAL, Proposal


@dataclass(frozen=True)
class WindowPlan:
    """One window: its rows (root + drafts) and the proposal they came from.

    Attributes:
        proposal: what the drafter offered.
        rows: T, the window's rows (1 = no drafts).
        proposed: drafts the proposal offered after the safe window's caps (T - 1 <= proposed;
            the controller declined the difference).
    """

    proposal: Proposal
    rows: int
    proposed: int

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.proposal.tokens[: self.rows - 1]

    @property
    def match_length(self) -> int:
        """The proposal's match length, 0 when nothing was proposed (telemetry)."""
        return self.proposal.match_length if self.proposed else 0

    @property
    def from_cache(self) -> bool:
        """Whether the window verifies drafts from the cross-request cache."""
        return self.rows > 1 and self.proposal.source == SHARED_CACHE


class WindowPlanner:
    """Plans each window of one request.

    Args:
        drafter: the request's draft source (drafters.py), or None for serial decoding.
        max_drafts: most drafts per window.
        controller: the draft-length controller (`auto`), or None to verify every proposed draft.
        context_left: positions free at and after a root position (the engine's).
        block_cap: whether the engine needs the QSA block cap (safe_window.py).
        block: cells per block of that cap.
        read_cost: `read_cost(T)`, predicted seconds of expert reads a window of T rows costs
            beyond the controller's curve (streamed experts), or None.
    """

    def __init__(
        self,
        drafter: Drafter | None,
        *,
        max_drafts: int,
        controller: DraftController | None,
        context_left: Callable[[int], int],
        block_cap: bool = False,
        block: int = QSA_BLOCK,
        read_cost: Callable[[int], float] | None = None,
    ):
        self.drafter = drafter if max_drafts else None
        self.max_drafts = max_drafts
        self.controller = controller if self.drafter is not None else None
        self.context_left = context_left
        self.block_cap = block_cap
        self.block = block
        self.read_cost = read_cost
        self.pending: WindowPlan | None = None  # planned after a one-token step (`after_step`)
        # (drafts proposed, match length) of the plan the next one-token step runs without:
        # drafts the controller declined there are counted as a declined window's are.
        self.declined = (0, 0)

    def plan(self, pos0: int, remaining: int) -> WindowPlan:
        """The window rooted at `pos0` with `remaining` tokens of budget left."""
        if self.pending is not None:
            plan, self.pending = self.pending, None
            return plan
        return self._plan(pos0, remaining, self.read_cost)

    def _plan(self, pos0: int, remaining: int, extra_cost: Callable[[int], float] | None) -> WindowPlan:
        proposal = self.drafter.propose(self.max_drafts) if self.drafter is not None else EMPTY_PROPOSAL
        T = safe_window(num_drafts=len(proposal.tokens), remaining_tokens=remaining,
                        context_left=self.context_left(pos0), pos0=pos0, block_cap=self.block_cap,
                        block=self.block)
        proposed = T - 1
        if self.controller is not None and proposed:
            T = 1 + self.controller.choose(proposal.match_length, proposed, extra_cost=extra_cost)
        return WindowPlan(proposal, T, proposed)

    def decline(self, plan: WindowPlan) -> None:
        """The next one-token step runs without `plan`'s proposed drafts."""
        self.declined = (plan.proposed, plan.match_length)

    def after_step(self, token: int, seconds: float, pos0: int, remaining: int) -> bool:
        """After an overlapped one-token step (decode.overlapped_serial's `after`): learn its cost,
        extend the drafts' history, and say whether the next window should verify drafts (its
        plan is kept for the next `plan`)."""
        if self.controller is not None:
            self.controller.observe(T=1, keep=1, seconds=seconds)
        self.extend([token])
        plan = self._plan(pos0, remaining, self._abandoned_step)
        if plan.rows == 1:
            self.decline(plan)
            return False
        self.pending = plan
        return True

    def _abandoned_step(self, T: int) -> float:
        """Drafts chosen after an overlapped step also cost the step already launched on the
        token, which the window replaces (its work is thrown away)."""
        return self.controller.window_cost(1) if T > 1 else 0.0

    def learn(self, plan: WindowPlan, *, verified: int, seconds: float, extra_seconds: float = 0.0,
              acceptance: list[float] | None = None) -> None:
        """What a window of `plan` cost and kept (`verified`: its keep before an EOS cut)."""
        if self.controller is not None:
            self.controller.observe(T=plan.rows, keep=verified, seconds=seconds,
                                    match_length=plan.proposal.match_length, extra_seconds=extra_seconds,
                                    acceptance=acceptance)

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens the request emitted: the drafter's history grows."""
        if self.drafter is not None:
            self.drafter.extend(tokens)
