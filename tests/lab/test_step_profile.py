"""scripts/bench/step_profile.py: ops by kind, time by kind and build against evaluation for a
window, one JSON out; on the CPU the window's linears leave the graph for numpy."""

import json

from scripts.bench.step_profile import main


def test_step_profile_demo_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "profile.json"
    main(["--models", "demo", "--windows", "1,3", "--context", "24", "--repeats", "3", "--warmup", "1",
          "--out", str(out)])
    [model] = json.loads(out.read_text())["models"]
    assert model["model"] == "demo" and [w["T"] for w in model["windows"]] == [1, 3]
    for window in model["windows"]:
        # the demo's window runs whole in numpy, embedding and logits too: no MLX graph to evaluate
        assert window["window_ms"] > 0 and window["ops"] == 0 and window["host_reads"] == 0
        # the eager count with the linears in MLX is larger than what runs (traces, numpy linears)
        assert window["ops_eager"] > window["ops"]
        assert sum(window["ops_by_kind"].values()) == window["ops_eager"]
        assert {"gdn.core", "attn.core", "experts", "lm_head"} <= set(window["ops_by_kind"])
        # the demo's layers run whole on the host (host_layer), their routed experts too
        assert window["ms_by_kind"]["host_layer"] > 0 and window["ms_by_kind"]["host_experts"] > 0
    assert "ops per layer" in capsys.readouterr().out
