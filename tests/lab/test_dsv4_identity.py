"""scripts/bench/dsv4_identity.py --tiny: the GPU check's own code runs on the CPU, and there every
draft mode and both rollbacks are identical to serial, forced rejections bit for bit."""

from scripts.bench import dsv4_identity


def test_tiny_run_is_identical_everywhere():
    (run,) = dsv4_identity.main(["--tiny"])["runs"]
    assert all(run["identical"].values()) and len(run["identical"]) == 6
    assert run["forced_rejection_max_diff"] == 0.0
    assert sorted(run["window_ms"]) == list(range(1, 9))
