"""Affine quantization as MLX checkpoints record it.

config.json carries a `quantization` block, as mlx-lm writes it:

    {"group_size": 64, "bits": 4, "mode": "affine",
     "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}, ...}

The top-level `group_size` / `bits` apply to every quantized layer; a module path maps to its own
settings (or to false: not quantized). Which layers are quantized is read from the checkpoint:
a layer is quantized when its `.scales` tensor is present, exactly as mlx-lm decides.

Besides affine, the block (or one layer's entry) may say `"mode": "mxfp4"`: MX 4-bit floats in
groups of 32 with a power-of-two scale and no bias, the form GPT-OSS publishes its experts in. A
layer's own entry without a mode is affine, as mlx-lm reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .config import ConfigError
from .layers import RowLinear
from .moe import SwitchGLU

MODE = "affine"
MXFP4 = "mxfp4"
MXFP4_GROUP_SIZE, MXFP4_BITS = 32, 4  # the only shape of mxfp4 MLX has
# Below this many bytes of dense (non-expert) weights in float32, the CPU runs a quantized model's
# dense layers dequantized (`dequantize_dense`): the embedded demo model is 8-bit to fit the package.
DEQUANTIZE_DENSE_MAX_BYTES = 256 * 2**20
BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports in affine mode
GROUP_SIZES = (32, 64, 128)  # weights per scale and bias that strata reads and writes
ROUTER_BITS = 8  # routers and the shared-expert gate stay at 8 bits, as mlx-lm quantizes them

Overrides = Callable[[str], dict | None]


@dataclass(frozen=True)
class Quantization:
    """Settings for every quantized layer, plus per-layer exceptions keyed by module path."""

    group_size: int
    bits: int
    layers: dict[str, dict | bool] = field(default_factory=dict)
    mode: str = MODE

    def __post_init__(self):
        _check(self.group_size, self.bits, where="quantization", mode=self.mode)
        for path, params in self.layers.items():
            if isinstance(params, dict):
                _check(params.get("group_size"), params.get("bits"), where=f"quantization[{path!r}]",
                       mode=params.get("mode", MODE))
            elif params is not False and params is not True:
                raise ConfigError(f"quantization[{path!r}] must be an object or a boolean, got {params!r}")

    @classmethod
    def from_config(cls, block: Any) -> "Quantization":
        if not isinstance(block, dict):
            raise ConfigError(f"quantization must be an object, got {block!r}")
        layers = {k: v for k, v in block.items() if k not in ("group_size", "bits", "mode")}
        return cls(group_size=block.get("group_size"), bits=block.get("bits"), layers=layers,
                   mode=block.get("mode", MODE))

    def to_config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode, **self.layers}

    def settings(self, path: str) -> dict | bool:
        """What `nn.quantize` should do with the layer at `path` if the checkpoint quantized it."""
        params = self.layers.get(path, True)
        if isinstance(params, dict):
            return {"group_size": params["group_size"], "bits": params["bits"], "mode": params.get("mode", MODE)}
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode} if params else False


def _check(group_size: Any, bits: Any, *, where: str, mode: Any = MODE) -> None:
    if mode == MXFP4:
        if (group_size, bits) != (MXFP4_GROUP_SIZE, MXFP4_BITS):
            raise ConfigError(f"{where}: mode {MXFP4!r} needs group_size {MXFP4_GROUP_SIZE} and bits "
                              f"{MXFP4_BITS}, got {group_size!r} and {bits!r}")
        return
    if mode != MODE:
        raise ConfigError(f"{where}: mode {mode!r} is not supported (only {MODE!r} and {MXFP4!r})")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"{where}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if bits not in BITS:
        raise ConfigError(f"{where}: bits must be one of {BITS}, got {bits!r}")


def apply_to_load(model: nn.Module, quantization: Quantization, weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers wherever the checkpoint stores `<path>.scales`."""

    def predicate(path: str, module: nn.Module) -> dict | bool:
        if not hasattr(module, "to_quantized"):
            return False
        if isinstance(module, SwitchGLU):
            return _experts_quantized(path, weights) and _experts_settings(path, quantization)
        return f"{path}.scales" in weights and quantization.settings(path)

    nn.quantize(model, class_predicate=predicate)


def _experts_settings(path: str, quantization: Quantization) -> dict | bool:
    """A stack of experts' settings, with the projections' own where the checkpoint records them
    under `<path>.gate_proj` etc. (mlx-lm's mixed recipes give down_proj more bits)."""
    settings = quantization.settings(path)
    own = {p: quantization.settings(f"{path}.{p}") for p in _PROJECTIONS if f"{path}.{p}" in quantization.layers}
    return {**settings, "projections": own} if own and settings else settings


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _experts_quantized(path: str, weights: dict[str, mx.array]) -> bool:
    quantized = [f"{path}.{proj}.scales" in weights for proj in ("gate_proj", "up_proj", "down_proj")]
    if any(quantized) and not all(quantized):
        raise ValueError(f"{path}: some expert projections are quantized and some are not (not supported)")
    return all(quantized)


def quantize(model: nn.Module, *, group_size: int, bits: int, overrides: Overrides | None = None) -> Quantization:
    """Quantize `model` in place, as mlx-lm's converter would, and return what to record.

    A layer is quantized when it can be (a Linear, Embedding or expert stack) and every input
    dimension is a multiple of `group_size`; `overrides(path)` may give a layer its own settings.
    """
    recorded: dict[str, dict | bool] = already_quantized(model)

    def predicate(path: str, module: nn.Module) -> dict | bool:
        if not hasattr(module, "to_quantized") or not _fits(module, group_size):
            return False
        params = overrides(path) if overrides else None
        if params is None:
            return True
        recorded[path] = dict(params)
        return {**params, "mode": MODE}

    nn.quantize(model, group_size, bits, mode=MODE, class_predicate=predicate)
    return Quantization(group_size=group_size, bits=bits, layers=recorded)


def already_quantized(model: nn.Module) -> dict[str, dict]:
    """Module path -> settings of every layer the model holds quantized already (GPT-OSS's mxfp4
    experts as published), so that a record of a further quantization names them too."""
    found = {}
    for path, module in model.named_modules():
        if "scales" in module and hasattr(module, "bits") and hasattr(module, "group_size"):
            found[path] = {"group_size": module.group_size, "bits": module.bits,
                           "mode": getattr(module, "mode", MODE)}
    return found


def recorded_quantization(model: nn.Module) -> dict | None:
    """The `quantization` block that describes a loaded model's quantized layers as they are,
    or None when none is: the most common setting at the top, the others per layer."""
    found = already_quantized(model)
    if not found:
        return None
    settings = [tuple(v.items()) for v in found.values()]
    top = dict(max(set(settings), key=settings.count))
    layers = {p: v for p, v in found.items() if v != top}
    return Quantization(group_size=top["group_size"], bits=top["bits"], layers=layers, mode=top["mode"]).to_config()


def _fits(module: nn.Module, group_size: int) -> bool:
    if isinstance(module, SwitchGLU):
        return all(module[p].shape[-1] % group_size == 0 for p in ("gate_proj", "up_proj", "down_proj"))
    return module.weight.shape[-1] % group_size == 0


def router_overrides(group_size: int) -> Overrides:
    """Routers (`mlp.gate`) and shared-expert gates at 8 bits: they are tiny and steer everything."""

    def overrides(path: str) -> dict | None:
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            return {"group_size": group_size, "bits": ROUTER_BITS}
        return None

    return overrides


def dequantize_dense(model: nn.Module, dtype: mx.Dtype) -> None:
    """Turn quantized linear and embedding layers back into dense ones of `dtype`, in place.
    Routed experts stay quantized.

    On the CPU a quantized matmul of a few rows costs more than the float32 one: the 8-bit demo
    model decodes 7-13% slower than the same weights dense (docs/benchmarks.md). The values are
    the stored weights dequantized, once. Experts keep their quantized form so that resident and
    streamed experts (experts/switch.py) stay one code path and bit-identical; a decode step runs
    two of them, against every dense layer.
    """
    for module in model.modules():
        for name, child in list(module.items()):
            dense = _dense(child, dtype)
            if dense is not None:
                module[name] = dense


def dense_bytes(model: nn.Module) -> int:
    """Bytes in float32 of the quantized dense layers' weights once dequantized."""
    total = 0
    for module in model.modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = module.weight.shape[-2:]  # packed: 32-bit words of `bits`-bit values
            total += rows * (packed * 32 // module.bits) * 4
    return total


def _dense(layer: Any, dtype: mx.Dtype) -> nn.Module | None:
    if not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or layer.mode != MODE:
        return None
    weight = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=layer.group_size,
                           bits=layer.bits, mode=layer.mode).astype(dtype)
    if isinstance(layer, nn.QuantizedEmbedding):
        dense = nn.Embedding(*weight.shape)
    else:
        dense = RowLinear(weight.shape[1], weight.shape[0], bias="bias" in layer)
        if "bias" in layer:
            dense.bias = layer.bias.astype(dtype)
    dense.weight = weight
    return dense
