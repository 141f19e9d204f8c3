"""One text-level request: text in, text deltas and one final record out.

Every front end (`generate`, `serve-stdio`, `bench`) goes through `TextRequest`: it tokenizes,
plans prompt healing (healing.py), turns banned phrases into token sequences, runs the decode
loop (decode.py), cuts the text at stop strings (stop.py), detokenizes, and says
why generation finished. A front end parses its input, renders what comes back, and decides
where the engine's state comes from (a reset, or a checkpoint it restored).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Collection, Iterator, Sequence

from .decode import FINISH_STOP, Step, generate
from .engine.window import WindowEngine
from .healing import TailSkipper, plan_heal
from .options import GenerateOptions, SpecOptions
from .speculative.controller import DraftController
from .speculative.drafters import Drafter
from .stop import StopMatcher
from .telemetry import DecodeStats
from .tokenizer import StreamingDetokenizer, Tokenizer

FINISH_CANCELLED = "cancelled"  # the front end stopped the request (a signal, a cancel, a client gone)


class TextRequest:
    """One prompt's way from text to text.

    Args:
        tokenizer: the checkpoint's tokenizer.
        text: the prompt as the model should see it (a chat template already rendered).
        options: generate options (max_tokens, sampling, penalties, banned phrases, healing).
        stop: stop strings: the text ends before the first one (default: none).
        heal: whether the prompt's end may be healed (when `options.heal`); False for text a
            chat template rendered, which ends where the template says.
        stats: the telemetry sink (default: a fresh one).

    Attributes:
        ids: the prompt's token ids as encoded.
        heal_plan: what healing does to them (`prompt_ids` is what the engine takes).
        finish_reason: "stop", "length", "context" or "cancelled"; None until finished.
        first_token_at: `time.perf_counter()` when the first token came, or None.
    """

    def __init__(self, tokenizer: Tokenizer, text: str, options: GenerateOptions, *, stop: Sequence[str] = (),
                 heal: bool = True, stats: DecodeStats | None = None):
        self.tokenizer = tokenizer
        if options.seed is None:  # every unseeded request samples anew; the seed used is reported
            options = dataclasses.replace(options, seed=secrets.randbits(63))
        self.options = options
        self.stats = stats if stats is not None else DecodeStats()
        self.stats.seed = options.seed if options.is_sampling else None
        self.ids = tokenizer.encode(text)
        heal = heal and options.heal
        self.heal_plan = plan_heal(self.ids, tokenizer.heal_table() if heal else None, enabled=heal)
        self.stats.record_heal(self.heal_plan.removed)
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self._detok = StreamingDetokenizer(tokenizer)
        self._skip = TailSkipper(self.heal_plan.tail_text)  # the healed tail is the prompt's text
        self._stops = StopMatcher(stop)
        self._parts: list[str] = []

    @property
    def prompt_ids(self) -> list[int]:
        """The ids the engine takes: the prompt less its healed tail."""
        return self.heal_plan.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        """The generated ids so far (those the text was decoded from)."""
        return self._detok.ids

    @property
    def text(self) -> str:
        """The text released so far (all of it after `close`)."""
        return "".join(self._parts)

    def steps(self, engine: WindowEngine, *, spec: SpecOptions, eos_ids: Collection[int] | None = None,
              prefilled: int = 0, drafter: Drafter | None = None, controller: DraftController | None = None,
              prefill_progress: Callable[[int, int], None] | None = None) -> Iterator[Step]:
        """The decode loop on this request's ids (decode.generate's arguments; `eos_ids`
        defaults to the tokenizer's). Token ids only: `stream` turns them into text."""
        banned = self.tokenizer.phrase_sequences(self.options.ban_phrases) if self.options.ban_phrases else ()
        heal = self.heal_plan.constraint(self.tokenizer.heal_table()) if self.heal_plan.removed else None
        return generate(engine, self.prompt_ids, options=self.options, spec=spec,
                        eos_ids=self.tokenizer.eos_ids if eos_ids is None else eos_ids, stats=self.stats,
                        prefilled=prefilled, drafter=drafter, controller=controller, banned=banned,
                        prefill_progress=prefill_progress, heal=heal)

    def stream(self, engine: WindowEngine, *, spec: SpecOptions, cancelled: Callable[[], bool] | None = None,
               **steps) -> Iterator[str]:
        """Generate, yielding text deltas, until a finish, a stop string or `cancelled()`; then
        call `close` for the rest. Keyword arguments go to `steps`."""
        window_steps = self.steps(engine, spec=spec, **steps)
        try:
            for step in window_steps:
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                delta = self._release(self._detok.add(step.tokens))
                if delta:
                    yield delta
                if self._stops.stopped:
                    self.finish_reason = FINISH_STOP
                    return
                if step.finish_reason:
                    self.finish_reason = step.finish_reason
                    return
                if cancelled is not None and cancelled():
                    return
        finally:
            window_steps.close()

    def close(self) -> str:
        """Release what the detokenizer and the stop matcher hold back; the last delta. A request
        that did not finish is "cancelled"; a stop string completed by the held text is "stop"."""
        delta = self._release(self._detok.finish())
        held = self._stops.flush()
        if held:
            self._parts.append(held)
        if self._stops.stopped:
            self.finish_reason = FINISH_STOP
        elif self.finish_reason is None:
            self.finish_reason = FINISH_CANCELLED
        return delta + held

    def _release(self, decoded: str) -> str:
        text = self._stops.feed(self._skip.feed(decoded))
        if text:
            self._parts.append(text)
        return text
