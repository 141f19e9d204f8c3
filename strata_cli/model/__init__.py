"""MLX models. They own weights and the forward pass and know nothing of drafts."""

from .loader import ModelLoadError, load_model

__all__ = ["ModelLoadError", "load_model"]
