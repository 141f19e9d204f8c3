"""Checkpoint layouts, and gathering per-expert tensors into stacked ones.

Three layouts reach strata:

- "hf": what transformers saves. Experts are stored per expert (`experts.E.gate_proj.weight`, or
  Mixtral's `experts.E.w1.weight`) or fused (`experts.gate_up_proj` (E, 2I, H) and
  `experts.down_proj` (E, H, I)); family-specific transforms (Qwen3-Next's zero-centred norms and
  (C, 1, K) conv weights) are still to be applied.
- "mlx": what mlx-lm writes (the MLX-community checkpoints). Experts are stacked as
  `switch_mlp.{gate,up,down}_proj.weight`, quantized ones with `.scales` and `.biases`, and every
  family transform has already been applied.
- strata's own (`strata convert`), marked in config.json. Version 2 is exactly the MLX layout (so
  mlx-lm loads it too); `from_mlx_layout` turns it into the modules' parameters by names and
  shapes alone, with no family transform. Version 1 holds the modules' parameters as they are.
"""

from __future__ import annotations

import re

import mlx.core as mx

HF, MLX = "hf", "mlx"
GLU = ("gate_proj", "up_proj", "down_proj")
QUANT_PARTS = ("scales", "biases")
# Unquantized stacked experts: strata's SwitchGLU holds them as bare arrays, mlx-lm as `<proj>.weight`.
_BARE_EXPERTS = re.compile(r"\.switch_mlp\.(gate|up|down)_proj$")
_CONV = ".conv1d.weight"  # strata's depthwise conv weight (C, K); MLX's conv layout is (C, K, 1)


class LayoutError(ValueError):
    """Tensors that do not form the expected layout; `tensor` names the one at fault, so the
    loader can name the file it came from."""

    def __init__(self, message: str, *, tensor: str):
        super().__init__(message)
        self.tensor = tensor


def detect_layout(weights: dict[str, mx.array]) -> str | None:
    """HF or MLX from the expert tensors; None when the checkpoint has no expert tensors."""
    if any(".switch_mlp." in k for k in weights):
        return MLX
    if any(".experts." in k for k in weights):
        return HF
    return None


def to_mlx_layout(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """A model's parameters (tree_flatten) under the names and shapes mlx-lm stores them."""
    out = {}
    for name, value in params.items():
        if _BARE_EXPERTS.search(name):
            name = f"{name}.weight"
        elif name.endswith(_CONV) and value.ndim == 2:
            value = value[..., None]
        out[name] = value
    return out


def from_mlx_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The inverse of `to_mlx_layout`: tensors it wrote back under the modules' names and shapes."""
    out = {}
    for name, value in weights.items():
        base = name.removesuffix(".weight")
        if base != name and _BARE_EXPERTS.search(base) and f"{base}.scales" not in weights:
            name = base
        elif name.endswith(_CONV) and value.ndim == 3 and value.shape[-1] == 1:
            value = value.squeeze(-1)
        out[name] = value
    return out


def stack_experts(
    weights: dict[str, mx.array],
    prefix: str,
    num_experts: int,
    *,
    names: dict[str, str] | None = None,
) -> None:
    """Put one MoE block's experts under stacked `{prefix}.switch_mlp.*` keys, in place.

    Unquantized experts become `switch_mlp.{gate,up,down}_proj` (E, out, in), the names
    `SwitchGLU` uses; quantized ones keep mlx-lm's `switch_mlp.<proj>.{weight,scales,biases}`,
    the names `QuantizedSwitchGLU` uses.

    Args:
        weights: all tensors, changed in place.
        prefix: the MoE block, e.g. "model.layers.3.mlp".
        num_experts: E; a partial set of per-expert tensors is an error.
        names: checkpoint name -> gate_proj/up_proj/down_proj for per-expert tensors
            (default: the identity; Mixtral passes {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}).

    Raises:
        LayoutError: some experts' tensors are missing, or a fused tensor has an odd shape.
    """
    names = names or {n: n for n in GLU}
    for source, proj in names.items():
        for part in ("weight", *QUANT_PARTS):
            keys = [f"{prefix}.experts.{e}.{source}.{part}" for e in range(num_experts)]
            present = [k for k in keys if k in weights]
            if not present:
                continue
            if len(present) < num_experts:
                missing = next(k for k in keys if k not in weights)
                raise LayoutError(
                    f"missing tensor {missing} ({len(present)} of {num_experts} experts present)", tensor=missing
                )
            shape = weights[keys[0]].shape
            for k in keys:
                if weights[k].shape != shape:
                    raise LayoutError(
                        f"tensor {k} has shape {tuple(weights[k].shape)}, expected {tuple(shape)} "
                        f"like {keys[0]}", tensor=k,
                    )
            weights[f"{prefix}.switch_mlp.{proj}.{part}"] = mx.stack([weights.pop(k) for k in keys])
    _split_fused(weights, prefix)
    _name_unquantized(weights, prefix)


def _split_fused(weights: dict[str, mx.array], prefix: str) -> None:
    """transformers' in-memory layout: gate_up_proj (E, 2I, H) is [gate; up] along dim 1."""
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is None:
        return
    if fused.ndim != 3 or fused.shape[1] % 2:
        name = f"{prefix}.experts.gate_up_proj"
        raise LayoutError(f"tensor {name} has shape {tuple(fused.shape)}, expected (E, 2·I, H)", tensor=name)
    gate, up = mx.split(fused, 2, axis=1)
    weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
    weights[f"{prefix}.switch_mlp.up_proj.weight"] = up
    down = weights.pop(f"{prefix}.experts.down_proj", None)
    if down is not None:
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = down


def _name_unquantized(weights: dict[str, mx.array], prefix: str) -> None:
    for proj in GLU:
        base = f"{prefix}.switch_mlp.{proj}"
        if f"{base}.weight" in weights and f"{base}.scales" not in weights:
            weights[base] = weights.pop(f"{base}.weight")
