"""scripts/bench/kernel_bench.py --dense: GPT-OSS's bfloat16 linears, each R-row call checked
against its rows' 1-row calls and the float32 reference (on the CPU: the reference path)."""

from scripts.bench import kernel_bench


def test_dense_mode_times_gpt_oss_linears_on_the_cpu(tmp_path):
    out = tmp_path / "dense.json"
    result = kernel_bench.main(["--dense", "--small", "--repeats", "1", "--inner", "1", "--cols", "", "--out", str(out)])
    assert result["mode"] == "dense" and result["all_rows_identical"] and out.is_file()
    shapes = {r["shape"] for r in result["records"]}
    assert shapes == set(kernel_bench.SMALL_GPT_OSS_DENSE)
    for r in result["records"]:
        assert r["identical_to_1_row"] and r["max_abs_diff"] < 0.05 and r["ms"]["mlx"] > 0
        assert r["weight_gbs"] > 0
    assert [r["R"] for r in result["records"] if r["shape"] == "gpt_oss_lm_head"] == list(kernel_bench.ROWS)
