"""The demo model's training text: offline Python sources, and documents that teach copying.

Sources (`corpus_sources`): the CPython standard library (every 50th file held out for
evaluation, as before) and the Python code of permissively licensed packages installed beside
strata, each recorded with the licence its own metadata states. HumanEval is never read here:
it is the evaluation set.

Copy documents (`copy_documents`): functions from the training split repeated under a new name
in the model card's exact copy form (rough HumanEval-like whitespace kept verbatim), HumanEval-
shaped single functions (imports, signature, docstring, body), functions with a variable renamed
or edited through a unified diff, and log-like text with repeated lines, so the model learns what
suffix drafts exploit: text that repeats something seen before.
"""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import io
import keyword
import random
import re
import sysconfig
import textwrap
import tokenize
from pathlib import Path

HELD_OUT_EVERY = 50
# Package -> (distribution name, cap in bytes of its Python text): large packages are capped so
# no single code base dominates. Only these, and only when their metadata names a permissive
# licence (PERMISSIVE), are read.
PACKAGES = {
    "transformers": ("transformers", 24_000_000),
    "torch": ("torch", 20_000_000),
    "sympy": ("sympy", 10_000_000),
    "numpy": ("numpy", 6_000_000),
    "networkx": ("networkx", 3_000_000),
    "setuptools": ("setuptools", 2_000_000),
    "mlx_lm": ("mlx-lm", 2_000_000),
    "mpmath": ("mpmath", 1_500_000),
    "_pytest": ("pytest", 1_500_000),
    "rich": ("rich", 1_200_000),
    "fontTools": ("fonttools", 2_000_000),
    "fsspec": ("fsspec", 1_000_000),
    "click": ("click", 1_000_000),
    "packaging": ("packaging", 1_000_000),
    "pyparsing": ("pyparsing", 1_000_000),
    "anyio": ("anyio", 1_000_000),
    "dateutil": ("python-dateutil", 1_000_000),
    "yaml": ("PyYAML", 1_000_000),
    "pip": ("pip", 3_000_000),
    "fire": ("fire", 1_000_000),
    "mlx": ("mlx", 1_000_000),
    "idna": ("idna", 1_000_000),
}
PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a handful of stdlib test files are deliberately not UTF-8


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """Every stdlib *.py file (library and tests), sorted; every 50th held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "__pycache__"} & set(p.parts))
    held_out = files[::HELD_OUT_EVERY]
    held = set(held_out)
    keep = lambda fs: [f for f in fs if read_text(f) is not None]  # noqa: E731
    return keep([f for f in files if f not in held]), keep(held_out)


def licence_of(dist_name: str) -> str:
    meta = importlib.metadata.metadata(dist_name)
    text = meta.get("License-Expression") or meta.get("License") or ""
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    return " / ".join(x for x in (text.strip().splitlines()[0] if text.strip() else "", *classifiers) if x)


def package_files() -> tuple[list[Path], list[dict]]:
    """Python files of the PACKAGES that are installed and permissively licensed, with a record each."""
    site = Path(sysconfig.get_paths()["purelib"])
    files, records = [], []
    for package, (dist, cap) in PACKAGES.items():
        root = site / package
        try:
            licence = licence_of(dist)
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not root.is_dir() or not any(p in licence for p in PERMISSIVE):
            continue
        taken, size = [], 0
        for f in sorted(root.rglob("*.py")):
            n = f.stat().st_size
            if size + n > cap or "__pycache__" in f.parts:
                continue
            if read_text(f) is not None:
                taken.append(f)
                size += n
        files += taken
        records.append({"package": package, "distribution": dist, "version": version, "licence": licence,
                        "files": len(taken), "bytes": size})
    return files, records


# -- copy documents ------------------------------------------------------------------------------


def functions(source: str, min_lines: int = 4, max_lines: int = 60) -> list[str]:
    """Source of each function (dedented) of 4-60 lines in `source`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            n = node.end_lineno - node.lineno + 1
            if min_lines <= n <= max_lines:
                fn = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                if parses(fn):  # dedent fails on bodies with strings at column 0
                    out.append(fn)
    return out


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


WORDS = ("value", "item", "data", "result", "count", "total", "node", "key", "entry", "buffer", "token",
         "index", "text", "name", "path", "size", "limit", "offset", "record", "state", "parse", "load",
         "check", "find", "merge", "split", "build", "update", "compute", "collect", "render", "apply")


def new_name(rng: random.Random, old: str) -> str:
    style = rng.randrange(5)
    if style == 0:
        return "solve_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 3)))
    if style == 1:
        return f"{old}_{rng.choice(('copy', 'v2', 'new', 'fast', 'impl', 'alt'))}"
    if style == 2:
        return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
    if style == 3:
        return f"{rng.choice(('new', 'my', 'do', 'safe'))}_{old.lstrip('_')}"
    return rng.choice(WORDS) + str(rng.randint(1, 99))


def rename(source: str, old: str, new: str) -> str | None:
    """`source` with every NAME token `old` replaced by `new` (strings and comments untouched)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    lines = source.splitlines(keepends=True)
    edits = [t for t in tokens if t.type == tokenize.NAME and t.string == old]
    for t in reversed(edits):  # right to left keeps earlier columns valid
        row, col = t.start
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def function_name(source: str) -> str:
    return re.match(r"\s*(?:async\s+)?def\s+(\w+)", source).group(1)


def argument_names(source: str) -> list[str]:
    node = ast.parse(source).body[0]
    return [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]


def light_edit(rng: random.Random, source: str) -> tuple[str, str] | None:
    """A small edit of a function and its description: rename an argument or a number."""
    args = argument_names(source)
    if args and rng.random() < 0.6:
        old = rng.choice(args)
        new = rng.choice([w for w in WORDS if w != old and w not in source] or ["renamed"])
        edited = rename(source, old, new)
        return (edited, f"`{old}` renamed to `{new}`") if edited and edited != source else None
    numbers = list(re.finditer(r"(?<![\w.])(\d+)(?![\w.])", source))
    if not numbers:
        return None
    m = rng.choice(numbers)
    value = str(int(m.group(1)) + rng.choice((1, 2, 10, -1)) if int(m.group(1)) > 1 else 2)
    return source[: m.start()] + value + source[m.end():], f"{m.group(1)} changed to {value}"


def has_docstring(fn: str) -> bool:
    node = ast.parse(fn).body[0]
    return ast.get_docstring(node) is not None


def split_signature(fn: str) -> tuple[str, str]:
    """The `def` line(s) and the body (docstring and code), cut where the model card cuts them."""
    node = ast.parse(fn).body[0]
    lines = fn.splitlines(keepends=True)
    return "".join(lines[: node.body[0].lineno - 1]), "".join(lines[node.body[0].lineno - 1 :])


def roughen(rng: random.Random, fn: str) -> str:
    """Hand-written whitespace as HumanEval has it: trailing spaces on some lines, blank lines
    indented. Linted training code never has these, so a model trained on it alone "corrects"
    them while copying and the copy test stops at the first one."""
    rate = rng.choice((0.05, 0.1, 0.2))
    lines = fn.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            if rng.random() < 0.5:  # a blank line keeps the indentation of its neighbour
                nxt = next((x for x in lines[i + 1 :] if x.strip()), "")
                lines[i] = nxt[: len(nxt) - len(nxt.lstrip())]
        elif not line.endswith("\\") and rng.random() < rate:
            lines[i] = line + " " * rng.choice((1, 1, 1, 2))
    out = "\n".join(lines)
    return out if parses(out) else fn


def docstring_span(fn: str) -> tuple[int, int] | None:
    """0-based first and last line of `fn`'s docstring when it spans several lines, else None."""
    node = ast.parse(fn).body[0]
    first = node.body[0]
    if ast.get_docstring(node) is None or first.end_lineno == first.lineno:
        return None
    return first.lineno - 1, first.end_lineno - 1


def example_value(rng: random.Random, kind: int) -> str:
    """A literal of `kind`: small numbers (so values repeat, as in HumanEval's examples), a list,
    a short string, a float or a constant."""
    if kind == 0:
        return str(rng.choice((rng.randint(0, 12), rng.randint(-50, 500))))
    if kind == 1:
        return "[" + ", ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(0, 7))) + "]"
    if kind == 2:
        return repr("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(1, 10))).strip() or "a")
    if kind == 3:
        return f"{rng.uniform(-10, 10):.{rng.randint(1, 3)}f}"
    return rng.choice(("True", "False", "None"))


EXAMPLE_FORMS = (">>> {call}\n{indent}{result}", "{call} == {result}", "{call} should return {result}.",
                 "{call} ==> {result}", "{call} -> {result}")


def with_examples(rng: random.Random, fn: str) -> str:
    """`fn` with HumanEval-like example lines (`>>> f([1, 2, 2])`, `f(3) should return 4.`) at the
    end of its docstring: one form repeated with random values, so a copy has to follow its source
    line by line and value by value rather than guess or jump to a look-alike line."""
    span = docstring_span(fn)
    if span is None:
        return fn
    lines = fn.split("\n")
    closing = lines[span[1]]
    if closing.strip() not in ('"""', "'''"):
        return fn
    indent = closing[: len(closing) - len(closing.lstrip())]
    name, form = function_name(fn), rng.choice(EXAMPLE_FORMS)
    arg_kinds, result_kind = [rng.randrange(5) for _ in range(rng.randint(1, 2))], rng.randrange(5)
    examples = []
    for _ in range(rng.randint(2, 6)):
        call = f"{name}({', '.join(example_value(rng, k) for k in arg_kinds)})"
        examples.append(indent + form.format(call=call, indent=indent, result=example_value(rng, result_kind)))
    head = [indent + rng.choice(("Examples:", "Example:", "For example:"))] if rng.random() < 0.5 else []
    out = "\n".join(lines[: span[1]] + [""] + head + examples + lines[span[1] :])
    return out if parses(out) else fn


def scramble(rng: random.Random, fn: str, vocabulary: list[str]) -> str:
    """`fn` with a share of its docstring's words swapped for random ones: prose the model cannot
    predict, so copying it must follow the source where the model's own wording would win."""
    span = docstring_span(fn)
    if span is None or not vocabulary:
        return fn
    rate = rng.choice((0.1, 0.2, 0.3))
    lines = fn.split("\n")
    for i in range(span[0], span[1] + 1):
        lines[i] = re.sub(r"\b[A-Za-z]{3,}\b", lambda m: rng.choice(vocabulary) if rng.random() < rate else m.group(0),
                          lines[i])
    out = "\n".join(lines)
    return out if parses(out) else fn


def docstring_words(functions: list[str], limit: int = 20_000) -> list[str]:
    """The distinct words (3+ letters) of the docstrings of `functions`, sorted, at most `limit`."""
    words = set()
    for fn in functions:
        words.update(re.findall(r"\b[A-Za-z]{3,}\b", ast.get_docstring(ast.parse(fn).body[0]) or ""))
        if len(words) >= limit:
            break
    return sorted(words)


HEADERS = ("\n", "\n", "from typing import List\n\n\n", "from typing import List, Tuple\n\n\n",
           "import math\n\n\n", "from typing import Optional\n\n\n", "")


def card_copy_document(rng: random.Random, fn: str, path: str, vocabulary: list[str] = ()) -> str:
    """The model card's copy test, in its exact form: a file's text (a function, often rough
    whitespace), three newlines, `# The same function, renamed to NAME:`, the `def` line under the
    new name and the body again verbatim (only the signature is renamed, as the card does). Some
    functions get example lines or words from `vocabulary` in their docstrings first (`with_examples`,
    `scramble`): text a copy must follow exactly, where the model's own guess would differ."""
    name = function_name(fn)
    if rng.random() < EXAMPLES_SHARE:
        fn = with_examples(rng, fn)
    if rng.random() < SCRAMBLE_SHARE:
        fn = scramble(rng, fn, vocabulary)
    if rng.random() < 0.6:
        fn = roughen(rng, fn)
    signature, body = split_signature(fn)
    new = "solve_x" if rng.random() < 0.25 else new_name(rng, name)
    renamed = re.sub(rf"def\s+{re.escape(name)}\(", f"def {new}(", signature, count=1)
    lead = rng.choice(HEADERS + (f"# {path}\n\n",))
    return f"{lead}{fn}".rstrip() + f"\n\n\n# The same function, renamed to {new}:\n{renamed}{body}\n"


def problem_document(rng: random.Random, fn: str) -> str:
    """A HumanEval-shaped file: imports, then one function with a docstring and its body."""
    if rng.random() < 0.5:
        fn = roughen(rng, fn)
    return f"{rng.choice(HEADERS)}{fn}\n"


def copy_document(rng: random.Random, fn: str, path: str) -> str | None:
    name = function_name(fn)
    kind = rng.randrange(6)
    if kind <= 2:  # the function again under a new name, every use renamed
        new = new_name(rng, name)
        renamed = rename(fn, name, new)
        if renamed is None:
            return None
        lead = rng.choice(("", "Here is a function:\n\n", f"# {path}\n\n"))
        gap = rng.choice(("\n\n", "\n\n\n"))
        return f"{lead}{fn}{gap}# The same function, renamed to {new}:\n{renamed}\n"
    edit = light_edit(rng, fn)
    if edit is None:
        return None
    edited, what = edit
    if kind == 3:
        return f"{fn}\n\n\n# The same function with {what}:\n{edited}\n"
    diff = "".join(difflib.unified_diff(fn.splitlines(True), edited.splitlines(True),
                                        f"a/{path}", f"b/{path}", n=rng.choice((1, 2, 3))))
    if kind == 4:
        return f"{fn}\n\n# Patch ({what}):\n{diff}\n# After the patch:\n{edited}\n"
    return f"diff --git a/{path} b/{path}\n{diff}"


def log_document(rng: random.Random) -> str:
    """Log-like text: a few message templates repeated with changing fields."""
    names = [f"{rng.choice(WORDS)}-{i}" for i in range(rng.randint(1, 4))]
    templates = [
        "{t} INFO {w}: processed batch {n} in {s:.2f} s",
        "{t} DEBUG {w}: cache hit for key {k}",
        "{t} WARNING {w}: retrying request {n} after timeout ({s:.1f} s)",
        "{t} INFO {w}: wrote {n} records to {p}",
        "{t} ERROR {w}: failed to open {p}: No such file or directory",
    ]
    chosen = rng.sample(templates, rng.randint(2, 4))
    second = rng.randint(0, 3000)
    lines = []
    for i in range(rng.randint(20, 80)):
        second += rng.randint(0, 3)
        t = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {second // 3600 % 24:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
        lines.append(rng.choice(chosen).format(t=t, w=rng.choice(names), n=i + rng.randint(0, 3), s=rng.random() * 5,
                                               k=rng.choice(WORDS) + str(rng.randint(0, 20)),
                                               p=f"/var/data/{rng.choice(WORDS)}_{rng.randint(0, 9)}.json"))
    return "\n".join(lines) + "\n"


# Shares of the copy documents (the rest: edits, diffs, whole-name renames; a tenth of those logs).
CARD_COPY_SHARE = 0.6
PROBLEM_SHARE = 0.15
# Of the card-form copies: those whose docstring gets example lines, and those whose words are
# scrambled (both may happen to one).
EXAMPLES_SHARE = 0.4
SCRAMBLE_SHARE = 0.3


def copy_documents(files: list[Path], root_of, n_documents: int, seed: int) -> list[str]:
    """`n_documents` documents from functions of the training `files`: CARD_COPY_SHARE in the
    model card's copy form (functions of 8-45 lines with a docstring, mostly free functions), PROBLEM_SHARE
    HumanEval-shaped single functions, the rest copy/edit/diff documents and log-like text."""
    rng = random.Random(seed)
    pool = []
    for f in files:
        text = read_text(f)
        if text is not None:
            pool += [(fn, root_of(f)) for fn in functions(text)]
    pool = [(fn, path) for fn, path in pool if not keyword.iskeyword(function_name(fn))]
    documented = [(fn, path) for fn, path in pool if 8 <= fn.count("\n") + 1 <= 45 and has_docstring(fn)]
    # HumanEval's functions are free functions: prefer those over methods.
    free = [(fn, path) for fn, path in documented if not re.match(r"\s*(?:async\s+)?def\s+\w+\(\s*(self|cls)\b", fn)]
    vocabulary = docstring_words([fn for fn, _ in documented])
    docs = []
    while len(docs) < n_documents:
        r = rng.random()
        if r < CARD_COPY_SHARE:
            r = rng.random()
            fn, path = rng.choice(free if r < 0.6 else documented if r < 0.9 else pool)
            docs.append(card_copy_document(rng, fn, path, vocabulary))
            continue
        if r < CARD_COPY_SHARE + PROBLEM_SHARE:
            docs.append(problem_document(rng, rng.choice(free)[0]))
            continue
        if rng.random() < 0.1:
            docs.append(log_document(rng))
            continue
        fn, path = rng.choice(pool)
        doc = copy_document(rng, fn, path)
        if doc:
            docs.append(doc)
    return docs
