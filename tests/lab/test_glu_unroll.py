"""scripts/lab/glu_unroll.py's settings (UNROLL, or UNROLL/COLS) as the command line takes them;
the timings need a GPU, the nvcc counts nvcc."""

import mlx.core as mx
import pytest

from metal_shaders import rows_matvec
from scripts.lab import glu_unroll


def test_settings_are_unroll_or_unroll_and_columns_a_warp():
    assert glu_unroll.parse("4, 2/1,8/4") == [("4", 4, rows_matvec.GLU_COLS), ("2/1", 2, 1), ("8/4", 8, 4)]


@pytest.mark.parametrize("bad", ["0", "4/3", "x", "4/0", "4/-2", "2/1/1"])
def test_bad_settings_are_refused_in_one_line(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        glu_unroll.main(["--settings", bad])
    assert exited.value.code == 2 and "--settings:" in capsys.readouterr().err


def test_good_settings_reach_the_device_check(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # never a GPU run from the suite
    with pytest.raises(SystemExit, match="times a GPU kernel"):
        glu_unroll.main(["--settings", "4/2,4/1"])
    assert (rows_matvec.GLU_UNROLL, rows_matvec.GLU_COLS) == (4, 2)  # the defaults, as the run found them
