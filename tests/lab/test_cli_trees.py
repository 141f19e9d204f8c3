"""scripts/lab/cli_trees.py: two trees' `strata generate` processes taking turns, a case's
figure and tokens from each (here the same code under two paths, so the tokens agree)."""

from pathlib import Path

from scripts.lab import cli_trees

ROOT = Path(__file__).resolve().parents[2]


def test_two_trees_take_turns_on_a_case(tmp_path):
    other = tmp_path / "tree"
    other.symlink_to(ROOT)
    result = cli_trees.main([str(ROOT), str(other), "--rounds", "2", "--only", "prefill", "--prompt-words", "60",
                             "--out", str(tmp_path / "out.json")])
    case = result["cases"]["prefill"]
    assert set(case["runs"]) == {str(ROOT), str(other)}
    assert all(len(v) == 2 and min(v) > 0 for v in case["runs"].values())
    assert case["same_tokens"] and case["over_base"][str(ROOT)] == 1.0
    assert (tmp_path / "out.json").is_file()
