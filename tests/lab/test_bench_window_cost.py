"""scripts/bench/window_cost.py on tiny shapes (CPU): it measures T = 1..8 and the controller reads it."""

import json

import pytest

from scripts.bench import window_cost
from strata_cli.speculative.controller import CostPrior, DraftController


@pytest.mark.parametrize("bits", [0, 4])
def test_window_cost_tiny_writes_a_curve_the_controller_reads(tmp_path, capsys, bits):
    out = tmp_path / "wc.json"
    result = window_cost.main(["--tiny", "--bits", str(bits), "--group-size", "32", "--repeats", "2",
                                 "--warmup", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [row["T"] for row in data["curve"]] == list(range(1, 9))
    assert all(row["median_s"] > 0 for row in data["curve"]) and data["curve"][0]["relative"] == 1.0
    assert data["bits"] == (bits or None) and data["layers"].count("full_attention") == 1
    assert "| 8 |" in capsys.readouterr().out
    prior = CostPrior.from_json(out)
    assert prior.seconds_per_row == pytest.approx(result["curve"][0]["median_s"])
    assert DraftController(7, cost_prior=prior).window_cost(8) == pytest.approx(result["curve"][7]["median_s"])


def test_full_shape_config_is_the_80b_a3b_layer():
    module = window_cost
    args = module.parse_args([])
    assert (args.bits, args.dtype, args.context, args.layers) == (4, "bfloat16", 1024, 4)
    from strata_cli.model import qwen3_next

    config = qwen3_next.Config.from_dict({**module.QWEN3_NEXT_80B_A3B, "num_hidden_layers": 4})
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (512, 10, 512)
    assert module.uniform_union(512, 10, 4) == pytest.approx(38.8, abs=0.1)
