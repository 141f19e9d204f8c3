"""Issue 17: the seeded hostile-line fuzz of serve-stdio (scripts/fuzz_serve_stdio.py), reduced to
a couple hundred lines: exit 0, JSON-only stdout, one final frame per line, good requests
token-identical to a clean server."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_serve_stdio.py"


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_serve_stdio", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hostile_lines_never_break_serve_stdio():
    fuzz = load_fuzz()
    lines, good = fuzz.make_lines(200, seed=1, max_bytes=65536)
    result = fuzz.check(lines, good, model="demo", max_line_bytes=65536, timeout=300)
    assert result["good"] == len(good) > 0 and result["errors"] > 100
