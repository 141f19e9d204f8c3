"""scripts/bench/family_identity.py: the command the lead runs on a GPU, here on the CPU, where every
window row must equal serial decoding's bit for bit."""

import json

import pytest

from scripts.bench import family_identity


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
def test_every_window_row_is_the_serial_row(tmp_path, family):
    out = tmp_path / "result.json"
    result = family_identity.main(["--family", family, "--dir", str(tmp_path), "--tokens", "24", "--out", str(out)])
    assert result["rows_checked"] == 4 * sum(T + 1 for T in range(2, 9) for _ in range(T))
    assert result["rows_bit_identical"] == result["rows_checked"] and result["max_row_diff"] == 0.0
    assert result["greedy_identical"] and json.loads(out.read_text())["family"] == family
