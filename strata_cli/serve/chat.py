"""Chat messages -> prompt text, with the checkpoint's own chat template (rendered by jinja2).

The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates where "default" is used), else from `chat_template.jinja`. It is rendered the way
Hugging Face's `apply_chat_template` does: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, `add_generation_prompt=True`, the special tokens' text as `bos_token` /
`eos_token`, and `raise_exception` / `strftime_now` available. A model without a template has no
fallback: a made-up format would give a real model text it was never trained on, so `messages`
gets a `no_chat_template` error and `prompt` still works.

A template is code from the checkpoint, so its work is bounded: rendering stops with a
`template_error` after `TEMPLATE_SECONDS`, when the output passes `TEMPLATE_MAX_CHARS`, when a
`*`, `+` or `**` or a method call would build something larger than that (`'x' * 2000000000`,
`'x'.center(10**9)`), or when the server is told to stop (SIGTERM). jinja2's sandbox already caps
`range()` at 100,000 items; the time budget catches nested loops.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..tokenizer import read_json_object

TEMPLATE_SECONDS = 2.0
TEMPLATE_MAX_CHARS = 16 << 20  # characters of output, and the size of any one value built


class _OverBudget(BaseException):
    """Raised inside the template's code; a BaseException, so the template cannot catch it."""


class ChatTemplateError(ValueError):
    """Messages that cannot become a prompt; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ChatTemplate:
    """A checkpoint's chat template, compiled once.

    Args:
        source: the jinja2 template text.
        special_tokens: variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
    """

    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        env = _bounded_environment()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile ({e})") from None
        self._variables = dict(special_tokens)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ChatTemplate | None":
        """The template a checkpoint directory ships, or None when it has none.

        Raises:
            ModelLoadError: tokenizer_config.json is not valid JSON.
            ValueError: a template that is present but not a string or does not compile.
        """
        path = Path(path)
        config = read_json_object(path / "tokenizer_config.json")
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template is not a string")
        special = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            special[name] = token if isinstance(token, str) else ""
        return cls(source, special)

    def render(
        self, messages: list[dict[str, str]], *, seconds: float = TEMPLATE_SECONDS,
        max_chars: int = TEMPLATE_MAX_CHARS, cancelled: Callable[[], bool] = lambda: False,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's generation prompt.

        Args:
            messages: the chat, as the protocol checked it.
            seconds: wall-clock budget (default `TEMPLATE_SECONDS`).
            max_chars: output budget (default `TEMPLATE_MAX_CHARS`).
            cancelled: polled while rendering; True stops it.

        Raises:
            ChatTemplateError: the template rejects the messages or exceeds a budget (code
                "template_error").
        """
        deadline = time.monotonic() + seconds
        events = 0

        def tracer(frame, event, arg):
            nonlocal events
            events += 1
            if events % 256 == 0:
                if time.monotonic() > deadline:
                    raise _OverBudget(f"took more than {seconds:g} s")
                if cancelled():
                    raise _OverBudget("the server is stopping")
            return tracer

        parts, size = [], 0
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for part in self._template.generate(messages=messages, add_generation_prompt=True, **self._variables):
                size += len(part)
                if size > max_chars:
                    raise _OverBudget(f"its output passed {max_chars} characters")
                parts.append(part)
        except _OverBudget as e:
            raise ChatTemplateError("template_error", f"the chat template was stopped: {e}") from None
        except Exception as e:  # a template is code: whatever it raises (TemplateError, TypeError, ...) is its error
            raise ChatTemplateError("template_error", f"the chat template rejected the messages: {e}") from None
        finally:
            sys.settrace(previous)
        return "".join(parts)


def _bounded_environment():
    """jinja2's immutable sandbox, with operators and calls that cannot build a huge value."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def check_size(n: int) -> None:
        if n > TEMPLATE_MAX_CHARS:
            raise _OverBudget(f"it would build a value of {n} items (limit {TEMPLATE_MAX_CHARS})")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator, left, right):
            sized = (str, bytes, list, tuple)
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, sized) and isinstance(n, int):
                        check_size(len(seq) * n)
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                check_size(len(left) + len(right))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                check_size(right * max(abs(left).bit_length(), 1) // 8)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool):
                    check_size(value)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedEnvironment


def _raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
