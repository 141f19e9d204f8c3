"""Checkpoint configuration: config.json parsing shared by the architectures, and the dtype table.

Each `model/<arch>.py` subclasses `ModelConfig` with its own fields; `from_dict` builds it from
config.json, refusing what strata cannot run with one `ConfigError` that names the problem. Every
field's value is checked against its annotation before anything uses it (`check_fields`): an
`int` must be a positive integer (or 0 where 0 means "none"), a `float` a finite number, a `bool`
true or false, a `str` a string, a `tuple[...]` a list of those, `X | None` also null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

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

    # int fields that may be 0, besides those whose default is 0; every other one must be positive
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset()
    # float fields that must be positive; every other one must be finite
    POSITIVE_FLOATS: ClassVar[frozenset[str]] = frozenset({"rms_norm_eps", "rope_theta"})

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict, ignoring keys the architecture does not use.

        Raises:
            ConfigError: a required field is missing, naming every missing one; or a field's
                value has the wrong type or range (`check_fields`).
        """
        cls.check_fields(params)
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

    @classmethod
    def check_fields(cls, params: dict[str, Any]) -> None:
        """Check each of this config's fields that `params` holds against its annotation; a
        family's `from_dict` calls it before it computes anything from the dict.

        Raises:
            ConfigError: naming the first bad field, its value and what it must be.
        """
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in params:
                zero_ok = f.name in cls.ZERO_ALLOWED or f.default == 0
                check_value(f.name, params[f.name], hints[f.name], zero_ok=zero_ok, positive=f.name in cls.POSITIVE_FLOATS)


def check_value(name: str, value: Any, hint: Any, *, zero_ok: bool = False, positive: bool = False) -> None:
    """Raise ConfigError("NAME must be EXPECTED, got VALUE") when `value` does not fit `hint`."""
    expected = _expected(hint, value, zero_ok=zero_ok, positive=positive)
    if expected is not None:
        raise ConfigError(f"{name} must be {expected}, got {_shown(value)}")


def _expected(hint: Any, value: Any, *, zero_ok: bool, positive: bool) -> str | None:
    """What `value` should have been, or None when it fits `hint`."""
    args = typing.get_args(hint)
    if hint is Any:
        return None
    if type(None) in args:  # X | None
        if value is None:
            return None
        (inner,) = (a for a in args if a is not type(None))
        expected = _expected(inner, value, zero_ok=zero_ok, positive=positive)
        return expected and f"{expected} or null"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        if is_number and isinstance(value, int) and value >= (0 if zero_ok else 1):
            return None
        return "a non-negative integer" if zero_ok else "a positive integer"
    if hint is float:
        if is_number and math.isfinite(value) and (value > 0 or not positive):
            return None
        return "a positive number" if positive else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(hint) is tuple and args[0] in _ITEMS:
        fits, kind = _ITEMS[args[0]]
        return None if isinstance(value, (list, tuple)) and all(map(fits, value)) else f"a list of {kind}"
    return None


# what a list field's items must be: layer indices, layer names, or any number (an infinite limit too)
_ITEMS = {
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "non-negative integers"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "numbers"),
    str: (lambda v: isinstance(v, str), "strings"),
}


def _shown(value: Any) -> str:
    """A config value as config.json spells it, with its JSON kind where the text is ambiguous."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kinds = {str: "a string", bool: "a boolean", list: "a list", tuple: "a list", dict: "an object"}
    kind = kinds.get(type(value))
    return f"{text} ({kind})" if kind else text


def time_step_limit(params: dict[str, Any]) -> tuple[float, float]:
    """A Mamba-2 config's (min, max) clamp of dt after the softplus, (0, inf) when absent; transformers
    writes infinity as {"__float__": "Infinity"}."""
    return tuple(_number("time_step_limit", v) for v in params.get("time_step_limit") or (0.0, math.inf))


def _number(name: str, value: Any) -> float:
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} holds {value!r}, not a number") from None


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
