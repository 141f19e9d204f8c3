"""Cache-aware routing (MoCE, mixture of cached experts): approximate, opt-in, counted.

Legend: N = rows, E = experts, k = experts per token, J = protected experts per token.

A `MoceRouter` is a MoE block's `routing_policy` (model/moe.py). For each row it keeps the
natural top-J experts, then fills the other k - J slots by probability after multiplying
resident experts' by exp(B). Rows 1..T-1 of a decode window use the draft knobs; prompt chunks use
the base knobs, or exact routing with `exact_prefill`. With a budget,
at most N experts that are neither resident nor already loading for this window are added
beyond the protected ones; after that a row chooses among those only, and a slot left without
a candidate repeats one of the row's picks with weight 0. The weights are the natural
probabilities of the picks (the block renormalises them as `norm_topk_prob` says).

Counted per block and window (experts/cache.py): substitutions (picks not in the natural
top-k) and the misses this routing saved against exact routing on the same residency.

Router prefetch (experts/cache.py) predicts the next block's picks with this same rule
(`prefetch_picks`) on the predicted router probabilities and that block's residency, which does
not change before the block routes; otherwise it would read natural picks MoCE then replaces by
residents, and those reads would hold the disk (docs/benchmarks.md). `natural_prefetch` keeps
exact routing's prediction.

With `count_inflight`, experts whose read-ahead for this block is in flight count as resident:
for the bonus, the budget and the counters (a miss is then an expert neither resident nor in
flight, the reads routing still adds). Whatever the prefetch read becomes the cheap choice, so the
natural prefetch's hedge (its second guesses) is used rather than wasted.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..options import ConfigError, MoceOptions
from .cache import DECODE, ExpertCache


class MoceRouter:
    """Routing policy of one streamed MoE block.

    Args:
        cache: the expert cache (residency, window kind, counters).
        path: the block's module path.
        options: the MoCE knobs (enabled).
    """

    def __init__(self, cache: ExpertCache, path: str, options: MoceOptions):
        self.cache, self.path, self.options = cache, path, options

    def __call__(self, probs: mx.array, top_k: int) -> tuple[mx.array, mx.array]:
        p = np.array(probs.astype(mx.float32))  # (N, E); routing needs the values on the host
        resident = self.cache.resident_mask(self.path)  # (E,)
        if self.options.count_inflight:  # read ahead for this block: the read is already paid for
            resident = resident | self.cache.inflight_mask(self.path)
        is_decode = self.cache.window_kind == DECODE
        options = self.options
        if not is_decode and options.exact_prefill:
            options = MoceOptions(protect=top_k)  # the natural top-k, counted like any MoCE pick
        inds, mask, natural = select(p, resident, top_k, options, is_decode=is_decode)
        picked = inds[mask]
        substitutions = int(sum(len(set(inds[r][mask[r]].tolist()) - set(natural[r].tolist()))
                                for r in range(len(inds))))
        exact_missing = np.setdiff1d(np.unique(natural), np.nonzero(resident)[0])
        moce_missing = np.setdiff1d(np.unique(picked), np.nonzero(resident)[0])
        self.cache.record_routing(self.path, substitutions=substitutions,
                                  misses_saved=len(exact_missing) - len(moce_missing))
        return mx.array(inds.astype(np.uint32)), mx.array(mask.astype(np.float32))


def select(p: np.ndarray, resident: np.ndarray, top_k: int, options: MoceOptions, *,
           is_decode: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MoCE picks for router probabilities `p` (N, E) given the resident mask (E,).

    Returns:
        inds (N, k) int64, mask (N, k) bool (False: a padding pick with weight 0), and each
        row's natural top-k (N, k).
    """
    N, E = p.shape
    order = np.argsort(-p, axis=-1, kind="stable")  # (N, E), natural ranking
    natural = order[:, :top_k]
    inds = np.zeros((N, top_k), np.int64)
    mask = np.zeros((N, top_k), bool)
    loading = set()  # non-resident experts this window already loads (free to reuse)
    budget = options.budget
    for r in range(N):
        J, B = options.knobs(is_draft=is_decode and r > 0)
        J = min(J, top_k)
        chosen = order[r, :J].tolist()
        loading.update(e for e in chosen if not resident[e])
        score = p[r] * np.where(resident, math.exp(B), 1.0)
        score[chosen] = -1.0
        for e in np.argsort(-score, kind="stable").tolist():
            if len(chosen) == top_k or score[e] < 0:
                break
            if not resident[e] and e not in loading:
                if budget is not None and budget <= 0:
                    continue
                budget = None if budget is None else budget - 1
                loading.add(e)
            chosen.append(e)
        n = len(chosen)
        inds[r, :n], mask[r, :n] = chosen, True
        inds[r, n:] = chosen[0]  # padding: no extra load, weight 0
    return inds, mask, natural


def prefetch_picks(p: np.ndarray, resident: np.ndarray, top_k: int, options: MoceOptions) -> np.ndarray:
    """The experts a decode window's MoCE routing would pick for router probabilities `p` (N, E)
    given the resident mask (E,): the ids of `select`'s real (unpadded) picks, row by row."""
    inds, mask, _ = select(p, resident, top_k, options, is_decode=True)
    return inds[mask]


def attach_moce(cache: ExpertCache, blocks, options: MoceOptions) -> None:
    """Give every streamed block in `blocks` ((path, SparseMoeBlock) pairs) a `MoceRouter`.

    Raises:
        ConfigError: a protect count above the model's experts per token, a block with no
            routing-policy hook (GPT-OSS's), or one whose router has no softmax probabilities to
            rank (`SparseMoeBlock.takes_routing_policy`).
    """
    if not options.is_enabled:
        return
    for path, moe in blocks:
        if not hasattr(moe, "routing_policy"):  # GPT-OSS's block routes by its own rule, with no hook
            raise ConfigError(f"cache-aware routing (--moce-protect) is not supported for {type(moe).__name__} "
                              f"blocks ({path})")
        if not moe.takes_routing_policy:
            block = path.rsplit(".", 1)[0]
            raise ConfigError(f"cache-aware routing (--moce) needs a softmax router; {block} routes by sigmoid "
                              "scores with a correction bias (run without --moce)")
        for name, J in (("--moce-protect", options.protect), ("--draft-moce-protect", options.draft_j)):
            if J > moe.top_k:
                raise ConfigError(f"{name} ({J}) must be at most the model's experts per token ({moe.top_k})")
        moe.routing_policy = MoceRouter(cache, path, options)
        if not options.natural_prefetch:
            cache.set_prefetch_rule(path, lambda p, resident, k=moe.top_k: prefetch_picks(p, resident, k, options))
    cache.is_approximate = True
