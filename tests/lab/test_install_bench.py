"""scripts/lab/install_bench.py's `--bank-sizes` mode (the next GPU loan's `installs` stage) runs on
the CPU: every size with both ways of writing a pass, the written banks checked by the tests of
`write_slots` (tests/test_experts.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bank_sizes_times_both_forms_at_every_size(tmp_path):
    out = tmp_path / "installs.json"
    subprocess.run([sys.executable, "-m", "scripts.lab.install_bench", "--tiny", "--bank-sizes", "8", "16",
                    "--passes", "3", "--repeats", "1", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert [(r["slots"], r["variant"]) for r in report["rows"]] == [
        (8, "per_slot"), (8, "scatter"), (16, "per_slot"), (16, "scatter")]
    assert all(r["records_per_pass"] == 3 and r["ms_per_record"] > 0 for r in report["rows"])
    assert report["advised"] is False  # no CUDA here
