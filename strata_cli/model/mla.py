"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi), computed in the latent space.

Each token's keys and values come from one compressed latent c (`kv_lora_rank` wide, after
`kv_a_layernorm`) through per-head up-projections, plus one rotated key k_pe shared by every
head. transformers expands every cached latent into per-head keys and values; here the
up-projections are absorbed into the query and the output instead (mlx-lm's `embed_q` /
`unembed_out` layout), which is the same sum in another order:

    q_nope · (W_k c) = (W_kᵀ q_nope) · c        out = Σ p · (W_v c) = W_v (Σ p · c)

so the cache holds only [c | k_pe] per token (engine/state.py: `LatentKVState`, positional), and
a decode window's attention is one shared key-value head of width r + d_rope against the heads'
latent queries. Prompt chunks (16+ rows, shared by serial and speculative decoding) expand the
cached latents into per-head keys and values once per chunk instead, as transformers does.
A window's rows never share a matmul with each other where that would change their arithmetic:
the per-head projections run row by row where `RowSplit` applies, and the attention itself takes
the same paths as `attention.GatedAttention` (one sdpa call per row on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_shaders import attention_window

from .attention import causal_attention_cpu
from .config import ConfigError
from .layer_state import LatentState
from .layers import PREFILL_MIN_ROWS, RMSNorm, RowLinear, RowSplit, by_row


def expands(rows: int) -> bool:
    """Whether a call of `rows` rows attends with expanded keys and values: prompt chunks (shared by
    serial and speculative decoding, so any exact form will do), where expanding the cache once
    per chunk costs less than latent-space attention (per head 576 wide against 192 for
    DeepSeek-V3). Decode windows (at most 8 rows) and serial steps stay in the latent space."""
    return rows >= PREFILL_MIN_ROWS


MLA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' RMSNorm default, not rms_norm_eps


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of MLA's `d_rope` key/query dims: plain, or YaRN as transformers'
    `_compute_yarn_parameters` computes it (the frequencies, and `attention_factor` scaling the
    rotated dims), plus the softmax scale's YaRN factor (`mscale_all_dim`, squared)."""

    dims: int
    base: float
    traditional: bool
    freqs: tuple[float, ...] | None = None  # mx.fast.rope's periods (1 / inv_freq), None: base ** (2i/d)
    attention_factor: float = 1.0
    softmax_factor: float = 1.0

    @classmethod
    def from_params(cls, params: dict[str, Any], *, dims: int, traditional: bool) -> "Rope":
        """From config.json: `rope_theta` and `rope_scaling` (older configs) or transformers 5's
        `rope_parameters`.

        Raises:
            ConfigError: a rope type other than default or yarn, or a yarn block without `factor`.
        """
        rope = dict(params.get("rope_parameters") or {})
        scaling = params.get("rope_scaling") or {}
        rope.update(scaling)
        base = float(params.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        kind = scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"
        if kind == "default":
            return cls(dims, base, traditional)
        if kind != "yarn":
            raise ConfigError(f"rope type {kind!r} is not supported for MLA (only default and yarn), got {rope}")
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if not isinstance(factor, (int, float)) or not isinstance(original, (int, float)):
            raise ConfigError(f"yarn rope needs factor and original_max_position_embeddings, got {rope}")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        softmax_factor = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
        inv_freq = yarn_inv_freq(dims, base, float(factor), float(original), rope.get("beta_fast") or 32,
                                 rope.get("beta_slow") or 1, truncate=rope.get("truncate", True))
        return cls(dims, base, traditional, tuple(float(f) for f in 1.0 / inv_freq), float(attention_factor),
                   float(softmax_factor))

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        if self.freqs is None:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=1.0, offset=offset)
        freqs = self.__dict__.get("_freqs")
        if freqs is None:
            freqs = mx.array(self.freqs, dtype=mx.float32)
            object.__setattr__(self, "_freqs", freqs)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=freqs)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dims: int, base: float, factor: float, original: float, beta_fast: float, beta_slow: float, *,
                  truncate: bool) -> np.ndarray:
    """YaRN's per-pair inverse frequencies (transformers' `_compute_yarn_parameters`, float32)."""

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = np.float32(base) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))
    extrapolation = 1 - ramp
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation).astype(np.float32)


class MultiLinear(nn.Module):
    """One matrix per head, weight (heads, out, in), mlx-lm's `MultiLinear` layout:
    x (B, heads, T, in) -> (B, heads, T, out), or with `transpose=False` x @ weight."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        self.weight = mx.zeros((num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array) -> mx.array:
        return by_row(lambda rows: rows @ self.weight.swapaxes(-1, -2), x)

    def untransposed(self, x: mx.array) -> mx.array:
        """x (B, 1, L, out) @ weight -> (B, heads, L, in): the latent expanded per head."""
        return x @ self.weight

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedMultiLinear":
        return QuantizedMultiLinear(self.weight, group_size=group_size, bits=bits, mode=mode)


class QuantizedMultiLinear(nn.Module):
    """`MultiLinear` affine-quantized along its input dim, as mlx-lm stores it."""

    def __init__(self, weight: mx.array, *, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits, mode=mode)
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return by_row(lambda rows: mx.quantized_matmul(rows, self.weight, self.scales, self.biases, transpose=True,
                                                       group_size=self.group_size, bits=self.bits, mode=self.mode), x)

    def untransposed(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=False,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


class LatentAttention(nn.Module):
    """MLA with the latent cache. Parameters under transformers' / mlx-lm's names: `q_proj` (or
    `q_a_proj`, `q_a_layernorm`, `q_b_proj` when `q_lora_rank` is set), `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `embed_q` and `unembed_out` (the halves of transformers' `kv_b_proj`, per
    head: `model/mla.py: split_kv_b`), `o_proj`. `rope` None: no positional embedding (Kimi's NoPE)."""

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: Rope | None,
                 bias: bool = False):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope = rope
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = RowLinear(hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = RowLinear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = RowLinear(q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = RowLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, MLA_NORM_EPS)
        self.embed_q = MultiLinear(qk_nope_head_dim, kv_lora_rank, num_heads)
        self.unembed_out = MultiLinear(kv_lora_rank, v_head_dim, num_heads)
        self.o_proj = RowLinear(num_heads * v_head_dim, hidden_size, bias=bias)
        factor = rope.softmax_factor if rope is not None else 1.0
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * factor

    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        """x (B, T, H) -> the core's inputs: the latent queries (B, heads, T, r) (for a prompt
        chunk the plain ones, (B, heads, T, nope): `expands`), the rotary queries (B, heads, T,
        d_rope), the latent (B, 1, T, r) and the rotary key (B, 1, T, d_rope)."""
        B, T, _ = x.shape
        if "q_proj" in self:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, self.num_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : self.kv_lora_rank])[:, None]
        k_pe = kv[..., self.kv_lora_rank :][:, None]
        if self.rope is not None and self.rope.attention_factor != 1.0:
            q_pe, k_pe = q_pe * self.rope.attention_factor, k_pe * self.rope.attention_factor
        if expands(T):
            return (q_nope, q_pe, latent, k_pe), ()
        return (self.embed_q(q_nope), q_pe, latent, k_pe), ()

    def core(self, q_first: mx.array, q_pe: mx.array, latent: mx.array, k_pe: mx.array, state: LatentState) -> mx.array:
        """Rotary at the state's offset, the window's cells written, attention -> (B, heads, T, r)
        (the latent outputs), or for a prompt chunk (B, heads, T, v) (`expands`)."""
        T = q_first.shape[2]
        if self.rope is not None:
            q_pe, k_pe = self.rope(q_pe, state.offset), self.rope(k_pe, state.offset)
        cells, _ = state.update_and_fetch(mx.concatenate([latent, k_pe], axis=-1))
        q = mx.concatenate([q_first, q_pe], axis=-1)
        if expands(T):  # a prompt chunk: every cell's keys and values per head, once for the chunk
            latents, shared = cells[..., : self.kv_lora_rank], cells[..., self.kv_lora_rank :]
            k_nope = self.embed_q.untransposed(latents)  # (B, heads, L, nope)
            keys = mx.concatenate([k_nope, mx.broadcast_to(shared, (*k_nope.shape[:-1], shared.shape[-1]))], axis=-1)
            values = self.unembed_out(latents)  # (B, heads, L, v)
        else:
            keys, values = cells, cells[..., : self.kv_lora_rank]
        return self.attend(q, keys, values)

    def attend(self, q: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        """Causal attention of the window's T rows (the last T cells) -> (B, heads, T, values' width)."""
        T = q.shape[2]
        if RowSplit.applies(T):  # each row alone over the cells it sees: serial decoding's call
            return attention_window.reference_attention_window(q, keys, values, self.scale).transpose(0, 2, 1, 3)
        if T >= PREFILL_MIN_ROWS and mx.default_device() == mx.cpu:
            return causal_attention_cpu(q, keys, values, self.scale)
        mask = "causal" if T > 1 else None
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

    def tail(self, out: mx.array) -> mx.array:
        """Attention output (B, heads, T, r) in the latent space (values per head for a prompt
        chunk) -> (B, T, H)."""
        B, _, T, _ = out.shape
        if not expands(T):
            out = self.unembed_out(out)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))

    def __call__(self, x: mx.array, state: LatentState) -> mx.array:
        core_in, tail_in = self.head(x)
        return self.tail(self.core(*core_in, state), *tail_in)


def split_kv_b(weights: dict[str, mx.array], prefix: str, *, num_heads: int, nope_dim: int, v_dim: int) -> None:
    """transformers' `kv_b_proj.weight` (heads·(nope + v), r) at `prefix` -> `embed_q.weight`
    (heads, r, nope) and `unembed_out.weight` (heads, v, r), in place: the same numbers, split
    and transposed (no arithmetic)."""
    w = weights.pop(f"{prefix}.kv_b_proj.weight", None)
    if w is None:
        return
    w = w.reshape(num_heads, nope_dim + v_dim, -1)
    weights[f"{prefix}.embed_q.weight"] = mx.contiguous(w[:, :nope_dim].swapaxes(-1, -2))
    weights[f"{prefix}.unembed_out.weight"] = mx.contiguous(w[:, nope_dim:])
