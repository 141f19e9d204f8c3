"""scripts/lab/layer_dispatch.py runs on the CPU (the MLX path) and reports every setting and T."""

from scripts.lab import layer_dispatch
from strata_cli.model.dispatch import LayerDispatch
from strata_cli.model.layers import CpuShortCalls


def test_the_lab_script_reports_each_setting(tmp_path, monkeypatch):
    for cls, name in ((CpuShortCalls, "mode"), (LayerDispatch, "mode"), (LayerDispatch, "pieces")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # the script sets them: restored after
    report = layer_dispatch.main(["--pieces", "0", "4", "--windows", "1", "2", "--rounds", "2", "--repeats", "2",
                                  "--layers", "2", "--dir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert set(report["median_ms"]) == {f"pieces={p} T={T}" for p in (0, 4) for T in (1, 2)}
    assert all(len(v) == 2 and min(v) > 0 for v in report["window_ms"].values()) and report["path"] == "mlx (CPU)"
