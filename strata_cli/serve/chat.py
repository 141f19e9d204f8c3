"""Chat messages -> prompt text, with the checkpoint's own chat template (rendered by jinja2).

The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates where "default" is used), else from `chat_template.jinja`. It is rendered the way
Hugging Face's `apply_chat_template` does: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, `add_generation_prompt=True`, the special tokens' text as `bos_token` /
`eos_token`, and `raise_exception` / `strftime_now` available. A model without a template has no
fallback: a made-up format would give a real model text it was never trained on, so `messages`
gets a `no_chat_template` error and `prompt` still works.

A template is code from the checkpoint, so its work is bounded: rendering stops with a
`template_error` after `TEMPLATE_SECONDS`, when the output passes `TEMPLATE_MAX_CHARS`, when the
values it builds pass `TEMPLATE_MAX_BUILT` in all, when anything would build one value larger
than `TEMPLATE_MAX_CHARS`, or when the server is told to stop (SIGTERM). "Anything" is sized
before it allocates: the `*`, `+`, `**`, `%` and `~` operators, every filter and str method that
can return more than it was given (`'%1000000000s'|format('x')`, `'x'|center(10**9)`,
`'{:>1000000000}'.format('x')`, `s.replace('', s)`, `[s] * 1000|join`), and `{{ value }}` of a
list or dict. A clock cannot do this alone: one C call (`str.center`) builds gigabytes before
Python code runs again. jinja2's sandbox already caps `range()` at 100,000 items; the time
budget catches nested loops.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..tokenizer import read_json_object
from .template_limits import (
    SPENT,
    TEMPLATE_MAX_CHARS,
    OverBudget,
    bounded_environment,
    raise_exception,
    strftime_now,
)

TEMPLATE_SECONDS = 2.0
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

        env = bounded_environment()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile ({e})") from None
        except OverBudget as e:  # `{% autoescape expr %}` evaluates expr while compiling
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
                    raise OverBudget(f"took more than {seconds:g} s")
                if cancelled():
                    raise OverBudget("the server is stopping")
            return tracer

        parts, size = [], 0
        previous = sys.gettrace()
        spent = SPENT.set([0])
        sys.settrace(tracer)
        try:
            for part in self._template.generate(messages=messages, add_generation_prompt=True, **self._variables):
                size += len(part)
                if size > max_chars:
                    raise OverBudget(f"its output passed {max_chars} characters")
                parts.append(part)
        except OverBudget as e:
            raise ChatTemplateError("template_error", f"the chat template was stopped: {e}") from None
        except Exception as e:  # a template is code: whatever it raises (TemplateError, TypeError, ...) is its error
            raise ChatTemplateError("template_error", f"the chat template rejected the messages: {e}") from None
        finally:
            sys.settrace(previous)
            SPENT.reset(spent)
        return "".join(parts)
