"""Small building blocks shared by the architectures."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

PREFILL_MIN_ROWS = 16  # matmuls over at least this many rows take the prompt path (decode windows: T <= 8)


class Linear(nn.Linear):
    """`nn.Linear` whose prompt-sized calls on the CPU multiply by a contiguous Wᵀ.

    MLX's CPU matmul runs 2-3x slower with a transposed right operand (measured in
    docs/benchmarks.md, "Prefill"); copying Wᵀ costs far less than that for many rows, and the
    product is the same. Decode windows and other devices keep `x @ W.T`.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if x.size < PREFILL_MIN_ROWS * x.shape[-1] or mx.default_device() != mx.cpu:
            return super().__call__(x)
        y = x @ mx.contiguous(self["weight"].T)
        return y + self["bias"] if "bias" in self else y


class RMSNorm(nn.Module):
    """RMSNorm with a plain multiplicative weight (zero-centred checkpoints add 1 at load)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate), computed in float32 as the reference does."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype)
        out = (self.weight * normed).astype(mx.float32) * nn.silu(gate.astype(mx.float32))
        return out.astype(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden_dims, bias=False)
        self.up_proj = Linear(dims, hidden_dims, bias=False)
        self.down_proj = Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm and logits (tied or `lm_head`).

    Each architecture subclasses it with its own layers and `sanitize`. Per-layer state comes
    from the caller (the window engine); `state_kinds` says what each layer needs, attention
    KV by default.
    """

    def __init__(self, config, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = layers
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        return [("kv", {}) for _ in self.layers]

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last row only."""
        h = self.model.embed_tokens(tokens)
        for layer, state in zip(self.layers, states):
            h = layer(h, state)
        if last_only:
            h = h[:, -1:]
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)
