"""A chat template's work, bounded: a jinja2 sandbox in which everything that builds text is
sized before it allocates (serve/chat.py renders templates in it).

Operators (`*`, `+`, `**`, `%`, `~`), every filter and str method that can return more than it
was given, and `{{ value }}` of a list or dict go through a size estimate: one value may not pass
`TEMPLATE_MAX_CHARS`, nor all the values one render builds `TEMPLATE_MAX_BUILT` (counted in
`SPENT`, which the renderer sets per render). A clock alone cannot do this: one C call
(`str.center`) builds gigabytes before Python code runs again.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import math
import re
import types
from collections import abc
from itertools import repeat

TEMPLATE_MAX_CHARS = 16 << 20  # characters of output, and the size of any one value built
TEMPLATE_MAX_BUILT = 8 * TEMPLATE_MAX_CHARS  # characters of all the values one render builds


class OverBudget(BaseException):
    """Raised inside the template's code; a BaseException, so the template cannot catch it."""


def bounded_environment():
    """jinja2's immutable sandbox where nothing the template does can build a huge value.

    Every way a template builds text goes through a size estimate first: the `*`, `+`, `**` and
    `%` operators, `~`, the filters (`_FILTER_SIZES`), str/bytes methods (`_METHOD_SIZES`),
    `str.format` fields, `{{ value }}` of a non-string, and captured blocks. Nothing runs at compile
    time (no constant folding), so a template also cannot stall or bloat loading.
    """
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import (
        ImmutableSandboxedEnvironment,
        SandboxedEscapeFormatter,
        SandboxedFormatter,
    )
    from jinja2.utils import pass_environment, pass_eval_context
    from markupsafe import Markup

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: jinja2 joins in C, past every other hook
            if frame.eval_ctx.volatile:
                markup = "context.eval_ctx.autoescape"
            else:
                markup = "True" if frame.eval_ctx.autoescape else "False"
            self.write(f"environment.bounded_concat({markup}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedFormatter(_BoundedFormatting, SandboxedFormatter):
        pass

    class BoundedEscapeFormatter(_BoundedFormatting, SandboxedEscapeFormatter):
        escapes = 5

    @pass_eval_context
    def finalize(eval_ctx, value):  # `{{ value }}` becomes str(value), or escape(value)
        escapes = eval_ctx.autoescape and not isinstance(value, Markup)
        if escapes or not isinstance(value, str):
            _build(_TextSize()(value) * (5 if escapes else 1), "printing a value")
        return value

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def __init__(self, **kwargs):
            super().__init__(optimized=False, finalize=finalize, **kwargs)
            for name, size in _FILTER_SIZES.items():
                self.filters[name] = _bounded_filter(name, self.filters[name], size)
            self.filters["join"] = _bounded_join(self.filters["join"])
            self.filters["sum"] = pass_environment(_bounded_sum)
            self.globals["lipsum"] = _bounded_lipsum(self.globals["lipsum"])

        def call_binop(self, context, operator, left, right):
            sized = (str, bytes, list, tuple)
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, sized) and isinstance(n, int):
                        _build(len(seq) * n, "`*`", is_list=isinstance(seq, (list, tuple)))
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                escapes = 5 if isinstance(left, Markup) or isinstance(right, Markup) else 1  # Markup escapes the other
                _build((len(left) + len(right)) * escapes, "`+`", is_list=isinstance(left, (list, tuple)))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                _build(right * max(abs(left).bit_length(), 1) // 8, "`**`")
            elif operator == "%" and isinstance(left, str):
                _build(_percent_size(left, right, escapes=5 if isinstance(left, Markup) else 1), "`%`")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            given = {k: v for k, v in kwargs.items() if k not in _JINJA_KWARGS} if kwargs else kwargs
            if isinstance(owner, (str, bytes)) and name in _METHOD_SIZES:  # sized before the call
                if name == "join" and args:
                    args = (list(args[0]), *args[1:])  # a generator: sized here, then joined
                size = _METHOD_SIZES[name](owner, *args, **given)
                _build(size * (5 if isinstance(owner, Markup) else 1), f"`{name}`")
            elif isinstance(owner, (str, bytes)) and name in _METHOD_PIECES:
                _build(_METHOD_PIECES[name](owner, *args, **given), f"`{name}`", is_list=True, weight=_PIECE)
            for value in (*args, *given.values()):  # any other callable: no size argument past the limit
                if isinstance(value, int) and not isinstance(value, bool):
                    _check(value, "a call", "items")
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # jinja2's, with formatters that size each field first
            if not (isinstance(value, (types.MethodType, types.BuiltinMethodType))
                    and value.__name__ in ("format", "format_map") and isinstance(value.__self__, str)):
                return None
            text, is_map = value.__self__, value.__name__ == "format_map"
            if isinstance(text, Markup):
                formatter = BoundedEscapeFormatter(self, escape=text.escape)
            else:
                formatter = BoundedFormatter(self)

            def wrapper(*args, **kwargs):
                if is_map:
                    if kwargs:
                        raise TypeError("format_map() takes no keyword arguments")
                    if len(args) != 1:
                        raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                    args, kwargs = (), args[0]
                return type(text)(formatter.vformat(text, args, kwargs))

            return functools.update_wrapper(wrapper, value)

        def concat(self, parts):  # a captured block: {% set x %}, macros, {% filter %}
            parts = parts if isinstance(parts, list) else list(parts)
            _build(sum(map(len, parts)), "a block")
            return "".join(parts)

        def bounded_concat(self, markup, parts):
            from jinja2.runtime import markup_join, str_join

            if markup:
                _build(sum(len(p) if isinstance(p, Markup) else 5 * _TextSize()(p) for p in parts), "`~`")
                return markup_join(parts)
            is_text = all(type(p) is str for p in parts)
            _build(sum(map(len, parts)) if is_text else sum(map(_TextSize(), parts)), "`~`")
            return str_join(parts)

    return BoundedEnvironment


# -- how much text a value, an operator, a filter or a method builds --------------------------------

_JINJA_KWARGS = frozenset({"_loop_vars", "_block_vars"})  # what jinja2 adds to calls in loops and blocks

SPENT: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("template_spent", default=None)


def _check(size: float, what: str, unit: str = "characters") -> None:
    if size > TEMPLATE_MAX_CHARS:
        amount = f"more than {TEMPLATE_MAX_CHARS:,}" if size == math.inf else f"{size:,}"
        raise OverBudget(f"{what} would build a value of {amount} {unit} (limit {TEMPLATE_MAX_CHARS:,})")


def _build(size: float, what: str, *, is_list: bool = False, weight: int | None = None) -> None:
    """Charge a value about to be built: one value stays within TEMPLATE_MAX_CHARS, and a render's
    values together within TEMPLATE_MAX_BUILT, so a loop of values that are each allowed cannot
    fill memory faster than the clock can stop it. A list item counts as `weight` characters: 4
    for a pointer (the default), more where each item is a new string object."""
    _check(size, what, "items" if is_list else "characters")
    spent = SPENT.get()
    if spent is not None:
        spent[0] += size * (weight or (4 if is_list else 1))
        if spent[0] > TEMPLATE_MAX_BUILT:
            raise OverBudget(f"it built more than {TEMPLATE_MAX_BUILT:,} characters in all")


class _TextSize:
    """An upper bound on len(str(value)) (style "str"), on its repr ("repr", "ascii") or on jinja2's
    tojson text ("json", with `indent`), found without building it; math.inf once past `limit`."""

    def __init__(self, style: str = "str", indent: int | None = None, limit: int = TEMPLATE_MAX_CHARS):
        self.style, self.indent, self.limit = style, indent, limit
        self._path: set[int] = set()

    def __call__(self, value) -> int:
        if isinstance(value, str) and self.style == "str":
            return len(value)
        return self.item(value, 0)

    def item(self, value, depth: int) -> int:
        from jinja2.utils import Namespace

        if isinstance(value, str):
            return self.quoted(value)
        if isinstance(value, (bytes, bytearray)):
            return 4 * len(value) + 3
        if value is None or isinstance(value, bool):
            return 5
        if isinstance(value, int):
            return value.bit_length() * 31 // 100 + 2
        if isinstance(value, float):
            return 24
        if isinstance(value, Namespace):
            return 16 + self.item(object.__getattribute__(value, "_Namespace__attrs"), depth)
        if isinstance(value, (abc.Mapping, list, tuple, set, frozenset, abc.MappingView)):
            return self.container(value, depth)
        return len(repr(value) if depth or self.style != "str" else str(value))

    def quoted(self, s: str) -> int:
        n = len(s)
        if n + 2 > self.limit:  # before scanning it: a list can hold one long string many times
            return math.inf
        if self.style == "json":
            if not (s.isascii() and s.isprintable()):
                return 12 * n + 2
            return n + 2 + s.count('"') + s.count("\\") + 5 * sum(map(s.count, "<>&'"))
        if s.isprintable() and (self.style != "ascii" or s.isascii()):
            return n + 2 + s.count("\\") + s.count("'")
        return (4 if s.isascii() else 10) * n + 2

    def many_quoted(self, strings) -> int:
        """`quoted` over many strings in C calls only (a Python loop would take seconds)."""
        chars = sum(map(len, strings))
        if chars + 2 * len(strings) > self.limit:
            return math.inf
        if 12 * chars + 2 * len(strings) <= self.limit or self.style == "json":
            return 12 * chars + 2 * len(strings)
        if not all(map(str.isprintable, strings)) or self.style == "ascii" and not all(map(str.isascii, strings)):
            return 10 * chars + 2 * len(strings)
        escapes = sum(map(str.count, strings, repeat("\\"))) + sum(map(str.count, strings, repeat("'")))
        return chars + escapes + 2 * len(strings)

    def container(self, value, depth: int) -> int:
        if id(value) in self._path:
            return 8
        is_map = isinstance(value, abc.Mapping)
        per_item = 4 + (1 + self.indent * (depth + 1) if self.indent is not None else 0)
        if len(value) * (per_item - 1) > self.limit:
            return math.inf
        total = 16 + len(type(value).__name__) + sum(len(f) + 2 for f in getattr(value, "_fields", ()))
        if type(value) in (list, tuple) and len(value) > 256 and set(map(type, value)) <= {str}:
            return total + per_item * len(value) + self.many_quoted(value)
        self._path.add(id(value))
        try:
            for item in value.items() if is_map else value:
                total += per_item + (self.item(item[0], depth + 1) + self.item(item[1], depth + 1) if is_map
                                     else self.item(item, depth + 1))
                if total > self.limit:
                    return math.inf
        finally:
            self._path.discard(id(value))
        return total


def _number_size(value, precision: int = 0) -> int:
    """An upper bound on any conversion of a number, with `precision` digits after the point."""
    if isinstance(value, int):
        return 2 * (value.bit_length() * 31 // 100 + 2) + precision + 8  # digits, grouping, sign, prefix
    return 340 + precision  # a float's integer part has at most 309 digits


def _percent_size(fmt: str, args, *, escapes: int = 1) -> int:
    """An upper bound on len(fmt % args), field by field in Python's order (printf-style)."""
    positional = args if isinstance(args, tuple) else (args,)
    mapping = args if isinstance(args, abc.Mapping) else None
    size, i, taken, n = len(fmt), 0, 0, len(fmt)

    def take():
        nonlocal taken
        taken += 1
        return positional[taken - 1]

    try:
        while (i := fmt.find("%", i) + 1) > 0:
            key = None
            if i < n and fmt[i] == "(":
                depth, j = 1, i + 1
                while j < n and depth:
                    depth += {"(": 1, ")": -1}.get(fmt[j], 0)
                    j += 1
                key, i = fmt[i + 1:j - 1], j
            while i < n and fmt[i] in "-+ #0":
                i += 1
            width, i = _printf_number(fmt, i, take)
            precision = None
            if i < n and fmt[i] == ".":
                precision, i = _printf_number(fmt, i + 1, take)
            while i < n and fmt[i] in "hlL":
                i += 1
            kind = fmt[i] if i < n else ""
            i += 1
            if kind == "%":
                continue
            value = mapping[key] if key is not None and mapping is not None else take()
            if kind in "sra":
                part = _TextSize({"s": "str", "r": "repr", "a": "ascii"}[kind])(value)
                part = min(part, precision) if precision is not None else part
            elif kind == "c":
                part = 1
            else:
                part = _number_size(value, precision or 0)
            size += max(abs(width or 0), part * escapes)
    except (IndexError, KeyError, TypeError):
        pass  # Python stops with its own error at this field, before it builds the rest
    return size


def _printf_number(fmt: str, i: int, take) -> tuple[int, int]:
    """A printf width or precision at fmt[i:] (digits, or `*` for the next argument)."""
    if i < len(fmt) and fmt[i] == "*":
        value = take()
        return (value if isinstance(value, int) else 0), i + 1
    j = i
    while j < len(fmt) and fmt[j].isdigit():
        j += 1
    return (int(fmt[i:j]) if j > i else 0), j


_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[bcdeEfFgGnosxX%]?", re.DOTALL)


def _field_size(value, spec: str) -> int:
    """An upper bound on len(format(value, spec)) (a str.format field)."""
    match = _FORMAT_SPEC.fullmatch(spec)
    if match is None:  # a type's own mini-language, such as a date's strftime codes
        return _TextSize()(value) + 64 * len(spec) + sum(int(d) for d in re.findall(r"\d+", spec))
    width, precision = int(match[1] or 0), int(match[2] or 0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return max(width, _number_size(value, precision))
    return max(width, _TextSize()(value))


class _BoundedFormatting:
    """str.format with each field sized before it is built (a mixin for jinja2's formatters)."""

    escapes = 1

    def vformat(self, format_string, args, kwargs):
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value, conversion):
        if conversion in ("s", "r", "a"):
            _build(_TextSize({"s": "str", "r": "repr", "a": "ascii"}[conversion])(value), f"`!{conversion}`")
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        part = _field_size(value, format_spec) * self.escapes
        self._size += part
        _check(self._size, "`format`")
        _build(part, "`format`")
        return super().format_field(value, format_spec)


def _line_breaks(s: str) -> int:
    return sum(map(s.count, "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"))


def _text(value) -> str:
    """str(value), sized first."""
    if not isinstance(value, str):
        _build(_TextSize()(value), "converting a value to text")
        value = str(value)
    return value


def _replace_size(s: str, old, new, count=-1, *, escapes: int = 1) -> int:
    old, new = _text(old), _text(new)
    hits = len(s) + 1 if old == "" else s.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) * escapes + hits * max(0, escapes * len(new) - len(old))


def _case_size(s, *args, **kwargs) -> int:
    return len(s) if s.isascii() else 3 * len(s)  # "ß".upper() == "SS"; no mapping gives more than 3


def _width_size(s, width=0, *args, **kwargs) -> int:
    return max(len(s), width if isinstance(width, int) else 0)


def _join_size(sep, items=(), *, escapes: int = 1) -> int:
    if all(issubclass(kind, str) for kind in set(map(type, items))):
        chars = sum(map(len, items))  # in C: a list of a string's characters can be long
    else:
        chars = sum(map(_TextSize(), items))
    return escapes * (chars + len(sep) * max(len(items) - 1, 0))


def _translate_size(s, table) -> int:
    if not isinstance(table, (abc.Mapping, list, tuple)):
        return TEMPLATE_MAX_CHARS + 1  # a table whose lookups cannot be sized
    values = table.values() if isinstance(table, abc.Mapping) else table
    longest = max((len(v) if isinstance(v, (str, bytes)) else 1 for v in values), default=1)
    return len(s) * longest


def _indent_size(s: str, width=4, first=False, blank=False) -> int:
    indent = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    _check(indent, "`indent`")
    return len(s) + (_line_breaks(s) + 2) * (indent + 1)


def _wordwrap_size(s: str, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    pieces = sum(map(s.count, "\t\x0b\x0c -")) + _line_breaks(s) + len(s) // max(width, 1) + 2
    return len(s) + pieces * len(_text(wrapstring if wrapstring is not None else "\r\n"))


def _urlize_size(s: str, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None) -> int:
    words = sum(map(s.count, " \t\n\r\x0b\x0c")) + 1
    return 11 * len(s) + words * (96 + 5 * len(_text(target or "")) + len(_text(rel or "")))


def _pairs_size(value, *, escapes: int = 1) -> int:
    items = value.items() if isinstance(value, abc.Mapping) else value
    size = _TextSize()
    return sum(escapes * (size(k) + size(v)) + 4 for k, v in items) + 1


# Each filter that can return more text than its input, as (escapes, text, *args) -> size. The
# input is sized and converted with `_text` first; `escapes` is 5 where the filter escapes HTML.
_FILTER_SIZES: dict = {
    "center": lambda e, s, width=80: _width_size(s, width),
    "format": lambda e, s, *args, **kwargs: _percent_size(s, kwargs or args, escapes=e),
    "indent": lambda e, s, *args, **kwargs: _indent_size(s, *args, **kwargs),
    "replace": lambda e, s, old, new, count=None: _replace_size(s, old, new, count, escapes=e),
    "wordwrap": lambda e, s, *args, **kwargs: _wordwrap_size(s, *args, **kwargs),
    "urlize": lambda e, s, *args, **kwargs: _urlize_size(s, *args, **kwargs),
    "truncate": lambda e, s, length=255, killwords=False, end="...", leeway=None: len(s) + len(_text(end)),
    "escape": lambda e, s: 5 * len(s), "e": lambda e, s: 5 * len(s), "forceescape": lambda e, s: 5 * len(s),
    "upper": lambda e, s: _case_size(s), "lower": lambda e, s: _case_size(s),
    "title": lambda e, s: _case_size(s), "capitalize": lambda e, s: _case_size(s),
    "string": None, "safe": None, "trim": None, "striptags": None, "wordcount": None,
    # these take any value, not text
    "tojson": lambda e, value, indent=None: _TextSize("json", len(indent) if isinstance(indent, str) else indent)(
        value),
    "pprint": lambda e, value: 4 * _TextSize("repr", indent=1)(value),
    "xmlattr": lambda e, d, autospace=True: _pairs_size(d, escapes=5),
    "urlencode": lambda e, value: 12 * (_TextSize()(value) if isinstance(value, str) else _pairs_size(value)),
    "batch": lambda e, value, linecount, fill_with=None: _check(linecount, "`batch`", "items") or 0,
    "slice": lambda e, value, slices, fill_with=None: _check(slices, "`slice`", "items") or 0,
    "list": lambda e, value: _list_size(value),
}
_ANY_VALUE_FILTERS = frozenset({"tojson", "pprint", "xmlattr", "urlencode", "batch", "slice", "list"})


def _list_size(value) -> int:
    """list(value) of a string: one item per character, each a new object unless it is ASCII."""
    if isinstance(value, str):
        _build(len(value), "the `list` filter", is_list=True, weight=4 if value.isascii() else _PIECE)
    return 0


def _bounded_filter(name: str, original, size):
    """`original` with its input sized and converted first (text filters) and its result sized."""
    from markupsafe import Markup

    skip = 1 if getattr(original, "jinja_pass_arg", None) else 0  # the context jinja2 passes first

    @functools.wraps(original)  # keeps jinja_pass_arg
    def bounded(*args, **kwargs):
        lead, value, rest = args[:skip], args[skip], args[skip + 1:]
        is_escaping = isinstance(value, Markup) or bool(lead) and getattr(lead[0], "autoescape", False) is True
        if name in _ANY_VALUE_FILTERS:
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, abc.Mapping, list, tuple)):
                value = list(value)  # a generator: sized here, then read by the filter
            text = value
        else:
            text = _text(value)
        if size is not None:
            _build(size(5 if is_escaping else 1, text, *rest, **kwargs), f"the `{name}` filter")
        return original(*lead, value, *rest, **kwargs)

    return bounded


def _bounded_join(original):
    """jinja2's `join`, its items read once and sized before they are joined."""
    from jinja2.filters import make_attrgetter
    from jinja2.utils import pass_eval_context

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        items = list(value)
        _build(_join_size(_text(d), items, escapes=5 if eval_ctx.autoescape else 1), "the `join` filter")
        return original(eval_ctx, items, d)

    return join


def _bounded_sum(environment, iterable, attribute=None, start=0):
    """jinja2's `sum`, adding lists one at a time so each sum is sized (Python's sum() is one C call)."""
    from jinja2.filters import make_attrgetter

    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if isinstance(start, (int, float, str, bytes)):
        return sum(iterable, start)
    total = start
    for item in iterable:
        if isinstance(total, (list, tuple)) and isinstance(item, (list, tuple)):
            _build(len(total) + len(item), "the `sum` filter", is_list=True)
        total = total + item
    return total


def _bounded_lipsum(original):
    def lipsum(n=5, html=True, min=20, max=100):
        _build(n * (max * 13 + 64), "`lipsum`")
        return original(n, html, min, max)

    return lipsum


def strftime_now(fmt: str) -> str:
    _build(64 * len(_text(fmt)), "`strftime_now`")  # no strftime code gives more than 64 characters
    return datetime.datetime.now().strftime(fmt)


# Each str/bytes method that can return more than its string holds, as (string, *args) -> size.
_METHOD_SIZES: dict = {
    "center": _width_size, "ljust": _width_size, "rjust": _width_size, "zfill": _width_size,
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 0),
    "replace": lambda s, old, new, count=-1: (_replace_size(s, old, new, count) if isinstance(s, str)
                                              else len(s) + (s.count(old) + 1) * len(new)),
    "join": lambda s, items: _join_size(s, items),
    "translate": lambda s, table, *args, **kwargs: _translate_size(s, table),
    "encode": lambda s, *args, **kwargs: 10 * len(s) + 8,
    "decode": lambda s, *args, **kwargs: 4 * len(s),
    "hex": lambda s, *args, **kwargs: 3 * len(s),
    "upper": _case_size, "lower": _case_size, "title": _case_size, "capitalize": _case_size,
    "swapcase": _case_size, "casefold": _case_size,
}

# Each str/bytes method that returns a list of new strings, as (string, *args) -> how many.
_PIECE = 25  # a new small string object: some 50 bytes, against a character's 1 to 4
_METHOD_PIECES: dict = {
    "split": lambda s, sep=None, maxsplit=-1: _pieces(s, sep, maxsplit),
    "rsplit": lambda s, sep=None, maxsplit=-1: _pieces(s, sep, maxsplit),
    "splitlines": lambda s, keepends=False: _pieces(s, b"\n" if isinstance(s, bytes) else None, -1, lines=True),
}


def _pieces(s, sep, maxsplit, *, lines: bool = False) -> int:
    """How many pieces s.split(sep, maxsplit) (or s.splitlines(), `lines`) can return."""
    if lines and isinstance(s, str):
        pieces = _line_breaks(s) + 1
    elif sep is not None:
        pieces = (s.count(sep) + (s.count(b"\r") if lines else 0) + 1) if len(sep) else 1
    elif isinstance(s, str) and not s.isascii():
        pieces = len(s) // 2 + 1  # Unicode has more spaces than ASCII's six
    else:
        spaces = " \t\n\r\x0b\x0c"
        pieces = sum(map(s.count, spaces if isinstance(s, str) else [c.encode() for c in spaces])) + 1
    return pieces if not isinstance(maxsplit, int) or maxsplit < 0 else min(pieces, maxsplit + 1)


def raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
