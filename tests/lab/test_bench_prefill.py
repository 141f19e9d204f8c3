"""scripts/bench/prefill_bench.py: strata and mlx-lm prefill the same weights, one JSON out."""

import json

import pytest

from scripts.bench.prefill_bench import main


@pytest.mark.parametrize("bits", ["0", "4"])  # 4: mlx-lm's quantize_model, strata's quantized load
def test_prefill_bench_tiny_synthetic(tmp_path, capsys, bits):
    out = tmp_path / "prefill.json"
    result = main(["--synthetic", "tiny", "--tokens", "80", "--layers", "4", "--repeats", "1", "--warmup", "0",
                   "--bits", bits, "--chunk", "48", "--cpu", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["tokens"] == 80 and set(data["sides"]) == {"strata", "mlx-lm"}
    assert all(side["tokens_per_s"] > 0 for side in data["sides"].values())
    assert data["ratio"] == pytest.approx(result["ratio"])
    # One set of weights: mlx-lm's own model and strata's agree on the last logits.
    assert data["last_logits_rel_diff"] < 1e-3 and data["same_argmax"]
    assert "| strata |" in capsys.readouterr().out


def test_prefill_pieces_tiny(tmp_path, capsys):
    from scripts.bench.prefill_pieces import main as pieces_main

    out = tmp_path / "pieces.json"
    table = pieces_main(["--synthetic-tiny", "--rows", "32", "--offset", "8", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == table
    names = [row["piece"] for row in table]
    assert "attn core (L=40)" in names and "moe experts" in names and "gdn scan (chunked / per row)" in names
    assert all(row["strata_ms"] >= 0 for row in table)
    assert all("plain_ms" in row for row in table if row["piece"] in ("moe experts", "attn core (L=40)"))
    assert "| gdn out_proj |" in capsys.readouterr().out


def test_prefill_bench_compares_settings_in_one_run(tmp_path):
    """`--compare blas=mlx` adds a strata side with MLX's own CPU BLAS: timed, and its last logits
    measured against the default side's; the settings in force are recorded and restored."""
    from strata_cli.model import moe
    from strata_cli.model.host_blas import HostBlas

    out = tmp_path / "prefill.json"
    before = (HostBlas.mode, moe.GPU_PROMPT_EXPERTS)
    main(["--synthetic", "tiny", "--tokens", "60", "--layers", "4", "--repeats", "1", "--warmup", "0", "--no-peer",
          "--chunk", "32", "--cpu", "--compare", "blas=mlx", "--compare", "experts=gather", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["sides"]) == {"strata", "strata blas=mlx", "strata experts=gather"}
    assert data["settings"] == {"blas": before[0], "experts": before[1]}
    assert 0 < data["sides"]["strata blas=mlx"]["last_logits_rel_diff_to_strata"] < 1e-4  # other sums: it ran
    assert (HostBlas.mode, moe.GPU_PROMPT_EXPERTS) == before


@pytest.mark.parametrize("bad", ["blas=fast", "experts=dequantize", "threads=2", "blas"])
def test_prefill_bench_rejects_unknown_settings(bad, capsys):
    with pytest.raises(SystemExit):
        main(["--synthetic", "tiny", "--compare", bad])
    assert "blas=auto|numpy|mlx; experts=padded|gather" in capsys.readouterr().err


def test_prefill_pieces_rejects_unknown_expert_forms(capsys):
    from scripts.bench.prefill_pieces import main as pieces_main

    with pytest.raises(SystemExit):
        pieces_main(["--synthetic-tiny", "--expert-forms", "padded,dequantize"])
    assert "--expert-forms takes padded, gather" in capsys.readouterr().err
