"""Issue 17: the seeded hostile-line fuzz of serve-stdio (scripts/lab/fuzz_serve_stdio.py), reduced to
a couple hundred lines: exit 0, JSON-only stdout, one final frame per line, good requests
token-identical to a clean server."""

from scripts.lab import fuzz_serve_stdio as fuzz


def test_hostile_lines_never_break_serve_stdio():
    lines, good = fuzz.make_lines(200, seed=1, max_bytes=65536)
    result = fuzz.check(lines, good, model="demo", max_line_bytes=65536, timeout=300)
    assert result["good"] == len(good) > 0 and result["errors"] > 100
