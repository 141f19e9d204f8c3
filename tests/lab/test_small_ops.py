"""scripts/lab/small_ops.py (gpu_owed.sh's `small-ops` stage) runs on the CPU: the embedding at every
T both ways, and a KV row's write both ways, which on the CPU keeps the buffer (MLX donates it)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_ops_times_each_op_both_ways(tmp_path):
    out = tmp_path / "small_ops.json"
    subprocess.run([sys.executable, "-m", "scripts.lab.small_ops", "--tiny", "--rounds", "1", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert {form: sorted(by_t) for form, by_t in report["embed_us"].items()} == {
        "host_ids": ["1", "2", "4", "8"], "kept_ids": ["1", "2", "4", "8"]}
    assert [row["cells"] for row in report["kv_write"]] == [64, 256]
    for row in report["kv_write"]:
        assert row["dynamic_us"] > 0 and row["static_us"] > 0
        assert row["dynamic_kept_buffer"] and row["static_kept_buffer"]
