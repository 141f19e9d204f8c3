"""Weightless mock models for decode-loop and bench tests."""

from dataclasses import dataclass

import mlx.core as mx

CYCLE = 10


@dataclass(frozen=True)
class MockConfig:
    vocab_size: int = 16
    max_position_embeddings: int = 512


class CycleModel:
    """A stateless mock whose greedy next token is (t + 1) % CYCLE: the drafter predicts it
    perfectly. With `broken`, rows after the first of a multi-row window predict (t + 2), so
    speculation changes the output (what bench's identity check must catch)."""

    config = MockConfig()
    state_kinds = []

    def __init__(self, broken=False):
        self.broken = broken

    def __call__(self, tokens, states, *, last_only=False):
        nxt = (tokens + 1) % CYCLE
        if self.broken and tokens.shape[1] > 1:
            rows = mx.arange(tokens.shape[1])[None, :]
            nxt = mx.where(rows > 0, (tokens + 2) % CYCLE, nxt)
        logits = mx.where(mx.arange(self.config.vocab_size) == nxt[..., None], 10.0, 0.0)
        return logits[:, -1:] if last_only else logits
