"""Model-free draft proposals from the request's own tokens.

A trigram index maps each three-token sequence to the few most recent places it
ended in the history. To propose, the drafter looks up the history's last
trigram, extends each candidate match backwards, and offers the tokens that
followed the longest (then most recent) match. Plain Python: no MLX import.
"""

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MIN_MATCH = 4
POSITIONS_PER_TRIGRAM = 4
# Longest backward extension measured; bounds propose() to O(candidates * MAX_MATCH).
MAX_MATCH = 64

_TRIGRAM = 3


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and where they came from.

    Attributes:
        tokens: The proposed drafts, possibly fewer than asked for; ``()`` when
            nothing qualified.
        match_length: Length of the matched suffix (capped at ``MAX_MATCH``),
            ``0`` when empty.
        position: History index where the matched suffix ends; the drafts are
            ``history[position + 1:]``. ``-1`` when empty.
        source: Which drafter proposed it (a drafter's ``source``; drafters.py).
    """

    tokens: tuple[int, ...] = ()
    match_length: int = 0
    position: int = -1
    source: str = ""


EMPTY_PROPOSAL = Proposal()


class SuffixDrafter:
    """Proposes drafts by matching the history's suffix against its own past.

    Build it from the request's final token ids, then extend it with emitted
    outputs only (rejected drafts never enter the history).

    Args:
        tokens (Iterable[int]): Initial history. Default: ``()``.
        min_match (int): Shortest suffix match that may propose drafts; at
            least 3, since the index is of trigrams. Default: ``4``.
        max_positions (int): How many recent end positions each trigram keeps.
            Default: ``4``.
    """

    source = "suffix"

    def __init__(
        self,
        tokens: Iterable[int] = (),
        *,
        min_match: int = DEFAULT_MIN_MATCH,
        max_positions: int = POSITIONS_PER_TRIGRAM,
    ):
        if not _TRIGRAM <= min_match <= MAX_MATCH:
            raise ValueError(
                f"min_match ({min_match}) must be between {_TRIGRAM} and {MAX_MATCH}: "
                "the index is of trigrams and matches are measured up to MAX_MATCH"
            )
        if max_positions < 1:
            raise ValueError(f"max_positions ({max_positions}) must be at least 1")
        self._min_match = min_match
        self._max_positions = max_positions
        self._history: list[int] = []
        self._index: dict[tuple[int, int, int], deque[int]] = {}
        self.extend(tokens)

    @property
    def min_match(self) -> int:
        """Shortest suffix match that may propose drafts (read-only)."""
        return self._min_match

    @property
    def max_positions(self) -> int:
        """Recent end positions kept per trigram (read-only: the index is built with it)."""
        return self._max_positions

    def __len__(self) -> int:
        return len(self._history)

    @property
    def history(self) -> tuple[int, ...]:
        """The token history as a tuple (a copy: the drafter owns the list)."""
        return tuple(self._history)

    def append(self, token: int) -> None:
        """Add one token to the history in O(1).

        Args:
            token (int): The token id.
        """
        h = self._history
        h.append(int(token))
        # Index the trigram ending just before the new token only now that it has
        # a continuation: a lookup never finds the current suffix itself.
        p = len(h) - 2
        if p >= _TRIGRAM - 1:
            key = (h[p - 2], h[p - 1], h[p])
            ends = self._index.get(key)
            if ends is None:
                ends = self._index[key] = deque(maxlen=self._max_positions)
            ends.append(p)  # newest last; the oldest falls off

    def extend(self, tokens: Iterable[int]) -> None:
        """Add tokens to the history, in order.

        Args:
            tokens (Iterable[int]): The token ids.
        """
        for token in tokens:
            self.append(token)

    def propose(self, max_drafts: int) -> Proposal:
        """Propose drafts that continue the history.

        Args:
            max_drafts (int): Most drafts to return; ``0`` returns an empty proposal.

        Returns:
            Proposal: ``history[p + 1 : p + 1 + max_drafts]`` for the candidate end
            ``p`` with the longest match of at least ``min_match`` tokens (the
            most recent on a tie), or an empty proposal when none qualifies.
        """
        return self.propose_for(self._history, max_drafts)

    def propose_for(self, context: Sequence[int], max_drafts: int) -> Proposal:
        """Propose drafts that continue `context` from this drafter's history.

        ``propose(d)`` is ``propose_for(history, d)``; another sequence as
        `context` lets one drafter serve as a shared index of earlier text (a
        cross-request cache matches a request's tokens against past outputs).

        Args:
            context (Sequence[int]): The tokens whose suffix is matched.
            max_drafts (int): Most drafts to return; ``0`` returns an empty proposal.

        Returns:
            Proposal: as for ``propose``; `position` indexes this drafter's history.
        """
        if max_drafts < 0:
            raise ValueError(f"max_drafts ({max_drafts}) must be non-negative")
        h, c = self._history, context
        n = len(c)
        if max_drafts == 0 or n < _TRIGRAM:
            return EMPTY_PROPOSAL
        ends = self._index.get((c[n - 3], c[n - 2], c[n - 1]))
        if not ends:
            return EMPTY_PROPOSAL
        best_len, best_pos = 0, -1
        for p in reversed(ends):  # newest first, so a tie keeps the most recent
            # The trigram key already matched j = 0..2; extend from j = 3.
            limit = min(MAX_MATCH, p + 1, n)
            length = _TRIGRAM
            while length < limit and h[p - length] == c[n - 1 - length]:
                length += 1
            if length > best_len:
                best_len, best_pos = length, p
        if best_len < self._min_match:
            return EMPTY_PROPOSAL
        drafts = tuple(h[best_pos + 1 : best_pos + 1 + max_drafts])
        return Proposal(tokens=drafts, match_length=best_len, position=best_pos)
