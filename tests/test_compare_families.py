"""scripts/bench/compare_mlx_lm.py's real-model shapes: each family's config is one mlx-lm's model
args and strata's loader both read, at the published dimensions (the H200 run builds from them)."""

import importlib

import pytest
from mlx.utils import tree_flatten

from scripts.bench import compare_mlx_lm as compare
from strata_cli.model.gpt_oss import GptOssConfig
from strata_cli.model.nemotron_h import NemotronHConfig
from strata_cli.model.qwen3_5 import Config as Qwen3_5Config


def test_nemotron_pattern_is_the_published_mix_and_8_layers_keep_it():
    pattern = compare.NEMOTRON_3_NANO_PATTERN
    assert (len(pattern), pattern.count("M"), pattern.count("E"), pattern.count("*")) == (52, 23, 23, 6)
    config = compare.family_config("nemotron_h", layers=8, tiny=False)
    assert config["hybrid_override_pattern"] == "MEMEM*EM"  # 4 Mamba-2, 3 MoE, 1 attention


@pytest.mark.parametrize("family", ["qwen3_5_moe", "nemotron_h", "gpt_oss"])
@pytest.mark.parametrize("tiny", [False, True], ids=["real", "tiny"])
def test_both_engines_read_the_family_config(family, tiny):
    config = compare.family_config(family, layers=8 if not tiny else compare.TINY_LAYERS[family], tiny=tiny)
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    args = arch.ModelArgs.from_dict(config)
    model = arch.Model(args)  # lazy: nothing is drawn until evaluated
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}
    if family == "nemotron_h":
        ours = NemotronHConfig.from_dict(config)
        assert ours.layer_types == tuple(config["hybrid_override_pattern"])
        if not tiny:
            assert (ours.hidden_size, ours.mamba_num_heads, ours.mamba_head_dim, ours.ssm_state_size, ours.n_groups,
                    ours.n_routed_experts, ours.num_experts_per_tok) == (2688, 64, 64, 128, 8, 128, 6)
            assert args.moe_shared_expert_intermediate_size == 3712
            assert shapes["backbone.layers.1.mixer.switch_mlp.fc1.weight"] == (128, 1856, 2688)
            assert shapes["backbone.layers.0.mixer.in_proj.weight"] == (4096 + 6144 + 64, 2688)
    elif family == "gpt_oss":
        ours = GptOssConfig.from_dict(config)
        assert ours.layer_types == tuple(["sliding_attention", "full_attention"] * 4)[: config["num_hidden_layers"]]
        if not tiny:
            assert (ours.hidden_size, ours.num_local_experts, ours.num_experts_per_tok, ours.sliding_window,
                    ours.vocab_size) == (2880, 32, 4, 128, 201088)
            assert shapes["model.layers.0.mlp.experts.gate_proj.weight"] == (32, 2880, 2880)
            assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    else:
        ours = Qwen3_5Config.from_dict(config)
        assert ours.num_hidden_layers == config["text_config"]["num_hidden_layers"]
        if not tiny:
            assert (ours.hidden_size, ours.num_experts, ours.num_experts_per_tok, ours.vocab_size) == (2048, 256, 8, 248320)
            assert args.text_config["linear_num_value_heads"] == 32
            assert shapes["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"] == (256, 512, 2048)
            assert shapes["language_model.lm_head.weight"] == (248320, 2048)
            assert sum(".self_attn." in name for name in shapes) and sum(".linear_attn." in name for name in shapes)


def test_prefill_repeats_zero_skips_the_prefill(tmp_path):
    """The GPU plan runs `--prefill-repeats 0` to save device time: the prefill is skipped, not a
    median of no runs (which ended an H200 run before its identity check)."""
    out = tmp_path / "compare.json"
    compare.main(["--tiny", "--family", "gpt_oss", "--repeats", "1", "--window-repeats", "1", "--tokens", "6",
                  "--identity-dtypes", "float32", "--prefill-repeats", "0", "--dir", str(tmp_path), "--out", str(out)])
    import json

    family = json.loads(out.read_text())["families"]["gpt_oss"]
    assert "prefill" not in family and family["identity"]


def test_window_rounds_take_each_ts_median_over_the_rounds(tmp_path):
    """`--window-rounds 3`: three rounds of both engines' window costs, each T the rounds' median."""
    import json
    import statistics

    out = tmp_path / "compare.json"
    compare.main(["--tiny", "--family", "gpt_oss", "--repeats", "1", "--tokens", "6", "--window-rounds", "3",
                  "--identity-dtypes", "float32", "--prefill-repeats", "0", "--dir", str(tmp_path), "--out", str(out)])
    windows = json.loads(out.read_text())["families"]["gpt_oss"]["window_cost"]
    for side in ("strata_ms", "mlx_lm_ms"):
        rounds = windows[f"{side}_rounds"]
        assert len(rounds) == 3 and sorted(windows[side]) == sorted(str(T) for T in range(1, 9))
        assert all(windows[side][T] == statistics.median(r[T] for r in rounds) for T in windows[side])
