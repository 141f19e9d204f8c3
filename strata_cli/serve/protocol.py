"""The serve-stdio protocol: request lines in, checked requests out, reply frames back.

One checker turns a request line into a `Request` or a `RequestError` (an error code, a message,
and the request's id when it got that far); `check_cancel` reads a cancel line (`{"cancel": ID}`). Ranges are the CLI's: the options are built with
config.py's `GenerateOptions` and `SpecOptions`, so a value the CLI refuses is refused here with
the same message. Documented in README.md ("serve-stdio") and docs/serve.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, BinaryIO

from .. import __version__
from ..options import ConfigError, GenerateOptions, SpecOptions, parse_suffix_draft

# Error codes (the `code` of an error reply).
PARSE_ERROR = "parse_error"  # not JSON: syntax, NaN/Infinity, a number out of range, nesting, duplicate keys
INVALID_UTF8 = "invalid_utf8"
LINE_TOO_LONG = "line_too_long"
INVALID_REQUEST = "invalid_request"  # not an object, unknown field, wrong type, missing or conflicting fields
OUT_OF_RANGE = "out_of_range"  # a value the options refuse (the CLI's limits)
PROMPT_TOO_LONG = "prompt_too_long"
NO_CHAT_TEMPLATE = "no_chat_template"
TEMPLATE_ERROR = "template_error"
INTERNAL_ERROR = "internal_error"

MAX_ID_CHARS = 256
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_BAN_PHRASES = 256
SAMPLING_INTEGERS = ("top_k", "repetition_context")
SAMPLING_NUMBERS = ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FIELDS = ("id", "prompt", "messages", "max_tokens", "temperature", "seed", "suffix_draft", "stop", "stream",
          *SAMPLING_INTEGERS, *SAMPLING_NUMBERS, "ban_phrases", "heal")
MESSAGE_FIELDS = ("role", "content")
TEXT_PART_FIELDS = ("type", "text")  # an OpenAI-style content part; only text parts are understood
CANCEL = "cancel"  # the one field of a cancel line
MAX_CANCEL_LINE_BYTES = 4096  # a cancel line is looked at ahead of its turn, so it is kept small
PROTOCOL_VERSION = 1  # the ready frame's `protocol`: raised when frames or requests change incompatibly


class RequestError(Exception):
    """A request that gets an error reply instead of an answer.

    Args:
        code: one of the error codes above.
        message: what was wrong, naming the field and the value.
        request_id: the request's id when it was readable, else None.
    """

    def __init__(self, code: str, message: str, request_id: Any = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """A checked request: exactly one of `prompt` and `messages` is set; each message's content
    is one string (content parts already joined)."""

    id: Any
    prompt: str | None
    messages: list[dict[str, str]] | None
    options: GenerateOptions
    spec: SpecOptions
    stop: tuple[str, ...]
    stream: bool


def decode_line(raw: bytes) -> dict:
    """Parse one request line (without its newline) into a JSON object.

    Raises:
        RequestError: invalid UTF-8, invalid JSON (NaN and Infinity included, numbers that do not
            fit a double, duplicate keys, nesting past Python's recursion limit), or not an object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(INVALID_UTF8, f"the line is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except RecursionError:
        raise RequestError(PARSE_ERROR, "the JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, our hooks, and ints past the digit limit
        raise RequestError(PARSE_ERROR, f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(INVALID_REQUEST, f"a request is a JSON object, got {_type_name(value)}")
    return value


def check_request(obj: dict, *, defaults: GenerateOptions, spec: SpecOptions) -> Request:
    """Check every field of a parsed request and build its options.

    Args:
        obj: the parsed line.
        defaults: the server's generate options (max_tokens, temperature, seed) for absent fields.
        spec: the server's speculative options (suffix_draft default, min_match).

    Raises:
        RequestError: an unknown field, a wrong type, a missing or conflicting prompt, a value out
            of range; `request_id` is set whenever the id itself was valid.
    """
    request_id = _check_id(obj.get("id"))
    try:
        return _check_fields(obj, request_id, defaults, spec)
    except RequestError as e:
        e.request_id = request_id
        raise


def check_cancel(obj: dict, num_bytes: int) -> Any:
    """The request id a cancel line names, or None when `obj` is not a cancel line.

    A cancel line is `{"cancel": ID}`, ID a request id other than null, the line at most
    `MAX_CANCEL_LINE_BYTES` long (`num_bytes`: the line's length).

    Raises:
        RequestError: an object with a "cancel" field that is not such a line.
    """
    if CANCEL not in obj:
        return None
    if len(obj) != 1:
        others = ", ".join(repr(k) for k in obj if k != CANCEL)
        raise RequestError(INVALID_REQUEST, f"a cancel line has the one field 'cancel' (got also {others})")
    if num_bytes > MAX_CANCEL_LINE_BYTES:
        raise RequestError(INVALID_REQUEST, f"a cancel line has at most {MAX_CANCEL_LINE_BYTES} bytes, got {num_bytes}")
    if obj[CANCEL] is None:
        raise RequestError(INVALID_REQUEST, "'cancel' names a request id; null is not one that can be cancelled")
    try:
        return _check_id(obj[CANCEL])
    except RequestError as e:
        raise RequestError(e.code, e.message.replace("'id'", "'cancel'", 1)) from None


def _check_fields(obj: dict, request_id: Any, defaults: GenerateOptions, spec: SpecOptions) -> Request:
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise RequestError(INVALID_REQUEST, f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(FIELDS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise RequestError(INVALID_REQUEST, "a request needs exactly one of 'prompt' and 'messages'")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if "prompt" in obj:
        prompt = _text("prompt", prompt)
        if not prompt:
            raise RequestError(INVALID_REQUEST, "'prompt' is empty")
    else:
        messages = _messages(messages)
    overrides = {}
    for field, name in (("max_tokens", "max_tokens"), ("seed", "seed")):
        if field in obj:
            overrides[name] = _integer(field, obj[field])
    if "temperature" in obj:
        overrides["temperature"] = _number("temperature", obj["temperature"])
    overrides.update(_sampling(obj))
    spec_overrides = {}
    if "suffix_draft" in obj:
        max_drafts, auto = _suffix_draft(obj["suffix_draft"])
        spec_overrides = {"max_drafts": max_drafts, "auto": auto, "cost_prior": spec.cost_prior if auto else None}
    try:
        options = dataclasses.replace(defaults, **overrides)
        spec = dataclasses.replace(spec, **spec_overrides)
    except ConfigError as e:
        raise RequestError(OUT_OF_RANGE, str(e)) from None
    stream = obj.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestError(INVALID_REQUEST, f"'stream' must be a boolean, got {_type_name(stream)}")
    stops = _stops(obj["stop"]) if "stop" in obj else ()
    return Request(request_id, prompt, messages, options, spec, stops, stream)


def _sampling(obj: dict) -> dict:
    """The sampling filters, penalties, banned phrases and healing a request sets (GenerateOptions fields)."""
    overrides: dict[str, Any] = {name: _integer(name, obj[name]) for name in SAMPLING_INTEGERS if name in obj}
    overrides.update({name: _number(name, obj[name]) for name in SAMPLING_NUMBERS if name in obj})
    if "ban_phrases" in obj:
        phrases = obj["ban_phrases"]
        if not isinstance(phrases, list) or len(phrases) > MAX_BAN_PHRASES:
            raise RequestError(
                INVALID_REQUEST,
                f"'ban_phrases' must be a list of at most {MAX_BAN_PHRASES} strings, got {_type_name(phrases)}",
            )
        overrides["ban_phrases"] = tuple(_text(f"ban_phrases[{i}]", p) for i, p in enumerate(phrases))
    if "heal" in obj:
        if not isinstance(obj["heal"], bool):
            raise RequestError(INVALID_REQUEST, f"'heal' must be a boolean, got {_type_name(obj['heal'])}")
        overrides["heal"] = obj["heal"]
    return overrides


def _check_id(value: Any) -> Any:
    if value is None or (type(value) is int and -(2**63) <= value < 2**63):
        return value
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
        return _text("id", value)
    raise RequestError(
        INVALID_REQUEST,
        f"'id' must be a string of at most {MAX_ID_CHARS} characters, a 64-bit integer or null, "
        f"got {_type_name(value)}",
    )


def _integer(name: str, value: Any) -> int:
    if type(value) is not int:  # bool is an int subclass; 1.0 is not an integer field
        raise RequestError(INVALID_REQUEST, f"'{name}' must be an integer, got {_type_name(value)}")
    return value


def _suffix_draft(value: Any) -> tuple[int, bool]:
    """What the CLI's --suffix-draft takes: an integer 0..7, "auto" or "auto:N"."""
    if type(value) is not int and not isinstance(value, str):
        raise RequestError(INVALID_REQUEST, f"'suffix_draft' must be an integer or \"auto[:N]\", got {_type_name(value)}")
    try:
        return parse_suffix_draft(value)
    except ConfigError as e:
        raise RequestError(OUT_OF_RANGE, str(e)) from None


def _number(name: str, value: Any) -> float:
    if type(value) not in (int, float):
        raise RequestError(INVALID_REQUEST, f"'{name}' must be a number, got {_type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        raise RequestError(OUT_OF_RANGE, f"'{name}' is too large") from None


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RequestError(INVALID_REQUEST, f"'{name}' must be a string, got {_type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(INVALID_REQUEST, f"'{name}' has a lone surrogate at index {e.start}") from None
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(INVALID_REQUEST, f"'messages' must be a non-empty list, got {_type_name(value)}")
    checked = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError(INVALID_REQUEST, f"messages[{i}] must be an object, got {_type_name(message)}")
        unknown = [k for k in message if k not in MESSAGE_FIELDS]
        missing = [k for k in MESSAGE_FIELDS if k not in message]
        if unknown or missing:
            raise RequestError(
                INVALID_REQUEST, f"messages[{i}] needs exactly 'role' and 'content' (unknown {unknown}, missing {missing})"
            )
        checked.append({"role": _text(f"messages[{i}].role", message["role"]),
                        "content": _content(f"messages[{i}].content", message["content"])})
    return checked


def _content(name: str, value: Any) -> str:
    """A message's content: a string, or OpenAI's list of content parts, of which only text parts
    (`{"type": "text", "text": str}`) are understood; they are joined in order."""
    if not isinstance(value, list):
        if not isinstance(value, str):
            raise RequestError(
                INVALID_REQUEST, f"'{name}' must be a string or a list of text parts, got {_type_name(value)}"
            )
        return _text(name, value)
    texts = []
    for j, part in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(INVALID_REQUEST, f"{where} must be a content part object, got {_type_name(part)}")
        kind = part.get("type")
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) else f"a part without a string 'type' ({_type_name(kind)})"
            raise RequestError(INVALID_REQUEST, f"{where} is {shown}: only \"text\" content parts are supported")
        unknown = [k for k in part if k not in TEXT_PART_FIELDS]
        if unknown or "text" not in part:
            raise RequestError(
                INVALID_REQUEST, f"{where} needs exactly 'type' and 'text' (unknown {unknown}, "
                f"missing {[] if 'text' in part else ['text']})"
            )
        texts.append(_text(f"{where}.text", part["text"]))
    return "".join(texts)


def _stops(value: Any) -> tuple[str, ...]:
    """A present `stop` field: a string or a list of them; `null` is refused like every other
    field's (leave the field out for no stop strings)."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise RequestError(
            INVALID_REQUEST, f"'stop' must be a string or a list of at most {MAX_STOPS} strings, got {_type_name(value)}"
        )
    for i, stop in enumerate(stops):
        _text(f"stop[{i}]", stop)
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise RequestError(OUT_OF_RANGE, f"stop[{i}] must have 1..{MAX_STOP_CHARS} characters, got {len(stop)}")
    return tuple(stops)


def _type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null", float: "number"}
    if type(value) is int:
        return "integer" if abs(value) < 10**20 else "a huge integer"
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} does not fit a double")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key[:64]!r}")
        obj[key] = value
    return obj


# -- reply frames ----------------------------------------------------------------------------------


def error_frame(request_id: Any, code: str, message: str) -> dict:
    return {"id": request_id, "error": {"code": code, "message": message}}


def delta_frame(request_id: Any, text: str) -> dict:
    return {"id": request_id, "delta": text}


def cancel_frame(target: Any, found: bool) -> dict:
    """The answer to a cancel line, sent in the line's turn: after every request it stopped."""
    return {"cancel": target, "found": found}


def ready_frame(*, model: str, identity: str, dtype: str, max_context: int, chat_template: bool) -> dict:
    """The first frame: the server has opened the model (and restored the session) and reads requests."""
    return {"ready": True, "protocol": PROTOCOL_VERSION, "version": __version__, "model": model,
            "identity": identity, "dtype": dtype, "max_context": max_context, "chat_template": chat_template}


class ClientGone(Exception):
    """stdout was closed by the reader: nobody can receive replies any more."""


class FrameWriter:
    """Writes reply frames, one JSON object per line, flushed at once.

    Args:
        stream: a binary stream (the real stdout in the server).
    """

    def __init__(self, stream: BinaryIO):
        self._stream = stream

    def send(self, frame: dict) -> None:
        """Write one frame.

        Raises:
            ClientGone: the reader closed the stream.
        """
        try:
            line = json.dumps(frame, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate in generated text: escape it rather than fail
            line = json.dumps(frame, ensure_ascii=True, allow_nan=False).encode("ascii")
        try:
            self._stream.write(line + b"\n")
            self._stream.flush()
        except BrokenPipeError:
            raise ClientGone("stdout was closed") from None
