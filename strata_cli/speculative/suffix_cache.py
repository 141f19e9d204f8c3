"""A cross-request suffix cache: drafts from earlier requests' outputs.

SuffixDecoding keeps a global suffix tree over past outputs beside each request's own tree. Here
the global index is a `SuffixDrafter` over a bounded ring of past outputs, each followed by a
separator that no real token equals, so a match never runs across two outputs and a draft never
continues past the end of one. The decode loop consults it only when the request's own drafter
has nothing (`drafters.request_drafter(..., shared=[cache])`). Plain Python: no MLX import.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from .suffix_drafter import DEFAULT_MIN_MATCH, EMPTY_PROPOSAL, Proposal, SuffixDrafter

SEPARATOR = -1  # ends each output in the shared history; token ids are >= 0
# When full, drop the oldest outputs until at most this share of the budget is held, so the
# index is rebuilt once per quarter-budget of new output rather than once per request.
REFILL_SHARE = 0.75


class GlobalSuffixCache:
    """Past outputs, bounded in tokens, as one suffix index.

    Args:
        max_tokens (int): Most output tokens held (separators not counted); at least 1.
        min_match (int): Shortest suffix match that may propose drafts. Default: ``4``.
    """

    def __init__(self, max_tokens: int, *, min_match: int = DEFAULT_MIN_MATCH):
        if max_tokens < 1:
            raise ValueError(f"max_tokens ({max_tokens}) must be at least 1")
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._outputs: deque[tuple[int, ...]] = deque()
        self._held = 0
        self._index = SuffixDrafter(min_match=min_match)

    @property
    def num_tokens(self) -> int:
        """Output tokens held now (never more than `max_tokens`)."""
        return self._held

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Iterable[int]) -> None:
        """Remember one request's output; an output longer than the budget keeps its tail.

        Args:
            tokens (Iterable[int]): The generated token ids (end-of-sequence excluded).
        """
        output = tuple(int(t) for t in tokens)[-self.max_tokens :]
        if not output:
            return
        self._outputs.append(output)
        self._held += len(output)
        if self._held <= self.max_tokens:
            self._index.extend(output)
            self._index.append(SEPARATOR)
            return
        target = int(self.max_tokens * REFILL_SHARE)
        while self._held > target and len(self._outputs) > 1:
            self._held -= len(self._outputs.popleft())
        self._index = SuffixDrafter(min_match=self.min_match)
        for kept in self._outputs:
            self._index.extend(kept)
            self._index.append(SEPARATOR)

    def propose_for(self, context: Sequence[int], max_drafts: int) -> Proposal:
        """Drafts that continue `context` (a request's tokens) from some earlier output.

        Args:
            context (Sequence[int]): The request's history (prompt and emitted tokens).
            max_drafts (int): Most drafts to return.

        Returns:
            Proposal: drafts that stop at the end of the output they come from; empty when no
            earlier output matches `context`'s suffix by at least `min_match` tokens.
        """
        proposal = self._index.propose_for(context, max_drafts)
        drafts = proposal.tokens
        if SEPARATOR in drafts:
            drafts = drafts[: drafts.index(SEPARATOR)]
        if not drafts:
            return EMPTY_PROPOSAL
        return Proposal(tokens=drafts, match_length=proposal.match_length, position=proposal.position)
