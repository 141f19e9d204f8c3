"""README's everyday commands run as written (so they cannot drift), on the demo model.

Each line of the "Everyday commands" block runs through bash in a scratch directory that holds
the repository's examples/ and small input files the commands name (request.txt, prompts.txt,
banned.txt, requests.jsonl); budgets come from STRATA_* variables so the block runs in seconds.
Only lines that need a downloaded checkpoint (~/models/...) are left out, and the test says which.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"STRATA_MAX_TOKENS": "12", "STRATA_BENCH_TOKENS": "6", "STRATA_BENCH_REPEATS": "1",
           "STRATA_BENCH_WARMUP": "0", "STRATA_SELFTEST_TOKENS": "4", "STRATA_BENCH_PEERS": "0"}
NEEDS_A_DOWNLOAD = "~/models/"


def everyday_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Everyday commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.+?)\n```", section, flags=re.S).group(1)
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    here = tmp_path_factory.mktemp("readme")
    (here / "examples").symlink_to(ROOT / "examples")
    (here / "request.txt").write_text("def parse(line):\n    \"\"\"Split a line into fields.\"\"\"\n")
    (here / "prompts.txt").write_text("def add(a, b):\n\nclass Stack:\n")
    (here / "banned.txt").write_text("TODO\n")
    (here / "requests.jsonl").write_text('{"id": 1, "prompt": "def f(x):", "max_tokens": 4}\n')
    bin_dir = here / "bin"  # `strata` as this interpreter runs it, whatever venv the tests run in
    bin_dir.mkdir()
    (bin_dir / "strata").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m strata_cli.cli "$@"\n')
    (bin_dir / "strata").chmod(0o755)
    return here


def test_the_block_is_there_and_mostly_runnable():
    commands = everyday_commands()
    assert len(commands) >= 10
    assert all(c.startswith(("strata ", "cat ")) for c in commands)
    assert sum(NEEDS_A_DOWNLOAD in c for c in commands) <= 3


@pytest.mark.parametrize("command", [c for c in everyday_commands() if NEEDS_A_DOWNLOAD not in c])
def test_an_everyday_command_runs_as_written(scratch, command):
    env = {**os.environ, **BUDGETS, "PATH": f"{scratch / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), command
