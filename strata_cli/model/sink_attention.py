"""Attention with a learned sink per head, full or over a sliding window (GPT-OSS), and YaRN rope.

A sink is one more logit per head in every row's softmax, whose value is dropped: it takes a
share of the weight and leaves the rest to the keys. A sliding-window layer keeps its keys in
`SlidingKVState` (engine/sliding_state.py), which hands back the cells and a mask of the cells
each row sees; a full layer keeps `KVState`'s positional cache.

Decode windows (and serial steps) on GPU backends attend through the row-invariant sink kernel
of metal_shaders/attention_window.py (`sink_attention_window`: the sinks, and the ring's window
rule computed from each row's position), or, where its probe fails, row by row (each row serial
decoding's own sdpa call). On the CPU a window's rows share one sdpa call (row-invariant there:
tests/test_gpt_oss.py checks every row against its serial logits bit for bit); prompt chunks take
the blocked CPU attention with the sinks and the window (`attention.causal_attention_cpu`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from metal_shaders import attention_window

from .attention import GatedAttention, causal_attention_cpu
from .config import ConfigError
from .layers import PREFILL_MIN_ROWS, WINDOW_ROWS, RowSplit

YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "mscale", "mscale_all_dim", "attention_factor", "rope_theta"}


def rope_periods(head_dim: int, theta: float, scaling: dict | None) -> tuple[np.ndarray | None, float]:
    """The rotary periods (what `mx.fast.rope` takes as `freqs`, 1/inverse frequency) and the
    attention factor YaRN scales cos and sin by, as transformers computes them
    (`_compute_yarn_parameters`, `truncate` included); (None, 1.0) for the default rope.

    Raises:
        ConfigError: a rope type other than default or yarn, or keys YaRN does not read.
    """
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return None, 1.0
    if kind != "yarn":
        raise ConfigError(f"rope scaling {kind!r} is not supported (only the default rope and 'yarn'), got {scaling}")
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise ConfigError(f"yarn rope scaling keys {unknown} are not supported, got {scaling}")
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # share of the unscaled frequency
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return (1.0 / inv_freq).astype(np.float32), float(attention_factor)


class SinkAttention(GatedAttention):
    """GPT-OSS attention: biased q/k/v/o projections, rope (YaRN), a sink logit per head, and a
    sliding window (`window` positions, the row's own included) or none.

    YaRN's attention factor multiplies cos and sin, so every score by its square: it is folded
    into the score scale.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float,
                 rope_scaling: dict | None, window: int | None, bias: bool = True):
        super().__init__(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         rotary_dim=head_dim, rope_theta=rope_theta, eps=0.0, bias=bias, output_gate=False,
                         qk_norm=False)
        self.sinks = mx.zeros((num_heads,))
        self.window = window
        periods, factor = rope_periods(head_dim, rope_theta, rope_scaling)
        self._periods = None if periods is None else mx.array(periods)  # not a parameter: never loaded or cast
        self.scale = head_dim**-0.5 * factor * factor

    def takes_kernel(self, rows: int, dtype=None) -> bool:
        """Whether a window of `rows` rows attends through the sink kernel (a GPU where it passed
        its probe; serial steps too, so they share its arithmetic)."""
        return (RowSplit.kernel_may_take(rows) and attention_window.supports(self.head_dim)
                and attention_window.sinks_usable(dtype))

    def rope(self, x: mx.array, offset: int) -> mx.array:
        if self._periods is None:
            return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        return mx.fast.rope(x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=self._periods)

    def core(self, q: mx.array, k: mx.array, v: mx.array, state) -> mx.array:
        """Rope at the state's offset, the window's KV written, attention -> (B, T, heads·D)."""
        B, _, T, _ = q.shape
        q, k = self.rope(q, state.offset), self.rope(k, state.offset)
        if self.window is None:
            keys, values = state.update_and_fetch(k, v)
            mask = None
        else:
            keys, values, mask = state.update_and_fetch(k, v)
        sinks = self.sinks if self.sinks.dtype == q.dtype else self.sinks.astype(q.dtype)
        if T <= WINDOW_ROWS and self.takes_kernel(T, q.dtype):  # a ring's whole buffer (sliding) or cells 0..end
            out = attention_window.sink_attention_window(q, keys, values, self.scale, sinks, pos0=state.offset,
                                                         window=self.window or 0)
        elif T <= WINDOW_ROWS and RowSplit.applies(T):
            # Each query row alone over the cells it sees: serial decoding's call.
            out = attention_window.reference_sink_attention_window(q, keys, values, self.scale, sinks, mask=mask)
        elif T >= PREFILL_MIN_ROWS and mx.default_device() == mx.cpu:
            out = causal_attention_cpu(q, keys, values, self.scale, sinks=sinks, window=self.window)
            out = out.transpose(0, 2, 1, 3)
        else:
            # the state's mask (the ring's cells, or a long run's band), else causal from the last key
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, sinks=sinks,
                                                       mask=mask if mask is not None else "causal" if T > 1 else None)
            out = out.transpose(0, 2, 1, 3)
        return out.reshape(B, T, -1)
