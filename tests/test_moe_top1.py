"""Top-1 routing (`num_experts_per_tok: 1`, Switch-style) decodes: MLX 0.32.4 crashes the process
on a shapeless-compiled sum over a length-1 axis (docs/mlx-bugs.md), so `weighted_sum` takes the
one pick without a reduction. Each check runs in a subprocess: the crash kills the interpreter."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from strata_cli.runtime import embedded_model_path

ROOT = Path(__file__).resolve().parents[1]

# Decodes a tiny random k = 1 model serially and with drafts, and compares every window's logits
# with an uncompiled reference (no layer traces, the weighted sum as the plain expression).
DECODE = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    import numpy as np
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.decode import generate
    from strata_cli.engine.window import WindowEngine
    from strata_cli.model import moe
    from strata_cli.model.compiled import LayerCompile
    from strata_cli.model.quant import quantize
    from strata_cli.options import GenerateOptions, SpecOptions
    from strata_cli.telemetry import DecodeStats

    kind = sys.argv[1]
    model = random_model(tiny_qwen3_next_config(num_experts_per_tok=1), seed=3,
                         dtype=mx.bfloat16 if kind == "bfloat16" else mx.float32)
    if kind == "4-bit":
        quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    prompt = [5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42, 8, 5, 17]  # 22 rows: a prompt chunk

    def decode(drafts):
        stats = DecodeStats()
        steps = generate(WindowEngine(model), prompt, options=GenerateOptions(max_tokens=24),
                         spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats)
        return [t for step in steps for t in step.tokens], stats.summary()["drafts_offered"]

    def window_logits(tokens, sizes):
        engine = WindowEngine(model)
        engine.prefill(tokens[:9])
        pos, out = 9, []
        for T in sizes:
            out.append(np.array(engine.run(tokens[pos:pos + T], pos).logits.astype(mx.float32)))
            engine.commit(T)
            pos += T
        return out

    serial, _ = decode(0)
    speculative, offered = decode(3)
    sizes = [1, 3, 8, 1, 5, 1, 8, 2]  # each size twice or more: the second call replays a trace
    tokens = (prompt + serial) * 2
    compiled = window_logits(tokens, sizes)
    LayerCompile.mode = "never"
    moe.weighted_sum = lambda picks, weights: (picks * weights[..., None].astype(picks.dtype)).sum(axis=-2)
    reference = window_logits(tokens, sizes)
    reference_serial, _ = decode(0)
    print(json.dumps(dict(
        serial=serial, speculative=speculative, offered=offered, reference_serial=reference_serial,
        identical=all(np.array_equal(a, b) for a, b in zip(compiled, reference)),
        max_diff=max(float(np.abs(a - b).max()) for a, b in zip(compiled, reference)),
    )))
""")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=False)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "4-bit"])
def test_top1_decodes_identically_with_drafts_and_matches_the_uncompiled_reference(kind):
    proc = run_python(DECODE, kind)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.splitlines()[-1])
    assert len(out["serial"]) == 24
    assert out["speculative"] == out["serial"]
    assert out["offered"] > 0  # windows of T > 1 really ran
    assert out["identical"], f"max |compiled - reference| = {out['max_diff']}"
    assert out["serial"] == out["reference_serial"]


def test_weighted_sum_of_one_pick_is_the_weighted_pick():
    code = textwrap.dedent("""
        import mlx.core as mx, numpy as np
        from strata_cli.model.moe import weighted_sum
        for dtype in (mx.float32, mx.bfloat16, mx.float16):
            for N in (1, 5, 8, 40, 5):
                for k in (1, 2, 3):
                    picks = mx.random.normal((N, k, 8), key=mx.random.key(N * k)).astype(dtype)
                    weights = mx.softmax(mx.random.normal((N, k), key=mx.random.key(k)), axis=-1)
                    want = (picks * weights[..., None].astype(dtype)).sum(axis=1)
                    got = weighted_sum(picks, weights)
                    assert got.shape == (N, 8) and got.dtype == dtype, (got.shape, got.dtype)
                    same = np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
                    assert same, (dtype, N, k)
        print("ok")
    """)
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", f"rc {proc.returncode}: {proc.stderr[-2000:]}"


def test_the_demo_with_top1_routing_generates(tmp_path):
    """The issue's repro: the demo model with `num_experts_per_tok` set to 1 (checksums.json covers
    the weight files only, so the edit keeps them verified)."""
    copy = tmp_path / "demo-top1"
    shutil.copytree(embedded_model_path(), copy)
    config = json.loads((copy / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (copy / "config.json").write_text(json.dumps(config))
    outputs = []
    for drafts in ("0", "3", "auto"):
        proc = subprocess.run(
            [sys.executable, "-m", "strata_cli.cli", "generate", "--model", str(copy), "def f(x):",
             "--max-tokens", "12", "--suffix-draft", drafts, "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
        )
        assert proc.returncode == 0, f"--suffix-draft {drafts}: rc {proc.returncode}: {proc.stderr[-2000:]}"
        outputs.append(json.loads(proc.stdout))
    assert outputs[0]["token_ids"] and outputs[0]["weights"] == "verified", outputs[0]
    assert all(out["token_ids"] == outputs[0]["token_ids"] for out in outputs), outputs
