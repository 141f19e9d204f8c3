"""scripts/lab/ncu_window.py's reading of ncu's CSV: launches in ID order with their metrics in
µs and bytes, windows split at the markers, medians over windows, the change between Ts."""

import csv
import io
import sys
import time

import pytest

from scripts.lab import ncu_window as nw

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Section Name",
          "Metric Name", "Metric Unit", "Metric Value"]


def report(launches: list[tuple[str, dict[str, tuple[str, str]]]]) -> str:
    """ncu's details page for these launches (name, {metric: (unit, value)}), after its banner."""
    out = io.StringIO()
    out.write("==PROF== Disconnected from process 1\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(HEADER)
    for i, (name, metrics) in enumerate(launches):
        for metric, (unit, value) in metrics.items():
            writer.writerow([i, 1, "python", "h", name, 1, 7, "Command line profiler metrics", metric, unit, value])
    return out.getvalue()


def timed(us: float, unit: str = "nsecond") -> dict:
    value = us * {"nsecond": 1e3, "usecond": 1.0, "msecond": 1e-3}[unit]
    return {"gpu__time_duration.sum": (unit, f"{value:,.3f}"),
            "launch__registers_per_thread": ("register/thread", "64")}


def windows_csv(per_T: dict[int, list[list[tuple[str, float]]]]) -> tuple[str, list[int]]:
    launches, order = [], []
    for T, windows in per_T.items():
        for window in windows:
            launches.append((nw.MARK, timed(1.0)))
            order.append(T)
            launches += [(name, timed(us)) for name, us in window]
    return report(launches), order


def test_short_name_drops_types_templates_and_parameters():
    assert nw.short_name("void mlx::core::cu::(anonymous namespace)::gemv<bf16, 8>(const float *, int)") == \
        "mlx::core::cu::gemv"
    assert nw.short_name("strata_rows_gather_qmatvec_v4") == "strata_rows_gather_qmatvec_v4"


def test_launches_scale_units_and_keep_id_order():
    text = report([("b", timed(1500.0)), ("a", timed(2.5, "usecond")),
                   ("c", {"dram__bytes_read.sum": ("Mbyte", "1.5"), "gpu__time_duration.sum": ("msecond", "0.01")})])
    found = nw.launches(text)
    assert [f["kernel"] for f in found] == ["b", "a", "c"]
    assert found[0]["gpu__time_duration.sum"] == pytest.approx(1500.0)  # "1,500,000.000" ns
    assert found[1]["gpu__time_duration.sum"] == pytest.approx(2.5)
    assert found[2]["dram__bytes_read.sum"] == pytest.approx(1.5e6)
    assert found[2]["gpu__time_duration.sum"] == pytest.approx(10.0)


def test_the_short_units_ncu_2025_writes_and_no_unknown_one():
    """The H100 loan's ncu wrote "ns" (its report was read as µs, 1000x too long, until this)."""
    found = nw.launches(report([("a", {"gpu__time_duration.sum": ("ns", "5,056"),
                                       "launch__occupancy_limit_registers": ("block", "64")})]))
    assert found[0]["gpu__time_duration.sum"] == pytest.approx(5.056)
    assert found[0]["launch__occupancy_limit_registers"] == 64
    with pytest.raises(ValueError, match="unknown metric unit 'fortnight'"):
        nw.launches(report([("a", {"gpu__time_duration.sum": ("fortnight", "1")})]))


def test_a_keep_folder_is_read_again_detail_and_all(tmp_path, capsys):
    import json

    text, order = windows_csv({1: [[("gemv", 10.0)]], 8: [[("gemv", 12.0)]]})
    record = {"order": order, "window_ms": {"1": 0.5, "8": 0.6}, "model": "m"}
    (tmp_path / "time.csv").write_text(text)
    (tmp_path / "time.json").write_text(json.dumps(record))
    out = nw.main(["--parse", str(tmp_path)])
    assert out["T"]["8"]["busy_us"] == pytest.approx(12.0) and "detail_mismatch" not in out["T"]["1"]
    detail = report([(nw.MARK, {"dram__bytes_read.sum": ("byte", "1")}), ("gemv", {"dram__bytes_read.sum": ("byte", "7")}),
                     (nw.MARK, {"dram__bytes_read.sum": ("byte", "1")}), ("gemv", {"dram__bytes_read.sum": ("byte", "9")})])
    (tmp_path / "detail.csv").write_text(detail)
    (tmp_path / "detail.json").write_text(json.dumps(record))
    out = nw.main(["--parse", str(tmp_path)])
    assert out["T"]["8"]["by_name"]["gemv"]["dram_bytes"] == 9.0
    (tmp_path / "time.csv").unlink()
    with pytest.raises(SystemExit, match="holds no time.csv"):
        nw.main(["--parse", str(tmp_path)])


def test_a_detail_of_some_kernels_joins_each_name_launch_by_launch():
    """The detail profiles strata's kernels only (DETAIL_KERNELS): a name's i-th launch takes the
    detail's i-th of that name, names it left out keep their times alone, and a name launched a
    different number of times in the two runs marks the T's detail as mismatched."""
    bytes_ = {"dram__bytes_read.sum": ("byte", "0")}
    text, order = windows_csv({1: [[("strata_a", 10.0), ("mlx_copy", 2.0), ("strata_a", 11.0)]]})
    found = nw.windows_of(nw.launches(text), order)
    summary = nw.summarize(found[1])
    detail = report([(nw.MARK, bytes_), ("strata_a", {"dram__bytes_read.sum": ("byte", "5")}),
                     ("strata_a", {"dram__bytes_read.sum": ("byte", "7")})])
    nw.merge_detail(summary, nw.summarize(nw.windows_of(nw.launches(detail), order)[1]))
    assert [k.get("dram__bytes_read.sum") for k in summary["kernels"]] == [5.0, None, 7.0]
    assert summary["by_name"]["strata_a"]["dram_bytes"] == 12.0 and summary["by_name"]["mlx_copy"]["dram_bytes"] == 0
    assert "detail_mismatch" not in summary
    once = report([(nw.MARK, bytes_), ("strata_a", {"dram__bytes_read.sum": ("byte", "5")})])
    nw.merge_detail(summary, nw.summarize(nw.windows_of(nw.launches(once), order)[1]))
    assert summary["detail_mismatch"] is True


def test_windows_medians_sums_and_deltas():
    text, order = windows_csv({
        1: [[("gemv", 10.0), ("down", 20.0)], [("gemv", 12.0), ("down", 22.0)], [("gemv", 11.0), ("down", 90.0)]],
        8: [[("gemv", 10.0), ("down", 60.0), ("down", 5.0)], [("gemv", 14.0), ("down", 62.0), ("down", 5.0)]],
    })
    report_ = nw.build_report(text, {"order": order, "window_ms": {"1": 0.5, "8": 0.9}})
    one, eight = report_["T"]["1"], report_["T"]["8"]
    assert [k["gpu__time_duration.sum"] for k in one["kernels"]] == pytest.approx([11.0, 22.0])  # medians
    assert one["busy_us"] == pytest.approx(33.0)
    assert eight["by_name"]["down"] == {"launches": 2, "us": pytest.approx(66.0), "dram_bytes": 0.0}
    assert [(d["kernel"], d["delta_us"]) for d in report_["deltas"]] == [("down", pytest.approx(44.0)),
                                                                           ("gemv", pytest.approx(1.0))]
    assert "T = 8 less T = 1" in nw.render(report_)


def test_markers_must_match_the_child_record():
    text, order = windows_csv({1: [[("gemv", 1.0)]], 8: [[("gemv", 2.0)]]})
    with pytest.raises(ValueError, match="markers"):
        nw.build_report(text, {"order": order + [8], "window_ms": {}})
    with pytest.raises(ValueError, match="more markers"):
        nw.build_report(text, {"order": order[:1], "window_ms": {}})


def test_windows_of_a_different_length_are_left_out_of_the_medians():
    text, order = windows_csv({1: [[("a", 1.0)], [("a", 3.0)], [("a", 2.0), ("late", 9.0)]]})
    summary = nw.build_report(text, {"order": order, "window_ms": {}})["T"]["1"]
    assert summary["windows_alike"] == 2 and summary["launch_counts"] == [1, 2]
    assert [k["kernel"] for k in summary["kernels"]] == ["a"]
    assert summary["busy_us"] == pytest.approx(2.0)


@pytest.mark.parametrize("bad", ["100", "-32"])
def test_split_cells_are_zero_or_whole_chunks(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        nw.main(["--split-cells", bad, "--parse", "unused"])
    assert exited.value.code == 2 and "--split-cells takes 0 or a positive multiple of 32" in capsys.readouterr().err


def test_the_detail_replays_the_application_and_the_times_replay_nothing(tmp_path):
    detail = nw.profile_command("ncu", nw.DETAIL_METRICS, ["--windows", "1"], tmp_path / "d", tmp_path / "d.json",
                                "all", nw.DETAIL_KERNELS, nw.DETAIL_REPLAY)
    assert detail[detail.index("--replay-mode") + 1] == "application"
    assert detail[detail.index("--kernel-name") + 1] == "regex:strata_"
    assert detail[detail.index("--cache-control") + 1] == "all"
    timed_ = nw.profile_command("ncu", nw.TIME_METRICS, [], tmp_path / "t", tmp_path / "t.json")
    assert "--kernel-name" not in timed_ and timed_[timed_.index("--replay-mode") + 1] == "kernel"
    assert timed_[timed_.index("--child") + 1] == str(tmp_path / "t.json")


def test_a_run_past_its_time_is_stopped_with_what_it_started(tmp_path):
    marker = tmp_path / "grandchild"
    late = tmp_path / "late.py"  # would write the marker 3 s after it starts
    late.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w')\n")
    parent = tmp_path / "parent.py"  # starts it, then outlives the timeout
    parent.write_text(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(late)!r}])\n"
                      "time.sleep(30)\n")
    cmd = [sys.executable, str(parent)]
    start = time.monotonic()
    with pytest.raises(SystemExit, match="passed its 1 s and was stopped"):
        nw.run_bounded(cmd, 1.0)
    assert time.monotonic() - start < 10
    time.sleep(3.5)
    assert not marker.exists()
    assert nw.run_bounded([sys.executable, "-c", "print('ok')"], 10).stdout == "ok\n"


@pytest.mark.parametrize("flag", ["--glu-cols=3", "--glu-cols=0", "--split-cells=100"])
def test_study_settings_are_checked_before_ncu_is_looked_for(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        nw.main([flag])
    assert exited.value.code == 2 and flag.split("=")[0] in capsys.readouterr().err
