"""Write docs/cli.md, the full option reference, from the click commands themselves, and
docs/stats.md, the glossary of the telemetry figures, from telemetry.py's field tables.

    python -m scripts.cli_docs            # rewrite both
    python -m scripts.cli_docs --check    # exit 1 when either is not current

tests/test_cli_docs.py runs the check, so neither can drift from the code.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import click

from strata_cli.cli import cli
from strata_cli.cli_options import PANEL_ORDER
from strata_cli.telemetry import EXPERT_FIELDS, FIELDS

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "cli.md"
STATS = ROOT / "docs" / "stats.md"
OTHER = "Other options"
ORDER = ("generate", "serve", "serve-stdio", "bench", "selftest", "convert", "verify")  # everyday first


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def names(param: click.Option) -> str:
    flags = ", ".join(f"`{flag}`" for flag in [*param.opts, *param.secondary_opts])
    if param.is_flag:
        return flags
    return f"{flags} {cell(param.make_metavar(click.Context(click.Command('x'))))}"


def default(param: click.Option) -> str:
    if param.is_flag and not param.secondary_opts:
        return ""
    if param.default is None or param.default == ():
        return ""
    value = param.default
    if isinstance(value, bool) and param.secondary_opts:
        value = (param.opts if value else param.secondary_opts)[0]
    return f"`{value}`"


def help_text(command: click.Command) -> str:
    """The docstring as Markdown: `\\b` paragraphs (examples) become code blocks."""
    out = []
    for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
        if paragraph.startswith("\b"):
            lines = paragraph.split("\n")[1:]
            title = lines[0] if lines and not lines[0].startswith(" ") else None
            body = [line.strip() for line in (lines[1:] if title else lines)]
            if title:
                out.append(title)
            out.append("```bash\n" + "\n".join(body) + "\n```")
        else:
            out.append(" ".join(paragraph.split()))
    return "\n\n".join(out)


def render() -> str:
    ctx = click.Context(cli, info_name="strata")
    parts = [
        "# strata command reference",
        "",
        "Generated from the commands by `python -m scripts.cli_docs` (tests/test_cli_docs.py keeps it "
        "current). Every option can also be set through the environment variable in its row; a bad "
        "value from one is reported with the variable's name.",
    ]
    for name in sorted(cli.list_commands(ctx), key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        command = cli.get_command(ctx, name)
        usage = " ".join(command.collect_usage_pieces(click.Context(command, info_name=name)))
        parts += ["", f"## strata {name}", "", f"`strata {name} {usage}`", "", help_text(command)]
        options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
        panels: dict[str, list[click.Option]] = {}
        for param in options:
            panels.setdefault(getattr(param, "panel", None) or OTHER, []).append(param)
        for panel in sorted(panels, key=lambda p: PANEL_ORDER.index(p) if p in PANEL_ORDER else len(PANEL_ORDER)):
            parts += ["", f"### {panel}", "", "| option | env | default | meaning |", "|---|---|---|---|"]
            for param in panels[panel]:
                env = f"`{param.envvar}`" if isinstance(param.envvar, str) else ""
                parts.append(f"| {names(param)} | {env} | {default(param)} | {cell(param.help or '')} |")
    return "\n".join(parts) + "\n"


def render_stats() -> str:
    parts = [
        "# strata decode telemetry: what each figure means",
        "",
        "`strata generate --stats` prints these figures on stderr (label, value with unit, key); `--json`,",
        "serve-stdio replies and `strata bench --out` carry them under the same keys in their `stats`",
        "object, as plain numbers (shares as fractions 0..1, times in the unit the key names, bytes as",
        "integers). `--stats` shows n/a where a ratio has nothing to divide; the JSON then holds 0.",
        "Generated from `strata_cli/telemetry.py` by `python -m scripts.cli_docs`.",
    ]
    for title, fields, prefix in (("Decoding", FIELDS, ""),
                                  ("Streamed experts (`experts`, null unless the checkpoint streams them)",
                                   EXPERT_FIELDS, "experts.")):
        parts += ["", f"## {title}", "", "| key | `--stats` label | unit | meaning |", "|---|---|---|---|"]
        for key, (label, unit, meaning) in fields.items():
            parts.append(f"| `{prefix}{key}` | {cell(label)} | {unit} | {cell(meaning)} |")
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    outputs = {TARGET: render(), STATS: render_stats()}
    if "--check" in argv:
        stale = [str(path) for path, text in outputs.items() if not path.is_file() or path.read_text() != text]
        if stale:
            print(f"not current: {', '.join(stale)}: run python -m scripts.cli_docs", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
