"""Stop strings over streamed text: cut at the first one, and never stream part of one.

The matcher holds back the longest tail of the text seen so far that could still grow into a
stop string. Any later occurrence must then start inside the held tail, so text already
released can never turn out to contain (part of) a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds text deltas through a set of stop strings.

    Args:
        stops: the stop strings (non-empty); none means text passes straight through.
    """

    def __init__(self, stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add `delta`; return the text that is now safe to release.

        After a stop string completes, `stopped` is True, the text before it is returned, and
        everything from the stop string on is dropped (further feeds return "").
        """
        if self.stopped:
            return ""
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Release the held tail (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
