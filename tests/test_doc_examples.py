"""The transcripts in the docs are real: each `$ command` block runs, and what it prints matches
what the page shows (fields the page shortens with `...` are compared up to the cut)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def transcripts(page: str) -> list[tuple[str, list[str]]]:
    """(command, shown output lines) of every ```bash block that starts with `$ `."""
    found = []
    for block in re.findall(r"```bash\n(\$ .+?)\n```", ROOT.joinpath(page).read_text(), flags=re.S):
        lines = block.splitlines()
        command = [lines[0][2:]]
        while command[-1].endswith("\\"):
            command.append(lines[len(command)].strip())
        found.append(("\n".join(command), lines[len(command):]))
    return found


def shown_frame(line: str) -> dict | None:
    """A frame as the page shows it, `...` cuts made parseable; None for a line that is only `...`."""
    if line.strip() == "...":
        return None
    return json.loads(re.sub(r",\s*\.\.\.\}", "}", line))


def matches(shown, actual) -> bool:
    if isinstance(shown, str) and isinstance(actual, str) and "..." in shown:  # "head..." or "...tail"
        head, _, tail = shown.partition("...")
        return actual.startswith(head) and actual.endswith(tail)
    if isinstance(shown, dict) and isinstance(actual, dict):
        return all(key in actual and matches(value, actual[key]) for key, value in shown.items()
                   if key not in ("ttft_ms", "stats"))
    return shown == actual


def run(command: str, tmp_path: Path) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "strata").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m strata_cli.cli "$@"\n')
    (bin_dir / "strata").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.parametrize("page", ["docs/serve.md"])
def test_every_transcript_prints_what_the_page_shows(page, tmp_path):
    examples = transcripts(page)
    assert examples, f"{page} has no transcript"
    for command, shown in examples:
        actual = [json.loads(line) for line in run(command, tmp_path)]
        frames = [f for f in map(shown_frame, shown) if f is not None]
        deltas = {}  # the deltas shown for each id must be the first ones sent, in order
        for frame in frames:
            if "delta" in frame:
                deltas.setdefault(frame["id"], []).append(frame["delta"])
        for rid, pieces in deltas.items():
            sent = [f["delta"] for f in actual if f.get("id") == rid and "delta" in f]
            assert sent[: len(pieces)] == pieces, (command, rid)
        finals = [f for f in frames if "delta" not in f]
        actual_finals = [f for f in actual if "delta" not in f]
        assert len(finals) == len(actual_finals), (command, actual_finals)
        for want, got in zip(finals, actual_finals):
            assert matches(want, got), (command, want, got)


def test_the_readme_sample_is_what_the_demo_model_prints(tmp_path):
    """README shows the quick start's output: the same text, line for line (greedy, CPU float32)."""
    block = re.search(r"```\n\$ (strata generate .+?)\n(.*?)\n```", ROOT.joinpath("README.md").read_text(), flags=re.S)
    command, shown = block.group(1), block.group(2)
    printed = "\n".join(run(command, tmp_path))
    assert printed.rstrip() == shown.rstrip()
