"""Prompt-edge healing: back up over a prompt's trailing token(s) and make the first generated
tokens reproduce the removed text (the "tail"), so the model continues the text as it would
have seen it tokenized in training.

A prompt that ends in whitespace or inside a word ends on a token boundary that byte-level BPE
rarely makes in running text ("\\n    " is one token before code, "\\n" alone starts a new
top-level statement). Healing removes the last k tokens (`plan_heal`) and, until the tail is
consumed, allows only tokens whose bytes are a non-empty prefix of the remaining tail or start
with all of it (`HealTable.allowed`, a vectorized prefix test cached per tail). The constraint
is a logit processor (processors.py) whose per-position state is the remaining tail, so windows
roll it back like every other processor state.

The caller prints the generated text less the tail's characters (`TailSkipper`): the output
never repeats or drops a character of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MAX_HEAL_TOKENS = 3  # tokens a prompt may lose to healing
MAX_HEAL_BYTES = 16  # bytes of text they may cover (UTF-8)


class HealTable:
    """Every token's bytes, precomputed once per tokenizer, with the prefix test as array ops.

    Args:
        token_bytes: per id, the bytes the token decodes to; None for ids healing never
            allows (special tokens, ids whose bytes are unknown).
    """

    def __init__(self, token_bytes: Sequence[bytes | None]):
        self.token_bytes = list(token_bytes)
        V = len(self.token_bytes)
        self.lengths = np.array([len(b) if b else 0 for b in self.token_bytes], dtype=np.int32)  # 0: never allowed
        padded = b"".join((b or b"")[:MAX_HEAL_BYTES].ljust(MAX_HEAL_BYTES, b"\0") for b in self.token_bytes)
        # Each token's first MAX_HEAL_BYTES bytes, zero-padded, as two 64-bit words; byte masks
        # that keep the first m bytes of such words (same byte order: both are views of bytes).
        heads = np.frombuffer(padded, dtype=np.uint64).reshape(V, MAX_HEAL_BYTES // 8)
        keep = np.frombuffer(
            b"".join(b"\xff" * m + b"\0" * (MAX_HEAL_BYTES - m) for m in range(MAX_HEAL_BYTES + 1)), dtype=np.uint64
        ).reshape(MAX_HEAL_BYTES + 1, MAX_HEAL_BYTES // 8)
        self._words = [np.ascontiguousarray(heads[:, c]) for c in range(heads.shape[1])]  # (V,) each
        self._keep = [np.ascontiguousarray(keep[:, c]) for c in range(keep.shape[1])]  # (17,) each
        self._masks: dict[bytes, np.ndarray] = {}
        self._mx_masks: dict[tuple[bytes, int], mx.array] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def allowed(self, tail: bytes) -> np.ndarray:
        """(V,) bool: tokens whose bytes are a non-empty prefix of `tail` or start with it."""
        mask = self._masks.get(tail)
        if mask is None:
            n = len(tail)
            if not 0 < n <= MAX_HEAL_BYTES:
                raise ValueError(f"a heal tail has 1..{MAX_HEAL_BYTES} bytes, got {n}")
            # Token and tail agree on their first min(len(token), n) bytes: one is a prefix of the other.
            want = np.frombuffer(tail.ljust(MAX_HEAL_BYTES, b"\0"), dtype=np.uint64)
            common = np.minimum(self.lengths, n)
            mask = self.lengths > 0
            for c in range(-(-n // 8)):  # the 8-byte words the tail reaches
                mask &= ((self._words[c] ^ want[c]) & self._keep[c][common]) == 0
            self._masks[tail] = mask
        return mask

    def allowed_mx(self, tail: bytes, width: int) -> mx.array:
        """`allowed(tail)` as an MLX mask `width` wide (logits may have padded ids: never allowed)."""
        key = (tail, width)
        mask = self._mx_masks.get(key)
        if mask is None:
            row = np.zeros(width, dtype=bool)
            n = min(width, self.vocab_size)
            row[:n] = self.allowed(tail)[:n]
            mask = self._mx_masks[key] = mx.array(row)
        return mask

    def extends(self, text: bytes) -> bool:
        """Whether some token's bytes start with `text` and go on past it."""
        return bool((self.allowed(text) & (self.lengths > len(text))).any())

    def after(self, tail: bytes, token: int) -> bytes:
        """The tail still to reproduce after `token` (b"" once consumed, or when `token` does
        not fit the tail: a rejected draft's rows are never used)."""
        b = self.token_bytes[token] if 0 <= token < self.vocab_size else None
        if not b or len(b) >= len(tail) or not tail.startswith(b):
            return b""
        return tail[len(b):]


@dataclass(frozen=True)
class HealConstraint:
    """What the healing processor needs: the tail to reproduce and the token table."""

    table: HealTable
    tail: bytes


@dataclass(frozen=True)
class HealPlan:
    """What healing does to one prompt.

    Attributes:
        prompt_ids: the prompt's ids less the healed ones (what the engine prefills).
        removed: how many trailing tokens were backed up over (0 = not healed).
        tail: their bytes, which the first generated tokens must reproduce.
    """

    prompt_ids: list[int]
    removed: int = 0
    tail: bytes = b""

    @property
    def tail_text(self) -> str:
        return self.tail.decode("utf-8")

    def constraint(self, table: HealTable) -> HealConstraint | None:
        """The processor's constraint (None when nothing was healed)."""
        return HealConstraint(table, self.tail) if self.removed else None


def plan_heal(ids: Sequence[int], table: HealTable, *, enabled: bool = True) -> HealPlan:
    """How many trailing tokens of `ids` to heal over, and their text.

    The last token is backed up over when some token starts with its text and goes on (a
    longer token could have covered the prompt's end; otherwise healing would only make the
    model repeat the token); one more while the text so far is whitespace or, again, some token
    extends it, up to MAX_HEAL_TOKENS tokens and MAX_HEAL_BYTES bytes. The first token is never
    removed (the engine needs a prompt token to start from, and has no empty state), so a
    one-token or empty prompt is left as it is; so is a special token. A tail never starts
    inside a UTF-8 character: the tokens of a split character are backed up over together, or
    none of them.
    """
    ids = list(ids)
    best = HealPlan(ids)
    if not enabled:  # `--no-heal`: the prompt's tokens as they are
        return best
    removed, tail = 0, b""
    while removed < min(MAX_HEAL_TOKENS, len(ids) - 1):
        token = ids[-1 - removed]
        b = table.token_bytes[token] if 0 <= token < table.vocab_size else None
        text = (b or b"") + tail
        if not b or len(text) > MAX_HEAL_BYTES:
            break
        if is_utf8(tail) and not ((removed and text.isspace()) or table.extends(text)):
            break  # (a tail that splits a character must go on to its first byte)
        removed, tail = removed + 1, text
        if is_utf8(tail):
            best = HealPlan(ids[:-removed], removed, tail)
    return best


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class TailSkipper:
    """Drops the first `len(tail_text)` characters of a text stream: the healed tail, which the
    prompt already printed."""

    def __init__(self, tail_text: str):
        self.left = len(tail_text)

    def feed(self, delta: str) -> str:
        if self.left:
            cut = min(self.left, len(delta))
            self.left -= cut
            delta = delta[cut:]
        return delta
