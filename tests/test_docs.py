"""README's quick start: the commands it gives are the ones CI runs, and they do not collide."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_ci_runs_exactly_the_readme_test_command():
    use, test = quick_start_commands()
    assert "pytest" in test and "pytest" not in use
    assert test in ROOT.joinpath(".ci/run").read_text().splitlines()


def test_the_two_quick_starts_use_their_own_venvs():
    venvs = [re.search(r"python3 -m venv (\S+)", command).group(1) for command in quick_start_commands()]
    assert venvs == [".venv", ".venv-test"]


def test_pytest_q_prints_the_summary():
    """`addopts = "-q"` plus the README's `-q` made `-qq`, which drops the "N passed" line."""
    pyproject = ROOT.joinpath("pyproject.toml").read_text()  # (tomllib is 3.11+; we support 3.10)
    addopts = re.findall(r"^addopts\s*=\s*(.*)$", pyproject, flags=re.M)
    assert not any(re.search(r"(^|[\s\"'])-q", line) for line in addopts)
