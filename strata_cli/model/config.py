"""Checkpoint configuration: config.json parsing shared by the architectures, and the dtype table.

Each `model/<arch>.py` subclasses `ModelConfig` with its own fields; `from_dict` builds it from
config.json, refusing what strata cannot run with one `ConfigError` that names the problem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# The compute and storage dtypes strata runs in, by the names the CLI and config.json use.
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DTYPE_NAMES = tuple(DTYPES)


class ConfigError(ValueError):
    """A checkpoint's config.json, or a run option, that strata cannot use."""


def dtype_name(dtype: mx.Dtype) -> str:
    """"float32" for mx.float32: the name DTYPES knows it by (or MLX's own spelling)."""
    return str(dtype).removeprefix("mlx.core.")


@dataclass(frozen=True)
class ModelConfig:
    """Fields every architecture shares; each `model/<arch>.py` subclasses it with its own."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict, ignoring keys the architecture does not use.

        Raises:
            ConfigError: a required field is missing, naming every missing one.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in params]
        if missing:
            raise ConfigError(f"config.json for {cls.__name__} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in params.items() if k in fields})


def lift_rope_parameters(params: dict[str, Any], keys: tuple[str, ...] = ("rope_theta",)) -> dict[str, Any]:
    """A copy of config.json's dict with transformers 5's nested `rope_parameters` keys lifted to
    the top level (where older configs keep them).

    Raises:
        ConfigError: any rotary embedding other than the default one (rope scaling).
    """
    params = dict(params)
    rope = params.get("rope_parameters") or {}
    for key in keys:
        if key in rope and key not in params:
            params[key] = rope[key]
    if rope.get("rope_type", "default") != "default" or params.get("rope_scaling"):
        scaling = params.get("rope_scaling") or rope
        raise ConfigError(f"rope scaling is not supported yet (only the default rotary embedding), got {scaling}")
    return params
