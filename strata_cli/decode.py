"""The decode loop shared by `generate`, `serve-stdio` and `bench`: prefill, plan, run, choose,
keep, commit, record.

Each step runs one window [root, d1..dD] through the engine, keeps the longest verified prefix
(speculative/acceptance.py), emits its outputs, and commits exactly the inputs those outputs rest
on. The planner (speculative/planner.py) sizes each window within the remaining token budget
and the context; emission stops at the first end-of-sequence token, and nothing after it is
committed.

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
from typing import Callable

from .engine.window import WindowEngine
from .healing import HealConstraint
from .options import GenerateOptions, SpecOptions
from .processors import Processors, ProcessorTrack
from .sampling import TokenChooser
from .speculative.acceptance import expected_keep_probs, greedy_keep, stop_at_eos
from .speculative.controller import DraftController
from .speculative.drafters import Drafter, request_drafter
from .speculative.planner import WindowPlanner
from .speculative.safe_window import QSA_BLOCK
from .telemetry import DecodeStats, WindowRecord

FINISH_STOP = "stop"  # an end-of-sequence token
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CONTEXT = "context"  # the context limit reached


@dataclass(frozen=True)
class Step:
    """Tokens one window emitted; `finish_reason` is set on the last step only."""

    tokens: list[int]
    finish_reason: str | None = None


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
    drafter: Drafter | None = None,
    controller: DraftController | None = None,
    banned: Sequence[Sequence[int]] = (),
    prefill_progress: Callable[[int, int], None] | None = None,
    heal: HealConstraint | None = None,
) -> Iterator[Step]:
    """Generate from `prompt_ids`, one window per step.

    Args:
        engine: the window engine; it is reset first.
        prompt_ids: the request's final token ids (at least one).
        options: max_tokens, temperature, seed, sampling filters and penalties.
        spec: max drafts per window (0 = serial), the drafter's min_match, and `auto`.
        eos_ids: ids that end generation (not emitted); `()` never stops early.
        stats: telemetry sink (default: a private one).
        prefilled: leading prompt tokens the engine already holds as committed state (restored
            from a checkpoint); 0 (default) resets the engine first.
        drafter: the request's draft source (speculative/drafters.py); None (default) = a
            suffix drafter over the request's own tokens. Drafts never change the output.
        controller: the draft-length controller for `spec.auto` (pass one to keep what it
            learned across requests); None (default) = a fresh one.
        banned: the token sequences of `options.ban_phrases` (tokenizer.phrase_sequences).
        prefill_progress: called as `prefill_progress(done, total)` after each prompt chunk.
        heal: the healed tail the first outputs must reproduce (healing.plan_heal); None = free.

    Yields:
        `Step`s; the last one carries the finish reason ("stop", "length" or "context").
    """
    stats = stats if stats is not None else DecodeStats()
    stats.pipeline = getattr(getattr(engine, "model", None), "pipeline_summary", None)  # the stages, across ranks
    prompt_ids = checked_prompt(prompt_ids, engine.max_context)
    chooser = TokenChooser(options, prompt_length=len(prompt_ids))
    processors = Processors(options, banned, heal) if options.has_processors or heal else None
    planner = plan_windows(engine, prompt_ids, spec, drafter, controller)
    if planner.controller is not None:
        stats.attach_controller(planner.controller)
    expert_probe = getattr(engine, "last_window_experts", None)  # streaming engines report reads
    prefill(engine, prompt_ids, prefilled, stats, prefill_progress)
    # Processor state rolls back with the engine's: the same inputs run, the same keep commits.
    track = ProcessorTrack(processors, prompt_ids[:-1], len(prompt_ids)) if processors else None

    root, pos0, emitted = prompt_ids[-1], len(prompt_ids) - 1, 0
    overlap = track is None and not chooser.is_sampling and getattr(engine, "can_overlap", False)
    if planner.drafter is None and overlap:
        yield from overlapped_serial(engine, root, pos0, options.max_tokens, eos_ids, stats)
        return
    while True:
        remaining = options.max_tokens - emitted
        finish = limit_reached(remaining, engine.context_left(pos0))
        if finish:
            yield Step([], finish)
            return
        start = time.perf_counter()
        plan = planner.plan(pos0, remaining)
        if plan.rows == 1 and overlap:
            # Nothing to verify: one-token steps overlap until a token brings drafts worth a
            # window; that step's launched successor is abandoned and the window runs instead.
            planner.decline(plan)
            for step in overlapped_serial(engine, root, pos0, remaining, eos_ids, stats, after=planner.after_step,
                                          declined=lambda: planner.declined):
                yield step
                if step.finish_reason:
                    return
                emitted, pos0, root = emitted + len(step.tokens), pos0 + len(step.tokens), step.tokens[-1]
            continue
        inputs = [root, *plan.drafts]
        warming = engine.ensure_warm(len(inputs), pos0)  # a new shape is built here, not inside the window
        stats.record_shape_warmup(warming)
        start += warming
        out = engine.run(inputs, pos0)
        row_tokens, draft_probs = choose_rows(out, inputs, pos0, chooser, track)
        verified = greedy_keep(inputs, row_tokens)  # with draws: speculative sampling (acceptance.py)
        keep, outputs = verified, row_tokens[:verified]
        eos_at = stop_at_eos(outputs, eos_ids)
        if eos_at is not None:
            keep, outputs = eos_at + 1, outputs[:eos_at]
        engine.commit(keep)
        if track is not None:
            track.commit(keep)
        seconds = time.perf_counter() - start
        experts = expert_probe() if expert_probe else None
        stats.record_window(WindowRecord(T=plan.rows, keep=keep, emitted=len(outputs), seconds=seconds,
                                         match_length=plan.match_length, from_global=plan.from_cache,
                                         proposed=plan.proposed, experts=experts))
        planner.learn(plan, verified=verified, seconds=seconds,
                      extra_seconds=experts.draft_read_seconds if experts else 0.0,
                      acceptance=None if draft_probs is None else expected_keep_probs(draft_probs, verified))
        if eos_at is not None:
            yield Step(outputs, FINISH_STOP)
            return
        planner.extend(outputs)
        emitted, pos0, root = emitted + len(outputs), pos0 + keep, outputs[-1]
        yield Step(outputs)


def checked_prompt(prompt_ids: Sequence[int], max_context: int) -> list[int]:
    """The prompt's ids as a list.

    Raises:
        PromptError: the prompt is empty or longer than the context.
    """
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) > max_context:
        raise PromptError(f"the prompt has {len(prompt_ids)} tokens but the context holds {max_context}")
    return prompt_ids


def plan_windows(engine: WindowEngine, prompt_ids: list[int], spec: SpecOptions, drafter: Drafter | None,
                 controller: DraftController | None) -> WindowPlanner:
    """The request's window planner: its drafter (the default one unless given) and, with
    `spec.auto`, the draft-length controller."""
    if spec.max_drafts and drafter is None:
        drafter = request_drafter(prompt_ids, max_drafts=spec.max_drafts, min_match=spec.min_match)
    if not (spec.auto and spec.max_drafts):
        controller = None
    elif controller is None:
        controller = DraftController(spec.max_drafts, cost_prior=spec.cost_prior)
    return WindowPlanner(drafter, max_drafts=spec.max_drafts, controller=controller,
                         context_left=engine.context_left, block_cap=engine.needs_block_cap,
                         block=engine.block or QSA_BLOCK,
                         read_cost=getattr(engine, "draft_read_cost", None))  # streamed experts' reads


def prefill(engine: WindowEngine, prompt_ids: list[int], prefilled: int, stats: DecodeStats,
            progress: Callable[[int, int], None] | None) -> None:
    """Bring the engine to the prompt less its root (the root is the first window's input),
    from `prefilled` committed positions (0 = from a reset)."""
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
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        progress(done[0], len(todo))

    engine.prefill(todo, progress=advance if progress else None)
    stats.record_prefill(len(prompt_ids) - 1 - prefilled, time.perf_counter() - start)
    stats.load_bytes_read += getattr(engine, "prefill_expert_bytes", 0)  # streamed experts the prompt read


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
