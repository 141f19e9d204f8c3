"""`strata selftest`: identity of drafts against serial decoding on this backend, and its exit status."""

import json

from click.testing import CliRunner

from strata_cli.bench import selftest as selftest_module
from strata_cli.cli import cli


def test_selftest_reports_identity_and_window_costs():
    result = CliRunner().invoke(cli, ["selftest", "-n", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["backend"].startswith("Device(cpu")
    assert report["gdn_kernels"] == {"usable": False, "probed": True, "error": None}  # the CPU runs the GDN window as MLX ops
    assert report["attention_kernel"] == {"usable": False, "probed": True, "error": None}
    assert {(r["mode"], r["dtype"]) for r in report["results"]} == {("3", "float32"), ("auto", "float32")}
    assert len(report["results"]) == 2 * len(selftest_module.PROMPTS)
    assert all(r["tokens"] == 6 for r in report["results"])  # end-of-text never cuts a comparison short
    assert sorted(report["window_ms"]["float32"], key=int) == [str(T) for T in range(1, 9)]
    assert all(ms > 0 for ms in report["window_ms"]["float32"].values())


def test_selftest_exits_1_on_a_difference(monkeypatch):
    real = selftest_module._tokens

    def broken(engine, ids, max_tokens, spec):
        tokens = real(engine, ids, max_tokens, spec)
        return tokens[:-1] + [(tokens[-1] + 1) % engine.vocab_size] if spec.max_drafts else tokens

    monkeypatch.setattr(selftest_module, "_tokens", broken)
    result = CliRunner().invoke(cli, ["selftest", "-n", "4"])
    assert result.exit_code == 1 and "differ from serial decoding" in result.output
    assert "DIFFERS at token 3" in result.output
