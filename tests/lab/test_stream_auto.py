"""scripts/lab/stream_auto.py on two cache sizes, one round: serial and `auto` from the streamed
demo model give the same tokens, and every row carries its figures."""

from scripts.lab import stream_auto


def test_stream_auto_one_round_two_cache_sizes(tmp_path):
    out = tmp_path / "stream_auto.json"
    every = stream_auto.DEMO_EXPERTS
    result = stream_auto.main(["--rounds", "1", "--tokens", "12", "--resident", "2", str(every), "--workloads",
                               "copy_edit", "--out", str(out)])
    assert out.is_file() and result["identical"]
    assert [(r["resident"], r["workload"]) for r in result["rows"]] == [(2, "copy_edit"), (every, "copy_edit")]
    for row in result["rows"]:
        assert row["serial_tokens_per_s"] > 0 and row["auto_tokens_per_s"] > 0 and len(row["pairs"]) == 1
    assert result["lowest_auto_over_serial"] == min(r["auto_over_serial"] for r in result["rows"])
