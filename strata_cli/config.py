"""Model configuration and run options: every knob strata has lives here, checked once.

The CLI, `STRATA_*` environment variables and library callers all build these dataclasses;
everything below `cli.py` receives them whole and never re-reads the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .spec.suffix_drafter import DEFAULT_MIN_MATCH

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0
DEFAULT_SEED = 0
MAX_SUFFIX_DRAFT = 7  # a window is root + drafts; T <= 8 is what every rollback rule is tested for
PREFILL_CHUNK = 512
FOLD_MODES = ("lazy", "eager")


class ConfigError(ValueError):
    """A checkpoint's config.json, or a run option, that strata cannot use."""


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


@dataclass(frozen=True)
class EngineOptions:
    """How the window engine keeps and rolls back state.

    Args:
        fold: "lazy" (default) defers folding kept GDN rows into the recurrent state until the
            next window, where it joins that window's graph; "eager" folds at commit.
        partial: commit the root row inside `run` (it is always kept), so commit folds keep-1 rows.
        max_context: positions the engine may hold (prompt + generated); None = the model's maximum.
        dtype: "float32", "bfloat16", "float16", or None for the checkpoint's own (float32 on CPU).
    """

    fold: str = "lazy"
    partial: bool = False
    max_context: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.fold not in FOLD_MODES:
            raise ConfigError(f"fold must be one of {FOLD_MODES}, got {self.fold!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be at least 2, got {self.max_context}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class GenerateOptions:
    """What one request asks for.

    Args:
        max_tokens: most tokens to generate (default 256).
        temperature: 0 is greedy (default); above 0 samples from softmax(logits / temperature).
        seed: seeds this request's own sampler; the global seed is left alone.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    seed: int = DEFAULT_SEED

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class SpecOptions:
    """Suffix-lookup speculative decoding.

    Args:
        max_drafts: most drafts per window (0 = off, the default).
        min_match: shortest suffix match (in tokens) that may propose drafts (default 4, at least 3).
    """

    max_drafts: int = 0
    min_match: int = DEFAULT_MIN_MATCH

    def __post_init__(self):
        if not 0 <= self.max_drafts <= MAX_SUFFIX_DRAFT:
            raise ConfigError(
                f"suffix draft must be in 0..{MAX_SUFFIX_DRAFT}, got {self.max_drafts}"
            )
        if self.min_match < 3:
            raise ConfigError(
                f"min_match must be at least 3 (drafts are looked up by trigram), got {self.min_match}"
            )

    @property
    def is_speculative(self) -> bool:
        return self.max_drafts > 0

