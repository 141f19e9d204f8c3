"""scripts/bench/gpu_owed.sh names flags of the scripts it runs: each must still be one of that
script's options, so the plan for the next GPU loan does not rot while no GPU is lent."""

import re
import subprocess
import tarfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "scripts" / "bench" / "gpu_owed.sh"


def commands() -> dict[str, set[str]]:
    """Every module the plan runs and the flags it passes to it (line continuations joined; the
    python-from-stdin form names its module inside the heredoc)."""
    text = PLAN.read_text().replace("\\\n", " ")
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        module = re.search(r"python (?:-m (scripts\.[\w.]+)|- )", line)
        if module:  # `python -` is the `tail` stage's heredoc, which runs compare_mlx_lm
            name = module.group(1) or "scripts.bench.compare_mlx_lm"
            found.setdefault(name, set()).update(re.findall(r"\s(--[a-z][a-z0-9-]*)", line[module.end():]))
    return found


def test_every_flag_of_the_plan_is_an_option_of_its_script():
    planned = commands()
    assert {"scripts.bench.startup", "scripts.bench.kernel_bench", "scripts.bench.compare_mlx_lm",
            "scripts.bench.step_profile", "scripts.lab.launch_cost", "scripts.bench.stream_80b"} <= set(planned)
    for module, flags in planned.items():
        help_text = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout
        options = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
        assert flags <= options, (module, sorted(flags - options))


def test_the_plan_parses_as_bash():
    subprocess.run(["bash", "-n", str(PLAN)], check=True)


def test_background_runs_a_stage_past_the_call_and_packs_its_files_into_out(tmp_path):
    """`background STAGE` keeps the stage's files in BG_DIR, which outlives a device call, and
    packs them into the call's $OUT (one archive); a stage it does not know ends at once (usage, exit 2)."""
    bg, out = tmp_path / "bg", tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BG_DIR": str(bg), "OUT": str(out)}
    done = subprocess.run(["bash", str(PLAN), "background", "no-such-stage", "30"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=True)
    assert "done" in done.stdout and "still running" not in done.stdout
    assert "no-such-stage started" in (bg / "stages.log").read_text()
    with tarfile.open(out / "gpu-owed.tgz") as archive:
        usage = archive.extractfile("./no-such-stage.stdout").read().decode()
    assert "bash scripts/bench/gpu_owed.sh startup" in usage
    again = subprocess.run(["bash", str(PLAN), "background"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True)  # no stage: wait for the last one (ended), copy again
    assert "done" in again.stdout and (bg / "stages.log").read_text().count("started") == 1
