"""Draft sources behind one protocol, and the chooser that asks them in turn.

A drafter follows one request: it is built from the request's prompt ids, told every token the
request emits (`extend`), and asked for at most N tokens that continue them (`propose`). Drafts
change how many tokens a window may keep, never which tokens are emitted, so any source is safe
to plug in. A new source is one class with these two methods; `request_drafter` builds the
default chain from the options. Plain Python: no MLX import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Protocol

from .suffix_cache import GlobalSuffixCache
from .suffix_drafter import EMPTY_PROPOSAL, Proposal, SuffixDrafter

SHARED_CACHE = "cache"  # the source name of drafts from earlier requests' outputs


class Drafter(Protocol):
    """Proposes drafts that continue one request's tokens so far."""

    def propose(self, max_drafts: int) -> Proposal: ...

    def extend(self, tokens: Iterable[int]) -> None: ...


class SharedCacheDrafter:
    """One request's view of a cross-request cache (suffix_cache.py): drafts that continue the
    request's tokens from earlier requests' outputs."""

    source = SHARED_CACHE

    def __init__(self, cache: GlobalSuffixCache, prompt_ids: Iterable[int]):
        self.cache = cache
        self.context = list(prompt_ids)

    def propose(self, max_drafts: int) -> Proposal:
        return self.cache.propose_for(self.context, max_drafts)

    def extend(self, tokens: Iterable[int]) -> None:
        self.context.extend(tokens)


class FirstProposal:
    """Asks its drafters in order; the first non-empty proposal wins, tagged with its drafter's
    `source`. Every drafter sees every emitted token."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)

    def propose(self, max_drafts: int) -> Proposal:
        for drafter in self.drafters:
            proposal = drafter.propose(max_drafts)
            if proposal.tokens:
                return replace(proposal, source=getattr(drafter, "source", ""))
        return EMPTY_PROPOSAL

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        for drafter in self.drafters:
            drafter.extend(tokens)


def request_drafter(
    prompt_ids: Sequence[int],
    *,
    max_drafts: int,
    min_match: int,
    shared: Sequence[GlobalSuffixCache] = (),
) -> Drafter | None:
    """The default drafter of one request: a suffix drafter over its own tokens, then (when it
    has nothing) each shared cache of earlier outputs. None when `max_drafts` is 0 (serial)."""
    if not max_drafts:
        return None
    own = SuffixDrafter(prompt_ids, min_match=min_match)
    if not shared:
        return own
    return FirstProposal([own, *(SharedCacheDrafter(cache, prompt_ids) for cache in shared)])
