"""The OpenAI HTTP API's shapes: request bodies in, serve-stdio requests out, and back.

`to_request` turns a `/v1/completions` or `/v1/chat/completions` body into the request object
serve-stdio's checker reads (serve/protocol.py `check_request`), so both servers check fields
with one set of rules and messages; what only the HTTP API has (`n`, `stream_options`, the
`model` name, the fields strata does not support) is checked here. The reply builders turn
serve-stdio's frames (delta, done, error) into OpenAI's JSON bodies and stream chunks.
Documented in docs/http.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    NO_CHAT_TEMPLATE,
    OUT_OF_RANGE,
    PROMPT_TOO_LONG,
    TEMPLATE_ERROR,
)

COMPLETIONS = "completions"
CHAT = "chat"
TIMEOUT = "timeout"  # the error code of a request whose --request-timeout passed while it waited

# Request fields serve-stdio takes under the same name and meaning (protocol.FIELDS); strata's
# own knobs are among them. `null` means "left out", as OpenAI clients send it.
SHARED_FIELDS = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "repetition_context", "ban_phrases", "heal",
                 "suffix_draft")
TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")  # message fields strata refuses when set
# Fields strata answers only in their "off" form; anything else is refused, never dropped.
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "response_format": (None, {"type": "text"}),
}
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "length"}

# serve-stdio error codes -> (HTTP status, OpenAI error type, OpenAI code)
ERROR_STATUS = {
    INTERNAL_ERROR: (500, "server_error", INTERNAL_ERROR),
    TIMEOUT: (504, "server_error", TIMEOUT),
    PROMPT_TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
    NO_CHAT_TEMPLATE: (400, "invalid_request_error", NO_CHAT_TEMPLATE),
    TEMPLATE_ERROR: (400, "invalid_request_error", TEMPLATE_ERROR),
    OUT_OF_RANGE: (400, "invalid_request_error", OUT_OF_RANGE),
}


class ApiError(Exception):
    """A request answered with an OpenAI error object instead of a completion.

    Args:
        status: the HTTP status.
        message: what was wrong, naming the field and the value.
        code: a short machine-readable code (serve-stdio's error codes where one applies).
        kind: OpenAI's error `type` (default "invalid_request_error").
        param: the offending field, when one is.
        headers: extra response headers (Retry-After, WWW-Authenticate).
    """

    def __init__(self, status: int, message: str, *, code: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.headers = headers or {}

    @classmethod
    def from_frame(cls, error: dict) -> ApiError:
        """An error frame's `error` (serve-stdio's code and message) as an HTTP error."""
        status, kind, code = ERROR_STATUS.get(error["code"], (400, "invalid_request_error", error["code"]))
        return cls(status, error["message"], code=code, kind=kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ApiRequest:
    """A body turned into a serve-stdio request, and what the reply needs.

    Attributes:
        request: the serve-stdio request object (protocol.check_request's input), `id` unset.
        kind: COMPLETIONS or CHAT.
        stream: the reply is a server-sent event stream.
        include_usage: the stream ends with a usage chunk (`stream_options.include_usage`).
        min_match: the request's own suffix-match minimum (None = the server's).
    """

    request: dict
    kind: str
    stream: bool
    include_usage: bool
    min_match: int | None


def to_request(body: dict, *, kind: str, model_name: str) -> ApiRequest:
    """Check the HTTP-only fields of a parsed body and build its serve-stdio request.

    Unknown fields are ignored, as OpenAI clients expect; known fields strata cannot honour are
    refused (UNSUPPORTED). Types and ranges of the shared fields are checked by
    protocol.check_request afterwards.

    Raises:
        ApiError: 404 for another model's name, 400 for anything else wrong.
    """
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model {_shown(model)} does not exist; this server serves {model_name!r}",
                       code="model_not_found", param="model")
    for field, off in UNSUPPORTED.items():
        if field in body and not any(body[field] == value and type(body[field]) is type(value) for value in off):
            raise ApiError(400, f"'{field}' is not supported by strata (send it left out or null)",
                           code="unsupported_field", param=field)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {_shown(n)}", code=OUT_OF_RANGE, param="n")
    request: dict[str, Any] = {k: body[k] for k in SHARED_FIELDS if body.get(k) is not None}
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    if kind == CHAT:
        request["messages"] = _messages(body.get("messages"))
    else:
        request["prompt"] = _prompt(body.get("prompt"))
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be a boolean, got {_shown(stream)}", code=INVALID_REQUEST, param="stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    min_match = body.get("min_match")
    if min_match is not None and type(min_match) is not int:
        raise ApiError(400, f"'min_match' must be an integer, got {_shown(min_match)}", code=INVALID_REQUEST,
                       param="min_match")
    return ApiRequest(request, kind, stream, include_usage, min_match)


def _prompt(value: Any) -> Any:
    """A completion's prompt: a string, or a list holding one string. Token-id prompts and
    several prompts per request are refused."""
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if value and (all(type(v) is int for v in value) or all(isinstance(v, list) for v in value)):
            raise ApiError(400, "token-id prompts are not supported: send the prompt as text", code=INVALID_REQUEST,
                           param="prompt")
        raise ApiError(400, f"'prompt' must be a string or a list of one string, got a list of {len(value)}",
                       code=INVALID_REQUEST, param="prompt")
    if value is None:
        raise ApiError(400, "'prompt' is required", code=INVALID_REQUEST, param="prompt")
    return value  # a wrong type is named by check_request


def _messages(value: Any) -> Any:
    """Chat messages as serve-stdio takes them: role and content only. Other message fields
    (`name`, `refusal`, ...) are dropped, as unknown fields are; tool calls are refused."""
    if value is None:
        raise ApiError(400, "'messages' is required", code=INVALID_REQUEST, param="messages")
    if not isinstance(value, list):
        return value  # check_request names the type
    messages = []
    for i, message in enumerate(value):
        if isinstance(message, dict):
            for field in TOOL_FIELDS:
                if message.get(field) not in (None, []):
                    raise ApiError(400, f"messages[{i}].{field}: tool calls are not supported",
                                   code="unsupported_field", param="messages")
            message = {k: v for k, v in message.items() if k in ("role", "content")}
        messages.append(message)
    return messages


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' applies only with 'stream': true", code=INVALID_REQUEST,
                       param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {_shown(options)}", code=INVALID_REQUEST,
                       param="stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'stream_options.include_usage' must be a boolean, got {_shown(value)}",
                       code=INVALID_REQUEST, param="stream_options")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


# -- replies ---------------------------------------------------------------------------------------


class Reply:
    """Builds one request's OpenAI reply bodies from serve-stdio frames.

    Args:
        kind: COMPLETIONS or CHAT.
        model_name: the `model` every body names.
        request_id: the reply's id (`cmpl-...` / `chatcmpl-...`).
        fingerprint: `system_fingerprint` (the model identity and dtype: equal fingerprints and
            seeds give equal outputs).
    """

    def __init__(self, kind: str, *, model_name: str, request_id: str, fingerprint: str):
        self.kind, self.model_name, self.id, self.fingerprint = kind, model_name, request_id, fingerprint
        self.created = int(time.time())
        self._object = "chat.completion" if kind == CHAT else "text_completion"

    def completion(self, done: dict) -> dict:
        """The non-streamed body, from the done frame."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": FINISH_REASONS[done["finish_reason"]]}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": done["text"]}
        else:
            choice["text"] = done["text"]
        return {**self._head(self._object), "choices": [choice], "usage": usage(done), "strata": strata_extra(done)}

    def chunk(self, text: str | None, *, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False) -> dict:
        """One stream chunk: a text delta, or (finish_reason set) the last one with a choice."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": None if finish_reason is None else FINISH_REASONS[finish_reason]}
        if self.kind == CHAT:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = {**self._head(self._object + ".chunk" if self.kind == CHAT else self._object), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last has usage null
        return body

    def usage_chunk(self, done: dict) -> dict:
        """The stream's last chunk with `stream_options.include_usage`: no choices, the usage."""
        object_name = self._object + ".chunk" if self.kind == CHAT else self._object
        return {**self._head(object_name), "choices": [], "usage": usage(done), "strata": strata_extra(done)}

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "system_fingerprint": self.fingerprint}


def usage(done: dict) -> dict:
    """OpenAI's usage from a done frame's: cached tokens are the prompt positions a checkpoint restored."""
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def strata_extra(done: dict) -> dict:
    """What strata adds to a reply: its own finish reason ("context", "cancelled" are "length"
    in OpenAI's terms) and the decode telemetry serve-stdio's done frame carries."""
    return {"finish_reason": done["finish_reason"], "stats": done["stats"]}
