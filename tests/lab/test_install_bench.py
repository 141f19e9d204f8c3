"""scripts/lab/install_bench.py's `--bank-sizes` mode (the next GPU loan's `installs` stage) runs on
the CPU: every size with each way of writing a pass, each form's written slots checked by the
script itself (`write_slots` has its own tests in tests/test_experts.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bank_sizes_times_each_form_at_every_size(tmp_path):
    out = tmp_path / "installs.json"
    subprocess.run([sys.executable, "-m", "scripts.lab.install_bench", "--tiny", "--bank-sizes", "8", "16",
                    "--passes", "3", "--repeats", "1", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    report = json.loads(out.read_text())
    variants = ["static", "dynamic", "scatter"]
    assert [(r["slots"], r["variant"]) for r in report["rows"]] == [(S, v) for S in (8, 16) for v in variants]
    assert all(r["records_per_pass"] == 3 and r["ms_per_record"] > 0 for r in report["rows"])
    assert report["advised"] is False  # no CUDA here
