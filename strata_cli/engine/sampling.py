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
        self.inverse_temperature = 1.0 / temperature
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> int:
        """logits (V,) -> one token id."""
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logits * self.inverse_temperature, key=key).item()
