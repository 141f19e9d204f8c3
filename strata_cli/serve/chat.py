"""Chat messages -> prompt text, with the checkpoint's own chat template (rendered by jinja2).

The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates where "default" is used), else from `chat_template.jinja`. It is rendered the way
Hugging Face's `apply_chat_template` does: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, `add_generation_prompt=True`, the special tokens' text as `bos_token` /
`eos_token`, and `raise_exception` / `strftime_now` available. A model without a template has no
fallback: a made-up format would give a real model text it was never trained on, so `messages`
gets a `no_chat_template` error and `prompt` still works.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from ..tokenizer import read_json_object


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
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages`, ending with the assistant's generation prompt.

        Raises:
            ChatTemplateError: the template rejects the messages (code "template_error").
        """
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._variables)
        except Exception as e:  # a template is code: whatever it raises (TemplateError, TypeError, ...) is its error
            raise ChatTemplateError("template_error", f"the chat template rejected the messages: {e}") from None


def _raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
