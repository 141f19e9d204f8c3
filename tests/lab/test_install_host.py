"""scripts/lab/install_host.py on the CPU: both ways of building an install run through the cache,
alternating, and the banks' slots are checked against the store's records by the script."""

from scripts.lab import install_host


def test_both_variants_install_and_are_timed(tmp_path):
    out = tmp_path / "install_host.json"
    report = install_host.main(["--tiny", "--layers", "1", "--rounds", "2", "--slots", "12", "--passes", "3",
                                "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    assert out.is_file() and report["records_per_pass"] == 3 and report["slots"] == 12
    for variant in install_host.VARIANTS:
        assert report["us_per_record"][variant]["host"] > 0 and report["us_per_record"][variant]["eval"] > 0
