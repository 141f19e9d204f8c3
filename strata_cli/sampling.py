"""Temperature sampling with a per-request key chain (the global MLX seed is left alone)."""

from __future__ import annotations

import mlx.core as mx


class Sampler:
    """Draws token ids from softmax(logits / temperature).

    Args:
        temperature: above 0.
        seed: the request's seed; the same seed and logits give the same tokens.
    """

    def __init__(self, temperature: float, seed: int):
        if not temperature > 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature}")
        self.temperature = temperature
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> int:
        """logits (V,) -> one token id."""
        self._key, key = mx.random.split(self._key)
        # Shift so the largest logit is 0: a tiny temperature then gives -inf, never inf - inf.
        scaled = (logits - logits.max()) / self.temperature
        return mx.random.categorical(scaled, key=key).item()
