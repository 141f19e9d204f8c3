"""mlx-lm on the same checkpoint, timed the way bench times strata.

Both sides prefill `prompt[:-1]` untimed, then time the generation of exactly `max_tokens`
tokens from the last prompt token (EOS never stops either: mlx-lm's `generate_step` and
`speculative_generate_step` do not look at EOS; only its `stream_generate` does).

- `mlx-lm`: `mlx_lm.generate.generate_step`, serial greedy decoding.
- `mlx-lm-spec`: `mlx_lm.generate.speculative_generate_step` with a draft model (the target
  itself unless another is given). mlx-lm allows it only when every cache can be trimmed; for
  hybrid models (GDN/attention, like Qwen3-Next) it refuses with "Speculative decoding requires
  a trimmable prompt cache"; bench records that refusal as the mode's result.

mlx-lm is optional (the `bench` extra); `require_mlx_lm` says how to install it.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path

from .results import PeerRefusal, RunResult

PEER_SERIAL = "mlx-lm"
PEER_SPEC = "mlx-lm-spec"
PEER_MODES = (PEER_SERIAL, PEER_SPEC)
DEFAULT_PEER_DRAFT_TOKENS = 2  # mlx-lm's own default num_draft_tokens


class PeerError(RuntimeError):
    """mlx-lm is missing or cannot load the checkpoint."""


def require_mlx_lm():
    """Import mlx_lm's generation functions, or raise PeerError with the install line."""
    try:
        mlx_generate = importlib.import_module("mlx_lm.generate")  # the module, not mlx_lm.generate()
        from mlx_lm.models.cache import make_prompt_cache
    except ImportError as e:
        raise PeerError(
            f"the mlx-lm peer needs mlx-lm ({e}): pip install 'strata-cli[bench]', "
            "or leave the peers out with --no-peers"
        ) from None
    return mlx_generate, make_prompt_cache


@dataclass
class MlxLmPeer:
    """A loaded mlx-lm model (and its draft model) to run the peer modes with.

    Args:
        model: the mlx-lm model (any mlx_lm.models architecture).
        draft_model: the draft model of `mlx-lm-spec` (default: `model` itself).
        num_draft_tokens: drafts per step in `mlx-lm-spec` (default 2, mlx-lm's default).
    """

    model: object
    draft_model: object | None = None
    num_draft_tokens: int = DEFAULT_PEER_DRAFT_TOKENS

    @classmethod
    def load(cls, path: Path, *, dtype=None, draft_path: Path | None = None,
             num_draft_tokens: int = DEFAULT_PEER_DRAFT_TOKENS) -> "MlxLmPeer":
        """Load a checkpoint directory with `mlx_lm.load`, cast to `dtype` (an mx.Dtype) if given.

        MLX's CPU `gather_mm` runs in float32 only, so on CPU pass the dtype strata runs in.

        Raises:
            PeerError: mlx-lm is missing or cannot read the checkpoint.
        """
        require_mlx_lm()
        from mlx_lm import load

        def one(p: Path):
            try:
                loaded = load(str(p))
            except Exception as e:  # mlx-lm raises many types (ValueError, FileNotFoundError, ...)
                raise PeerError(f"mlx-lm cannot load {p}: {type(e).__name__}: {e} "
                                "(leave the peers out with --no-peers)") from None
            model = loaded[0]
            if dtype is not None:
                model.set_dtype(dtype)
            return model

        model = one(Path(path))
        draft = one(Path(draft_path)) if draft_path else None
        return cls(model=model, draft_model=draft, num_draft_tokens=num_draft_tokens)

    def run(self, mode: str, prompt_ids: list[int], max_tokens: int) -> RunResult | PeerRefusal:
        """Generate `max_tokens` greedily in `mode` ("mlx-lm" or "mlx-lm-spec").

        Returns:
            The run, or a `PeerRefusal` carrying mlx-lm's own message when it declines.
        """
        if mode == PEER_SERIAL:
            return self._serial(prompt_ids, max_tokens)
        if mode == PEER_SPEC:
            return self._speculative(prompt_ids, max_tokens)
        raise ValueError(f"unknown peer mode {mode!r} (expected one of {PEER_MODES})")

    def _prefill(self, model, cache, prompt_ids: list[int]) -> None:
        import mlx.core as mx

        if len(prompt_ids) > 1:
            model(mx.array([prompt_ids[:-1]]), cache=cache)
            mx.eval([c.state for c in cache])

    def _serial(self, prompt_ids: list[int], max_tokens: int) -> RunResult:
        import mlx.core as mx

        mlx_generate, make_prompt_cache = require_mlx_lm()
        cache = make_prompt_cache(self.model)
        self._prefill(self.model, cache, prompt_ids)
        start = time.perf_counter()
        steps = mlx_generate.generate_step(
            mx.array(prompt_ids[-1:]), self.model, max_tokens=max_tokens, prompt_cache=cache
        )
        tokens = [int(token) for token, _ in steps]
        return RunResult(token_ids=[tokens], tokens=len(tokens), seconds=time.perf_counter() - start)

    def _speculative(self, prompt_ids: list[int], max_tokens: int) -> RunResult | PeerRefusal:
        import mlx.core as mx

        mlx_generate, make_prompt_cache = require_mlx_lm()
        draft = self.draft_model if self.draft_model is not None else self.model
        model_cache, draft_cache = make_prompt_cache(self.model), make_prompt_cache(draft)
        steps = mlx_generate.speculative_generate_step(
            mx.array(prompt_ids[-1:]), self.model, draft, prompt_cache=model_cache + draft_cache,
            num_draft_tokens=self.num_draft_tokens, max_tokens=max_tokens,
        )
        try:
            first = next(steps)  # mlx-lm checks its caches here, before any work
        except ValueError as e:
            if "trimmable" in str(e):
                return PeerRefusal(str(e))
            raise
        # Accepted: prefill both caches and start over, timing only the generation.
        steps.close()
        del first
        model_cache, draft_cache = make_prompt_cache(self.model), make_prompt_cache(draft)
        self._prefill(self.model, model_cache, prompt_ids)
        self._prefill(draft, draft_cache, prompt_ids)
        start = time.perf_counter()
        steps = mlx_generate.speculative_generate_step(
            mx.array(prompt_ids[-1:]), self.model, draft, prompt_cache=model_cache + draft_cache,
            num_draft_tokens=self.num_draft_tokens, max_tokens=max_tokens,
        )
        tokens, from_draft = [], 0
        for token, _, drafted in steps:
            tokens.append(int(token))
            from_draft += bool(drafted)
        seconds = time.perf_counter() - start
        return RunResult(token_ids=[tokens], tokens=len(tokens), seconds=seconds,
                         summary={"drafts_kept": from_draft, "num_draft_tokens": self.num_draft_tokens})
