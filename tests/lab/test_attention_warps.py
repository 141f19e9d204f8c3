"""scripts/lab/attention_warps.py's settings (warps a block, cells a split) as the command line
takes them; the timings need a GPU."""

import pytest

from metal_shaders import attention_window
from scripts.lab import attention_warps


@pytest.mark.parametrize("bad", ["100", "0", "off,abc", "-32"])
def test_split_cells_are_multiples_of_32_or_off(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        attention_warps.main(["--split-cells", bad])
    assert exited.value.code == 2 and "--split-cells takes multiples of 32 and off" in capsys.readouterr().err


def test_good_settings_reach_the_device_check_and_leave_the_defaults(monkeypatch):
    monkeypatch.setattr(attention_window, "usable", lambda dtype=None: False)
    with pytest.raises(SystemExit, match="the kernel does not run here"):
        attention_warps.main(["--warps", "8,16", "--split-cells", "off,1024,256"])
    assert (attention_window.WARPS, attention_window.SPLIT_CELLS) == (8, 1024)  # the defaults, as the run found them
