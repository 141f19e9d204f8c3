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
