"""`strata selftest` as a person reads it: a heading that never wraps, and a verdict at the end."""

from click.testing import CliRunner

from strata_cli.cli import cli


def test_selftest_ends_with_a_verdict_and_its_headings_are_single_lines():
    result = CliRunner().invoke(cli, ["selftest", "-n", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("strata selftest on ")
    assert "window of T rows, ms (median)" in lines
    assert lines[-1].startswith("selftest passed: all ") and "identical to serial decoding" in lines[-1]
    header = next(line for line in lines if "dtype" in line and "result" in line)
    assert header.split("┃")[1].strip() == "model"  # the table's first column
    rows = [line for line in lines if "identical" in line and "passed" not in line]
    assert sum("mamba2-hybrid" in row for row in rows) == 6 and sum("demo" in row for row in rows) == 8
    assert lines[-1].startswith(f"selftest passed: all {len(rows)} runs ")


def test_selftest_kernels_reports_every_family_without_decoding():
    import json

    from strata_cli.bench import selftest

    result = CliRunner().invoke(cli, ["selftest", "--kernels", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["kernels"]) == [key for key, _, _ in selftest.KERNEL_PROBES] and report["passed"]
    assert all(entry["usable_by_dtype"] == {"float32": False} and entry["error"] is None
               for entry in report["kernels"].values())  # the CPU runs no GPU kernel
    table = CliRunner().invoke(cli, ["selftest", "--kernels"])
    assert table.exit_code == 0 and "combine_kernel" in table.stdout and "identical" not in table.stdout


def test_selftest_kernels_exits_1_naming_a_family_whose_probe_failed(monkeypatch, failing_metal):
    from metal_shaders import moe_combine
    from strata_cli.bench import selftest

    failing_metal(moe_combine, "MoE combine kernel")
    passing = ("add_norm_kernel", lambda dtype=None: True, lambda: {"usable": True, "probed": True, "error": None})
    monkeypatch.setattr(selftest, "KERNEL_PROBES", (passing, ("combine_kernel", moe_combine.usable, moe_combine.status)))
    result = CliRunner().invoke(cli, ["selftest", "--kernels", "--dtype", "float32"])
    assert result.exit_code == 1
    assert "add_norm_kernel" in result.stdout and "moe_combine differs from the reference" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: selftest: kernel probes failed on Device(cpu, 0): combine_kernel (these run MLX's ops instead: "
        "lossless, slower)")
