"""Logit processors with per-position state: repetition, presence and frequency penalties,
phrase bans and the prompt-edge healing constraint.

A processor's state after positions 0..n-1 is a `ProcessorState`, an immutable value, so a
window can hold one per row and a rollback is just keeping the right one (the "logit-processor
state" row of docs/design.md's state table). `ProcessorTrack` follows the window contract: `run`
gives the state each row of [root, d1..dD] is processed with (the state after the inputs up to
that row), `commit(keep)` keeps the state after the first `keep` inputs.

Semantics:
- repetition penalty (CTRL, as mlx-lm and Hugging Face): a token among the last
  `repetition_context` tokens, prompt included, has a positive logit divided by the penalty and
  a negative one multiplied by it;
- presence and frequency penalties (OpenAI): logit -= presence·[c > 0] + frequency·c, where c
  counts the token among the generated tokens (the prompt does not count);
- phrase bans: an Aho-Corasick automaton over token ids whose state advances per position;
  a token that would complete a banned sequence gets -inf. The prompt advances it too, so a
  phrase that starts in the prompt cannot be completed by the output;
- healing (healing.py): while the healed tail is not yet reproduced, only tokens consistent with
  what remains of it keep their logits (the rest get -inf); the state is the remaining tail,
  which each generated token shortens.

Every state is a function of the tokens and the prompt length alone, and needs only the last
`horizon` tokens besides the generated counts and the first generated tokens (the healed tail), so a checkpoint's tokens (serve/checkpoints.py)
restore it exactly: `ProcessorTrack.start` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .healing import HealConstraint
from .options import GenerateOptions


class PhraseAutomaton:
    """Aho-Corasick over token-id sequences: node = the longest suffix of the tokens so far that
    begins some banned sequence; `banned(node)` = tokens that would complete one.

    Args:
        sequences: banned token sequences (each at least one token).
    """

    def __init__(self, sequences: Sequence[Sequence[int]]):
        children: list[dict[int, int]] = [{}]
        is_end = [False]
        for seq in sequences:
            if not seq:
                raise ValueError("a banned token sequence is empty")
            node = 0
            for token in seq:
                if token not in children[node]:
                    children[node][token] = len(children)
                    children.append({})
                    is_end.append(False)
                node = children[node][token]
            is_end[node] = True
        self.depth = max((len(s) for s in sequences), default=0)
        self._children = children
        fail = [0] * len(children)
        order, queue = [], list(children[0].values())
        while queue:  # breadth first: a node's failure link is shallower, so already final
            node = queue.pop(0)
            order.append(node)
            for token, child in children[node].items():
                f = fail[node]
                while f and token not in children[f]:
                    f = fail[f]
                fail[child] = children[f].get(token, 0) if node else 0
                if fail[child] == child:
                    fail[child] = 0
                is_end[child] = is_end[child] or is_end[fail[child]]
                queue.append(child)
        self._fail = fail
        banned = [frozenset(t for t, c in children[0].items() if is_end[c])] * len(children)
        for node in order:
            own = {t for t, c in children[node].items() if is_end[c]}
            banned[node] = frozenset(own) | banned[fail[node]]
        self._banned = banned

    def step(self, node: int, token: int) -> int:
        while node and token not in self._children[node]:
            node = self._fail[node]
        return self._children[node].get(token, 0)

    def banned(self, node: int) -> frozenset[int]:
        return self._banned[node]


@dataclass(frozen=True)
class ProcessorState:
    """Processor state after `length` tokens; treat `counts` as read-only (states are shared)."""

    length: int
    recent: tuple[int, ...] = ()  # the last repetition_context tokens
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times
    node: int = 0  # PhraseAutomaton node
    tail: bytes = b""  # healed text the generated tokens have yet to reproduce


class Processors:
    """The request's logit processors (penalties and phrase bans from `GenerateOptions`).

    Args:
        options: the request's penalties, repetition context and phrases.
        banned: the token sequences of `options.ban_phrases` (tokenizer.phrase_sequences); it
            must be given exactly when phrases are.
        heal: the healed prompt's tail and token table (healing.py); None (default) = no healing.
    """

    def __init__(self, options: GenerateOptions, banned: Sequence[Sequence[int]] = (),
                 heal: HealConstraint | None = None):
        if bool(options.ban_phrases) != bool(banned):
            raise ValueError("ban phrases need their token sequences (and sequences need phrases)")
        self.repetition_penalty = options.repetition_penalty
        self.context = options.repetition_context if options.repetition_penalty != 1.0 else 0
        self.presence = options.presence_penalty
        self.frequency = options.frequency_penalty
        self.is_counting = bool(self.presence or self.frequency)
        self.automaton = PhraseAutomaton(banned) if banned else None
        self.heal = heal if heal is not None and heal.tail else None
        # Tokens a state depends on besides the counts (what `start` reads).
        self.horizon = max(self.context, self.automaton.depth if self.automaton else 0)

    def start(self, tokens: Sequence[int], prompt_length: int) -> ProcessorState:
        """The state after `tokens` (positions 0..len-1) of a request whose prompt has
        `prompt_length` tokens: tokens at or past it are generated ones."""
        skip = max(len(tokens) - self.horizon, 0)
        state = ProcessorState(length=skip)
        for token in tokens[skip:]:
            state = self.advance(state, token, prompt_length)
        if self.is_counting:  # every generated token counts, also those before the horizon
            counts: dict[int, int] = {}
            for token in tokens[prompt_length:]:
                counts[token] = counts.get(token, 0) + 1
            state = replace(state, counts=counts)
        if self.heal is not None:  # the first generated tokens consume the tail (a few at most)
            tail = self.heal.tail
            for token in tokens[prompt_length:]:
                if not tail:
                    break
                tail = self.heal.table.after(tail, token)
            state = replace(state, tail=tail)
        return state

    def advance(self, state: ProcessorState, token: int, prompt_length: int) -> ProcessorState:
        """The state after one more token (at position `state.length`)."""
        recent = (state.recent + (token,))[-self.context:] if self.context else ()
        counts = state.counts
        if self.is_counting and state.length >= prompt_length:
            counts = dict(counts)
            counts[token] = counts.get(token, 0) + 1
        node = self.automaton.step(state.node, token) if self.automaton else 0
        tail = state.tail
        if self.heal is not None and state.length < prompt_length:
            tail = self.heal.tail  # after a prompt token, all of the tail is still to come
        elif tail:
            tail = self.heal.table.after(tail, token)
        return ProcessorState(state.length + 1, recent, counts, node, tail)

    def apply(self, logits: mx.array, states: Sequence[ProcessorState]) -> mx.array:
        """logits (T, V) -> processed logits; row i with states[i]."""
        rows, cols, scale, shift = [], [], [], []
        ban_rows, ban_cols = [], []
        for i, state in enumerate(states):
            edits: dict[int, list[float]] = {}  # token -> [is_repeated, subtracted]
            for token in set(state.recent):
                edits[token] = [1.0, 0.0]
            for token, count in state.counts.items():
                edits.setdefault(token, [0.0, 0.0])[1] = self.presence + self.frequency * count
            for token, (is_repeated, subtracted) in edits.items():
                rows.append(i)
                cols.append(token)
                scale.append(is_repeated)
                shift.append(subtracted)
            if self.automaton is not None:
                banned = self.automaton.banned(state.node)
                ban_rows += [i] * len(banned)
                ban_cols += list(banned)
        if rows:
            r, c = mx.array(rows), mx.array(cols)
            picked = logits[r, c]
            penalty = self.repetition_penalty
            # a zero logit stays 0: times a penalty that is inf in float32 it would be NaN
            repeated = mx.where(picked > 0, picked / penalty, mx.where(picked < 0, picked * penalty, picked))
            new = mx.where(mx.array(scale) > 0, repeated, picked) - mx.array(shift)
            logits = logits.at[r, c].add(new - picked)
        if ban_rows:
            logits = logits.at[mx.array(ban_rows), mx.array(ban_cols)].add(-mx.inf)
        if any(state.tail for state in states):
            width = logits.shape[-1]
            every = mx.ones((width,), dtype=mx.bool_)
            masks = [self.heal.table.allowed_mx(s.tail, width) if s.tail else every for s in states]
            logits = mx.where(mx.stack(masks), logits, -mx.inf)
        return logits


class ProcessorTrack:
    """One request's processor state through the window contract.

    Args:
        processors: the request's processors.
        tokens: the committed tokens (the prompt less its root, or a restored prefix of it).
        prompt_length: the request's prompt length (the root included).
    """

    def __init__(self, processors: Processors, tokens: Sequence[int], prompt_length: int):
        self.processors = processors
        self.prompt_length = prompt_length
        self.state = processors.start(tokens, prompt_length)
        self._rows: list[ProcessorState] | None = None

    def run(self, inputs: Sequence[int]) -> list[ProcessorState]:
        """The state each row is processed with: row i sees the inputs up to and including i."""
        if self._rows is not None:
            raise RuntimeError("run() again before commit()")
        state, rows = self.state, []
        for token in inputs:
            state = self.processors.advance(state, token, self.prompt_length)
            rows.append(state)
        self._rows = rows
        return rows

    def commit(self, keep: int) -> None:
        """Keep the state after the first `keep` inputs of the last run."""
        if self._rows is None or not 1 <= keep <= len(self._rows):
            raise RuntimeError(f"commit({keep}) does not match an open run")
        self.state, self._rows = self._rows[keep - 1], None
