"""Sigmoid routing with a score-correction bias and group-limited top-k (DeepSeek-V3's `noaux_tc`,
also Nemotron-H's and Kimi's routers), in float32 as transformers computes it.

Each expert scores sigmoid(logit); the choice ranks score + `e_score_correction_bias`, only within
the `topk_group` of `n_group` groups whose two best biased scores sum highest; the picks weigh
their unbiased scores, renormalised (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class GroupLimitedTopK:
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def choice(self, scores: mx.array, bias: mx.array) -> mx.array:
        """scores (N, E) float32 -> the biased scores the top-k ranks, -inf outside the kept groups."""
        choice = scores + bias.astype(mx.float32)
        if self.n_group > 1:
            N, E = choice.shape
            group_scores = mx.topk(choice.reshape(N, self.n_group, -1), 2, axis=-1).sum(axis=-1)  # (N, groups)
            threshold = mx.sort(group_scores, axis=-1)[:, self.n_group - self.topk_group, None]
            kept = mx.repeat(group_scores >= threshold, E // self.n_group, axis=-1)
            choice = mx.where(kept, choice, -mx.inf)
        return choice

    def weigh(self, scores: mx.array, inds: mx.array, mask: mx.array | None = None) -> mx.array:
        """The picks' weights: their unbiased scores (times `mask`), renormalised, scaled."""
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if mask is not None:
            weights = weights * mask
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor

    def __call__(self, scores: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
        """scores (N, E) sigmoid, float32 -> expert ids (N, k) and their weights (N, k)."""
        choice = self.choice(scores, bias)
        inds = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        return inds, self.weigh(scores, inds)
