"""scripts/bench/startup.py on the tiny shape (CPU): it builds the checkpoint, times separate
`strata generate` processes cold (with and without the kernel workers) and later, serial and auto,
splits a later process's first token into phases, probes the shapes, and writes every field
docs/runs/h200_startup.json records."""

import json

from scripts.bench import startup


def test_startup_tiny_writes_every_field(tmp_path):
    out = tmp_path / "startup.json"
    startup.main(["--tiny", "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    data = json.loads(out.read_text())
    assert (tmp_path / "ckpt" / "tiny" / "tokenizer.json").is_file()
    assert data["tree"] and data["model"] and data["skipped"] == []
    for mode in ("serial", "auto"):
        figures = data[mode]
        for key in ("later_run_ttft_s", "steady_tokens_per_s", "max_window_ms_after_first_token", "median_window_ms"):
            assert figures[key] > 0, (mode, key)
    # one cache directory, as on a user's machine: only the first process (serial) finds it empty
    assert data["serial"]["first_run_ttft_s"] > 0 and data["auto"]["first_run_ttft_s"] is None
    assert [(r["phase"], r["mode"], r["parallel_warm"]) for r in data["runs"]] == [
        ("cold", "serial", True), ("later", "serial", True), ("later", "auto", True), ("cold", "serial", False)]
    fresh = data["fresh_machine"]
    assert set(fresh) == {"with_kernel_workers", "without_kernel_workers"}
    assert all(f["ttft_s"] > 0 and f["kernel_workers"] == 0 for f in fresh.values())  # no workers on the CPU
    assert all(f["gpu_memory"] is None and f["worker_estimate_gb"] is None for f in fresh.values())  # no GPU
    for mode in ("serial", "auto"):  # a later process, phase by phase, adds up to its first token
        p = data["later_phases"][mode]
        assert {"import_strata_s", "open_model_s", "prompt_s", "first_window_shape_warm_s", "first_window_s"} <= set(p["phases_s"])
        assert ("calibration_s" in p["phases_s"]) == (mode == "auto") and p["ttft_s"] > 0
        assert abs(p["unaccounted_s"]) < 0.05 + 0.2 * p["ttft_s"], p  # a fast host's first token can take < 0.5 s
    assert all(0 < r["ttft_s"] < r["process_s"] for r in data["runs"])
    assert not any(r["announced_compile"] for r in data["runs"])  # the CPU compiles nothing per machine
    assert data["identical"] and data["fresh_same_as_later"] and data["auto_over_serial_later"] > 0
    assert [list(p["warmup_by_rows_s"]) for p in data["shapes"]] == [
        ["1", "2", "4", "8"], ["1", "2", "4", "8"], [str(T) for T in range(1, 9)]]
    assert all(set(p["kernel_probes_s"]) == {"rows_matvec", "gdn_window", "attention_window"} for p in data["shapes"])


def test_agreement_compares_later_processes_and_says_apart_whether_the_fresh_one_agrees():
    a, b = [1, 2, 3], [1, 5, 6]
    # the H200 run at 318198f: the fresh process chunked its prompt on the window kernels
    assert startup.agreement([("cold", b), ("later", a), ("later", a), ("later", a)]) == {
        "identical": True, "fresh_same_as_later": False}
    assert startup.agreement([("cold", a), ("later", a), ("cold", a)]) == {"identical": True, "fresh_same_as_later": True}
    assert startup.agreement([("cold", a), ("later", a), ("later", b)])["identical"] is False
    assert startup.agreement([("cold", a)]) == {"identical": True, "fresh_same_as_later": None}
    assert startup.agreement([]) == {"identical": True, "fresh_same_as_later": None}
