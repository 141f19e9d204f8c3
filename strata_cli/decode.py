"""The decode loop shared by `generate`, `serve-stdio` and `bench`.

Each step runs one window [root, d1..dD] through the engine, keeps the longest verified prefix
(speculative/verify.py), emits its outputs, and commits exactly the inputs those outputs rest
on. The window never exceeds the remaining token budget or the context
(speculative/safe_window.py); emission stops at the first end-of-sequence token, and nothing
after it is committed.

Greedy decoding with nothing between the logits and the token (no processors, healing or
sampling) overlaps its one-token steps (`overlapped_serial`): the same tokens, commits and
windows, with each step's graph built while the device computes the one before. Serial decoding
is all such steps; with drafts, a stretch of them runs wherever there is nothing to verify, and
ends at the token that brings drafts worth a window (the step launched on that token is
abandoned, and the window runs just as the plain loop would run it).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

from .engine.window import WindowEngine
from .healing import HealConstraint
from .options import GenerateOptions, SpecOptions
from .processors import Processors, ProcessorTrack
from .sampling import TokenChooser
from .speculative.controller import DraftController
from .speculative.safe_window import safe_window
from .speculative.suffix_drafter import EMPTY_PROPOSAL, Proposal, SuffixDrafter
from .speculative.verify import expected_keep_probs, greedy_keep, stop_at_eos
from .telemetry import DecodeStats, WindowRecord

FINISH_STOP = "stop"  # an end-of-sequence token
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CONTEXT = "context"  # the context limit reached

@dataclass(frozen=True)
class Step:
    """Tokens one window emitted; `finish_reason` is set on the last step only."""

    tokens: list[int]
    finish_reason: str | None = None


class ContextDrafter(Protocol):
    """Proposes drafts that continue a given token sequence (`SuffixDrafter` is one)."""

    def propose_for(self, context: Sequence[int], max_drafts: int) -> Proposal: ...


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, or longer than the context)."""


def generate(
    engine: WindowEngine,
    prompt_ids: Sequence[int],
    *,
    options: GenerateOptions,
    spec: SpecOptions,
    eos_ids: Collection[int],
    stats: DecodeStats | None = None,
    prefilled: int = 0,
    fallback_drafter: ContextDrafter | None = None,
    controller: DraftController | None = None,
    banned: Sequence[Sequence[int]] = (),
    prefill_progress: Callable[[int, int], None] | None = None,
    heal: HealConstraint | None = None,
) -> Iterator[Step]:
    """Generate from `prompt_ids`, one window per step.

    Args:
        engine: the window engine; it is reset first.
        prompt_ids: the request's final token ids (at least one).
        options: max_tokens, temperature, seed.
        spec: max drafts per window (0 = serial), the drafter's min_match, and `auto` (a
            draft-length controller picks each window's drafts, up to max_drafts).
        eos_ids: ids that end generation (not emitted); empty (`()`) never stops early, so
            exactly max_tokens are generated (bench does this).
        stats: telemetry sink (default: a private one).
        prefilled: how many leading prompt tokens the engine already holds as committed state
            (restored from a checkpoint); 0 (default) resets the engine first.
        fallback_drafter: asked to continue the request's tokens when its own drafter proposes
            nothing (a cross-request suffix cache); None (default) = the request's drafter only.
            It changes drafts only, never the output; its windows are counted as `from_global`.
        controller: the draft-length controller to use with `spec.auto` (pass one to keep what
            it learned across requests); None (default) = a fresh one per request. It only
            changes how many drafts a window verifies, never the output.
        banned: the token sequences of `options.ban_phrases` (tokenizer.phrase_sequences);
            given exactly when phrases are.
        prefill_progress: called as `prefill_progress(done, total)` after each prompt chunk
            (a progress bar); None (default) = quiet.
        heal: the healed tail the first outputs must reproduce (healing.plan_heal; `prompt_ids`
            is then the prompt less its healed tokens); None (default) = outputs are free.

    Yields:
        `Step`s; the last one carries the finish reason ("stop", "length" or "context").
    """
    stats = stats if stats is not None else DecodeStats()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) > engine.max_context:
        raise PromptError(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {engine.max_context}"
        )
    chooser = TokenChooser(options, prompt_length=len(prompt_ids))
    processors = Processors(options, banned, heal) if options.has_processors or heal else None
    max_drafts = spec.max_drafts
    drafter = SuffixDrafter(prompt_ids, min_match=spec.min_match) if max_drafts else None
    if not (spec.auto and max_drafts):
        controller = None
    elif controller is None:
        controller = DraftController(max_drafts, cost_prior=spec.cost_prior)
    if controller is not None:
        stats.attach_controller(controller)
    expert_probe = getattr(engine, "last_window_experts", None)  # streaming engines report reads
    read_cost = getattr(engine, "draft_read_cost", None)  # and predict what drafts cost in reads

    if prefilled == 0:
        engine.reset()
    elif not (engine.length == prefilled < len(prompt_ids)):
        raise ValueError(
            f"prefilled={prefilled} must equal the engine's committed length ({engine.length}) "
            f"and leave the root unprocessed (prompt of {len(prompt_ids)} tokens)"
        )
    stats.record_prompt(len(prompt_ids))
    start = time.perf_counter()
    todo = prompt_ids[prefilled:-1]
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        prefill_progress(done, len(todo))

    engine.prefill(todo, progress=advance if prefill_progress else None)
    stats.record_prefill(len(prompt_ids) - 1 - prefilled, time.perf_counter() - start)
    stats.load_bytes_read += getattr(engine, "prefill_expert_bytes", 0)  # streamed experts the prompt read
    # Processor state rolls back with the engine's: the same inputs run, the same keep commits.
    track = ProcessorTrack(processors, prompt_ids[:-1], len(prompt_ids)) if processors else None

    root, pos0, emitted = prompt_ids[-1], len(prompt_ids) - 1, 0
    overlap = track is None and not chooser.is_sampling and getattr(engine, "can_overlap", False)
    if not max_drafts and overlap:
        yield from overlapped_serial(engine, root, pos0, options.max_tokens, eos_ids, stats)
        return

    def plan(pos0: int, remaining: int, extra_cost=read_cost) -> tuple[Proposal, bool, int, int]:
        """(proposal, from_global, T, proposed) of the window rooted at pos0; `extra_cost(T)`:
        seconds a window of T rows costs beyond the controller's curve."""
        proposal = drafter.propose(max_drafts) if drafter else EMPTY_PROPOSAL
        from_global = False
        if drafter is not None and fallback_drafter is not None and not proposal.tokens:
            proposal = fallback_drafter.propose_for(drafter.history, max_drafts)
            from_global = bool(proposal.tokens)
        T = safe_window(
            num_drafts=len(proposal.tokens),
            remaining_tokens=remaining,
            context_left=engine.context_left(pos0),
            pos0=pos0,
            block_cap=engine.needs_block_cap,
        )
        proposed = T - 1
        if controller is not None and proposed:
            T = 1 + controller.choose(proposal.match_length, proposed, extra_cost=extra_cost)  # before any read
        return proposal, from_global, T, proposed

    def abandoned_step(T: int) -> float:
        """Drafts chosen in a stretch of overlapped steps also cost the step already launched
        on the token, which the window replaces (its work is thrown away)."""
        return controller.window_cost(1) if T > 1 else 0.0

    planned = None  # the next window's plan, when a stretch of overlapped steps made it
    # (drafts proposed, match length) of the plan the next overlapped step runs: drafts `auto`
    # declined there are counted like a declined window's (telemetry: drafts_declined, coverage).
    declined = [0, 0]

    def decline(proposal: Proposal, proposed: int) -> None:
        """The next overlapped step runs without these proposed drafts."""
        declined[:] = [proposed, proposal.match_length if proposed else 0]

    def drafts_wanted(token: int, seconds: float, pos0: int, remaining: int) -> bool:
        """After an overlapped step: learn its cost, extend the drafts' history, and end the
        stretch when the next window should verify drafts."""
        nonlocal planned
        if controller is not None:
            controller.observe(T=1, keep=1, seconds=seconds)
        drafter.extend([token])
        next_plan = plan(pos0, remaining, abandoned_step)
        if next_plan[2] == 1:
            decline(next_plan[0], next_plan[3])
            return False
        planned = next_plan
        return True

    while True:
        remaining = options.max_tokens - emitted
        finish = limit_reached(remaining, engine.context_left(pos0))
        if finish:
            yield Step([], finish)
            return
        start = time.perf_counter()
        proposal, from_global, T, proposed = planned or plan(pos0, remaining)
        planned = None
        if T == 1 and overlap:
            # Nothing to verify: one-token steps overlap (each built while the one before
            # runs) until a token brings drafts worth a window; that step's launched
            # successor is abandoned and the window runs instead.
            decline(proposal, proposed)
            for step in overlapped_serial(engine, root, pos0, remaining, eos_ids, stats, after=drafts_wanted,
                                          declined=lambda: tuple(declined)):
                yield step
                if step.finish_reason:
                    return
                emitted, pos0, root = emitted + len(step.tokens), pos0 + len(step.tokens), step.tokens[-1]
            continue
        inputs = [root, *proposal.tokens[: T - 1]]
        out = engine.run(inputs, pos0)
        row_tokens, draft_probs = choose_rows(out, inputs, pos0, chooser, track)
        keep = greedy_keep(inputs, row_tokens)  # with draws: speculative sampling (verify.py)
        outputs = row_tokens[:keep]
        verified = keep
        eos_at = stop_at_eos(outputs, eos_ids)
        if eos_at is not None:
            keep, outputs = eos_at + 1, outputs[:eos_at]
        engine.commit(keep)
        if track is not None:
            track.commit(keep)
        seconds = time.perf_counter() - start
        experts = expert_probe() if expert_probe else None
        stats.record_window(
            WindowRecord(
                T=len(inputs),
                keep=keep,
                emitted=len(outputs),
                seconds=seconds,
                match_length=proposal.match_length if proposed else 0,
                from_global=from_global and len(inputs) > 1,
                proposed=proposed,
                experts=experts,
            )
        )
        if controller is not None:
            controller.observe(T=len(inputs), keep=verified, seconds=seconds, match_length=proposal.match_length,
                               extra_seconds=experts.draft_read_seconds if experts else 0.0,
                               acceptance=None if draft_probs is None else expected_keep_probs(draft_probs, verified))
        if eos_at is not None:
            yield Step(outputs, FINISH_STOP)
            return
        if drafter:
            drafter.extend(outputs)
        emitted += len(outputs)
        pos0 += keep
        root = outputs[-1]
        yield Step(outputs)


def limit_reached(remaining_tokens: int, context_left: int) -> str | None:
    """Why no further window may run — the token budget first, then the context — or None."""
    if remaining_tokens <= 0:
        return FINISH_LENGTH
    if context_left <= 0:
        return FINISH_CONTEXT
    return None


def overlapped_serial(engine: WindowEngine, root: int, pos0: int, max_tokens: int,
                      eos_ids: Collection[int], stats: DecodeStats,
                      after: Callable[[int, float, int, int], bool] | None = None,
                      declined: Callable[[], tuple[int, int]] | None = None) -> Iterator[Step]:
    """Greedy serial decoding, one token per window, each window launched before the previous
    token is read back (as mlx-lm's generate_step does with `async_eval`).

    Window n+1's input is window n's greedy token while still on the device; window n is
    committed before n+1 is built (its input was already emitted), and n+1 is committed only
    after its input is known not to end generation, or abandoned — so the committed state at
    every yield and at the end is what the window loop leaves.

    `after(token, seconds, next_pos0, tokens_left)`, called after each emitted token that
    generation goes on past, may end the steps there (True): the window launched on that token
    is abandoned and the generator returns with no finish reason, the token being the caller's
    next root at `next_pos0`.

    `declined()`, where given, says what drafts the caller proposed and declined for the step
    being recorded (proposed, match length); its records carry them.
    """
    emitted, start = 0, time.perf_counter()
    finish = limit_reached(max_tokens, engine.context_left(pos0))
    if finish:
        yield Step([], finish)
        return
    current = engine.launch(root, pos0)
    engine.commit(1)
    pending = False  # a launched window awaiting commit or abandon
    try:
        while True:
            # Known before this token is read: whether it is the last one the limits allow.
            finish = limit_reached(max_tokens - emitted - 1, engine.context_left(pos0 + 1))
            following = None if finish else engine.launch(current, pos0 + 1)
            pending = following is not None
            token = current.value()
            now = time.perf_counter()
            stop = token in eos_ids
            proposed, match_length = declined() if declined else (0, 0)
            stats.record_window(WindowRecord(T=1, keep=1, emitted=0 if stop else 1, seconds=now - start,
                                             match_length=match_length, proposed=proposed))
            record_start, start = start, now
            if stop:
                yield Step([], FINISH_STOP)
                return
            emitted, pos0 = emitted + 1, pos0 + 1
            if finish:
                yield Step([token])
                yield Step([], finish)
                return
            yield Step([token])
            if after is not None and after(token, now - record_start, pos0, max_tokens - emitted):
                return  # `finally` abandons the window launched on `token`
            engine.commit(1)
            pending = False
            current = following
    finally:
        if pending:  # an end-of-sequence token, or the caller stopped early
            engine.abandon()


def choose_rows(out, inputs: Sequence[int], pos0: int, chooser: TokenChooser,
                track: ProcessorTrack | None) -> tuple[list[int], list[float] | None]:
    """Each row's token (greedy or drawn, after the processors with that row's state) and,
    when sampling, the probability each row gave the next input."""
    if track is None and not chooser.is_sampling:
        return out.tokens, None  # the engine's argmax is the greedy choice
    logits = out.logits if track is None else track.processors.apply(out.logits, track.run(inputs))
    choice = chooser.choose(logits, pos0, inputs)
    return choice.tokens, choice.draft_probs
