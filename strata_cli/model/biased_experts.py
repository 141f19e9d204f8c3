"""Routed experts with a bias per expert and output, and GPT-OSS's clamped SwiGLU.

Legend: E experts, M picks, H hidden, I expert hidden. The stacks keep mlx-lm's `SwitchLinear`
names (`experts.gate_proj.weight` (E, I, H), `.bias` (E, I); quantized: `.scales`, and `.biases`
in affine mode), so the mlx-community checkpoints load by name. The products run through
model/moe.py's own helpers (`glu_by_expert`, `gather_matmul`, `gather_qmatmul`), so a decode
window's picks keep their serial arithmetic exactly as the other families' experts do.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .layers import is_cpu_prompt, transposed
from .moe import gather_matmul, gather_qmatmul, glu_by_expert


@partial(mx.compile, shapeless=True)
def clamped_swiglu(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    """GPT-OSS's gate: the gate clipped from above, the up projection on both sides, and 1
    added to it: (up + 1) · gate · sigmoid(alpha · gate)."""
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * (gate * mx.sigmoid(alpha * gate))


def add_bias(y: mx.array, bias: mx.array, experts: mx.array) -> mx.array:
    """y (M, R, out), the products of picks `experts` (M,), plus each pick's bias row."""
    return y + bias[experts][..., None, :].astype(y.dtype)


class ExpertLinear(nn.Module):
    """E stacked (out, in) matrices, each with a bias row."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))
        self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, xs: mx.array, experts: mx.array, is_sorted: bool) -> mx.array:
        """xs (M, R, in) @ weight[experts]ᵀ + bias[experts] -> (M, R, out)."""
        # Prompt chunks on the CPU multiply by a cached contiguous transpose (as SwitchGLU does).
        wt = transposed(self, "weight") if xs.dtype == mx.float32 and is_cpu_prompt(xs) else None
        return add_bias(gather_matmul(xs, self.weight, experts, is_sorted=is_sorted, wt=wt), self.bias, experts)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedExpertLinear":
        return QuantizedExpertLinear(self, group_size=group_size, bits=bits, mode=mode)


class QuantizedExpertLinear(nn.Module):
    """`ExpertLinear` with quantized matrices (affine, or mxfp4: no `biases`); the bias stays float."""

    def __init__(self, linear: ExpertLinear, *, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        parts = mx.quantize(linear.weight, group_size, bits, mode=mode)
        self.weight, self.scales = parts[0], parts[1]
        if len(parts) > 2:
            self.biases = parts[2]
        self.bias = linear.bias

    def __call__(self, xs: mx.array, experts: mx.array, is_sorted: bool) -> mx.array:
        y = gather_qmatmul(xs, self.weight, self.scales, self.get("biases"), experts, group_size=self.group_size,
                           bits=self.bits, mode=self.mode, is_sorted=is_sorted)
        return add_bias(y, self.bias, experts)


class ClampedSwitchGLU(nn.Module):
    """E experts of GPT-OSS: down(clamped_swiglu(gate(x) + b, up(x) + b)) + b, per pick."""

    expert_kind = "glu"  # its record kind when streamed (experts/store.py), bias rows and all

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, *, alpha: float, limit: float):
        super().__init__()
        self.gate_proj = ExpertLinear(hidden_size, expert_size, num_experts)
        self.up_proj = ExpertLinear(hidden_size, expert_size, num_experts)
        self.down_proj = ExpertLinear(expert_size, hidden_size, num_experts)
        self.alpha, self.limit = alpha, limit

    @property
    def activation(self):
        """(gate, up) -> the clamped SwiGLU with this model's alpha and limit (streamed experts
        take it from here, so they compute what these do)."""
        return partial(clamped_swiglu, alpha=self.alpha, limit=self.limit)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        return glu_by_expert(x, inds, lambda name, xs, experts, is_sorted: self[name](xs, experts, is_sorted),
                             self.activation)
