"""Choosing each window row's token: greedy argmax, or a seeded draw from the processed
distribution (temperature, top-k, top-p, min-p), with one key chain per request (the global MLX
seed is left alone).

The draw for the token at generated index k (0 = the first generated token) uses the k-th key
of the request's chain, whatever window the row is in, so a row's draw never depends on how many
drafts its window had: a seeded run gives the same text with any --suffix-draft. Speculative
acceptance then couples the draft with the target's own draw (speculative/acceptance.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from metal_shaders.argmax_rows import host_argmax
from metal_shaders.pooled import device_ints, host_lists

from .options import MIN_SAMPLING_TEMPERATURE, GenerateOptions

FLOAT32_MAX = 3.4028234663852886e38


def filtered_logits(logits: mx.array, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> mx.array:
    """logits (T, V) float32 -> log-probabilities (T, V) of the sampling distribution, -inf where
    filtered.

    Order: temperature, then top-k, top-p and min-p, each on the distribution the previous left
    (ties at a cut are kept). Every row keeps its most likely token(s), whatever the knobs: a
    temperature below MIN_SAMPLING_TEMPERATURE gives the limit t -> 0 (those tokens, evenly), one
    past float32's range is float32's largest, and +inf logits (a repetition penalty that
    overflowed) are infinitely more likely than the rest.
    """
    top = logits.max(axis=-1, keepdims=True)
    if temperature < MIN_SAMPLING_TEMPERATURE:  # in float32 1/t overflows, and t may round to 0
        x = mx.where(logits == top, 0.0, -mx.inf)
    else:
        # Shift so the largest logit is 0: a tiny temperature then gives -inf, never inf - inf.
        x = (logits - top) / min(temperature, FLOAT32_MAX)
    x = mx.where(top == mx.inf, mx.where(logits == mx.inf, 0.0, -mx.inf), x)
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = mx.sort(x, axis=-1)[..., V - top_k : V - top_k + 1]
        x = mx.where(x >= kth, x, -mx.inf)
    if top_p < 1.0:
        probs = mx.softmax(x, axis=-1)
        ordered = mx.sort(probs, axis=-1)[..., ::-1]
        before = mx.cumsum(ordered, axis=-1) - ordered  # mass strictly more likely than each
        # the smallest probability still inside the nucleus
        floor = mx.min(mx.where(before < top_p, ordered, mx.inf), axis=-1, keepdims=True)
        floor = mx.minimum(floor, ordered[..., :1])  # a top_p that rounds to 0 in float32 keeps the top
        x = mx.where(probs >= floor, x, -mx.inf)
    if min_p > 0.0:
        x = mx.where(x >= mx.log(mx.array(min_p, mx.float32)), x, -mx.inf)  # max(x) is 0
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Choice:
    """Each row's token, and with sampling the probability each row gave the next input."""

    tokens: list[int]
    draft_probs: list[float] | None  # p_i(inputs[i+1]) for rows i < T-1; None when greedy


class TokenChooser:
    """Greedy argmax (temperature 0, or below MIN_SAMPLING_TEMPERATURE) or a seeded draw per
    generated position.

    Args:
        options: temperature, top_k, top_p, min_p and seed.
        prompt_length: the request's prompt length; the row predicting position p draws with
            key p - prompt_length of the chain.
    """

    def __init__(self, options: GenerateOptions, prompt_length: int):
        self.options = options
        self.prompt_length = prompt_length
        self.is_sampling = options.is_sampling
        # No seed: a fresh one (request.py draws and reports it before this; a library call may not).
        seed = options.seed if options.seed is not None else secrets.randbits(63)
        self._chain = mx.random.key(seed) if self.is_sampling else None
        self._keys: list[mx.array] = []

    def key(self, index: int) -> mx.array:
        """The draw key of generated index `index` (the chain is split once per index)."""
        while len(self._keys) <= index:
            self._chain, key = mx.random.split(self._chain)
            self._keys.append(key)
        return self._keys[index]

    def choose(self, logits: mx.array, pos0: int, inputs: Sequence[int]) -> Choice:
        """logits (T, V) of a window at pos0 with these inputs -> each row's token."""
        if not self.is_sampling:
            return Choice(host_argmax(logits), None)
        o = self.options
        logp = filtered_logits(logits, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p)
        first = pos0 + 1 - self.prompt_length
        draws = mx.stack([
            mx.random.categorical(logp[i], key=self.key(first + i)) for i in range(logits.shape[0])
        ])
        drafts = device_ints(inputs[1:])
        probs = mx.exp(logp[mx.arange(len(inputs) - 1), drafts]) if len(inputs) > 1 else mx.zeros((0,))
        return Choice(*host_lists(draws, probs))

