"""Text <-> token ids at the edges of strata, from a checkpoint's tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .healing import HealTable
from .model.loader import ModelLoadError


class Tokenizer:
    """A Hugging Face fast tokenizer plus the checkpoint's end-of-sequence ids."""

    def __init__(self, path: str | Path):
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file}: missing (a model directory needs tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises its own exception type
            raise ModelLoadError(f"{tokenizer_file}: not a readable tokenizer ({e})") from None
        self.eos_ids = frozenset(self._eos_ids(path))

    def _eos_ids(self, path: Path) -> set[int]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos = read_json_object(path / name).get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
        token = read_json_object(path / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self._tok.token_to_id(token) is not None:
            ids.add(self._tok.token_to_id(token))
        return ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (its vocabulary string's
        bytes; byte-level and byte-fallback spellings only overstate it): a text of N bytes has at
        least N / max_token_bytes tokens, known before it is encoded."""
        if not hasattr(self, "_max_token_bytes"):
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode()) for t in vocab), default=1) or 1
        return self._max_token_bytes

    def heal_table(self) -> HealTable:
        """Every token's bytes for prompt-edge healing (healing.py), built once per tokenizer.

        Byte-level vocabularies map each token's string back to its bytes; other tokenizers
        decode each token alone (a token that decodes to a partial character, U+FFFD, is never
        allowed while healing). Special tokens are never allowed."""
        if not hasattr(self, "_heal_table"):
            self._heal_table = HealTable(self._token_bytes())
        return self._heal_table

    def _token_bytes(self) -> list[bytes | None]:
        size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        is_byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        out: list[bytes | None] = [None] * size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if not 0 <= i < size:
                continue
            if i in added:
                out[i] = None if added[i].special else token.encode()
            elif is_byte_level and all(c in byte_of for c in token):
                out[i] = bytes(byte_of[c] for c in token)
            else:
                text = self.decode([i])
                out[i] = None if "\ufffd" in text else text.encode()
        return out

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def phrase_sequences(self, phrases: Sequence[str]) -> list[tuple[int, ...]]:
        """The token sequences a banned phrase may appear as: the phrase as written and after a
        space (most tokenizers fold the space into the first token), duplicates dropped."""
        sequences: dict[tuple[int, ...], None] = {}
        for phrase in phrases:
            for text in (phrase, " " + phrase.lstrip(" ")):
                ids = tuple(self.encode(text))
                if ids:
                    sequences[ids] = None
        return list(sequences)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character byte-level vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON side file as a dict ({} when absent or not an object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


class StreamingDetokenizer:
    """Turns a growing list of ids into text deltas, holding back an incomplete UTF-8 tail.

    Byte-level BPE can split one character across tokens; decoding such a prefix yields U+FFFD,
    so text is only released up to the last complete character. Decoding restarts from an anchor
    at clean boundaries (keeping one token of left context, which space-prefixing decoders need),
    so a long generation costs linear, not quadratic, time.
    """

    REANCHOR_AFTER = 32  # ids decoded since the anchor before a clean boundary moves it

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._anchor = 0
        self._emitted = 0  # characters since the anchor already released

    def _text(self) -> str:
        if self._anchor == 0:
            return self.tokenizer.decode(self.ids)
        context = self.tokenizer.decode(self.ids[self._anchor - 1 : self._anchor])
        return self.tokenizer.decode(self.ids[self._anchor - 1 :])[len(context) :]

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self._text()
        end = len(text)
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1
        delta = text[self._emitted : end]
        self._emitted = end
        if end == len(text) and len(self.ids) - self._anchor > self.REANCHOR_AFTER:
            self._anchor, self._emitted = len(self.ids), 0
        return delta

    def finish(self) -> str:
        """Release whatever is left, replacement characters included."""
        text = self._text()
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta
