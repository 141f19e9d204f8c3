"""Streamed experts are exact: with the expert cache at 10%, 50% and 100% of the experts, every
window's logits are bit-identical to the fully loaded model's, serial and speculative, and
`decode.generate` emits the same tokens (float32, CPU).

The checkpoint is a small synthetic Qwen3-Next (32 experts, top-4), written in strata's format and
converted with `strata convert --stream`; 10% is 3 slots, below top-k, so every window is served in
several passes.
"""

import mlx.core as mx
import numpy as np
import pytest
from stream_checkpoints import NUM_EXPERTS, build_pair

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.options import (
    EngineOptions,
    GenerateOptions,
    SpecOptions,
    StreamOptions,
)
from strata_cli.runtime import load_checkpoint
from strata_cli.telemetry import DecodeStats


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("stream"))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_model(checkpoints[0])


def token_stream(seed: int, n: int) -> list[int]:
    """Ids with repeats (so drafts from the sequence itself are sometimes right)."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, 96, 6).tolist()
    return (motif + rng.integers(0, 96, 3).tolist()) * (n // 9 + 1)


def run_windows(engine: WindowEngine, tokens: list[int], widths: list[int], prefill: int) -> list[mx.array]:
    """Prefill, then windows of the given widths whose drafts are the stream's next tokens; each
    commits what greedy acceptance keeps. Returns every window's logits."""
    engine.reset()
    engine.prefill(tokens[:prefill])
    pos, logits = prefill, []
    for T in widths:
        window = tokens[pos : pos + T]
        out = engine.run(window, pos)
        keep = 1
        while keep < T and out.tokens[keep - 1] == window[keep]:
            keep += 1
        engine.commit(keep)
        logits.append(out.logits)
        pos += keep
    return logits


@pytest.mark.parametrize("fraction", [0.10, 0.50, 1.00])
@pytest.mark.parametrize("mode", ["serial", "speculative"])
def test_logits_bit_identical(checkpoints, reference, fraction, mode):
    slots = max(1, round(NUM_EXPERTS * fraction))
    streamed = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=slots))
    assert streamed.expert_cache.num_slots == slots
    tokens = token_stream(seed=7, n=80)
    widths = [1] * 12 if mode == "serial" else [4, 2, 3, 1, 4, 4, 2, 3, 4, 1]
    for fold in ("lazy", "eager"):
        options = EngineOptions(fold=fold)
        want = run_windows(WindowEngine(reference, options), tokens, widths, prefill=20)
        got = run_windows(WindowEngine(streamed, options), tokens, widths, prefill=20)
        for n, (a, b) in enumerate(zip(want, got)):
            assert a.shape == b.shape
            assert mx.abs(a - b).max().item() == 0.0, f"window {n} ({fold}) differs at {fraction:.0%}"
    stats = streamed.expert_cache.last_window
    if fraction < 1:
        assert stats.misses + stats.prefetch_hits > 0 or stats.hits > 0
    streamed.expert_cache.close()


@pytest.mark.parametrize(
    "stream",
    [
        StreamOptions(resident_experts=3),
        StreamOptions(resident_experts=16, prefetch="history"),
        StreamOptions(resident_experts=16, prefetch="router", root_prefetch=True),
        StreamOptions(resident_experts=32, prefetch="off", io="buffered"),
        StreamOptions(resident_experts=8, readahead_depth=1, io_threads=2),
        StreamOptions(resident_experts=8, readahead_min_prob=0.1),
    ],
    ids=["10%-router", "50%-history", "50%-root-prefetch", "100%-off-buffered", "25%-demand-first",
         "25%-confident-readahead"],
)
def test_generate_tokens_identical(checkpoints, reference, stream):
    streamed = load_checkpoint(checkpoints[1], stream=stream)
    prompts = [token_stream(seed, 30) for seed in (1, 2)]

    def decode(model, prompt, drafts):
        out, stats = [], DecodeStats()
        for step in generate(WindowEngine(model), prompt, options=GenerateOptions(max_tokens=24),
                             spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats):
            out += step.tokens
        return out, stats.summary()

    offered = 0
    for prompt in prompts:
        want, _ = decode(reference, prompt, 0)
        for drafts in (0, 3):
            got, summary = decode(streamed, prompt, drafts)
            assert got == want, f"{stream}: tokens differ with --suffix-draft {drafts}"
            assert summary["experts"] is not None
            offered += summary["drafts_offered"]
    assert offered > 0  # speculative windows really ran
    streamed.expert_cache.close()


def test_quantized_experts_bit_identical(tmp_path):
    """4-bit experts (gather_qmm over the slot banks) at 10%: identical to the resident 4-bit model."""
    full, streamed_path = build_pair(tmp_path, bits=4, group_size=32, hidden_size=64, moe_intermediate_size=32)
    reference = load_model(full)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    block = streamed.expert_cache.store.blocks["model.layers.0.mlp.switch_mlp"]
    assert block.quantization["gate_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert {t.name for t in block.tensors} >= {"down_proj.weight", "down_proj.scales", "down_proj.biases"}
    tokens = token_stream(seed=5, n=60)
    widths = [1, 4, 2, 1, 3, 4, 1]
    want = run_windows(WindowEngine(reference), tokens, widths, prefill=16)
    got = run_windows(WindowEngine(streamed), tokens, widths, prefill=16)
    for a, b in zip(want, got):
        assert mx.abs(a - b).max().item() == 0.0
    streamed.expert_cache.close()


def test_window_passes_keep_the_window_form(checkpoints, monkeypatch):
    """A decode window served in several passes (12 of 32 slots, top-4, 8 rows) multiplies every pass
    pick by pick, as the resident window does, however many picks a pass holds: never the
    prompt's sorted form, whose kernels on a GPU give other bits than the window's (issue 38's
    H200 run: drafts at a 5% cache left serial's tokens)."""
    from strata_cli.experts.switch import StreamedSwitchGLU
    from strata_cli.model.host_blas import HostBlas

    # The MLX form a GPU runs: on the CPU, short calls' experts take numpy (model/host_experts.py).
    monkeypatch.setattr(HostBlas, "windows", False)
    calls = []
    matmul_of = StreamedSwitchGLU._matmul

    def recording(self, banks):
        inner = matmul_of(self, banks)

        def matmul(name, xs, slots, is_sorted):
            calls.append((xs.shape[0], is_sorted))
            return inner(name, xs, slots, is_sorted)

        return matmul

    monkeypatch.setattr(StreamedSwitchGLU, "_matmul", recording)
    streamed = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=12))
    engine = WindowEngine(streamed)
    tokens = token_stream(seed=3, n=40)
    engine.prefill(tokens[:20])
    calls.clear()
    for pos in (20, 21, 22):
        engine.run(tokens[pos : pos + 8], pos)
        engine.commit(1)
    assert calls and not any(is_sorted for _, is_sorted in calls)
    assert max(rows for rows, _ in calls) > 8  # passes larger than a window's row count ran
    streamed.expert_cache.close()


@pytest.mark.parametrize("fraction", [0.10, 1.00])
def test_preloaded_experts_decode_as_the_full_model_and_a_full_cache_reads_no_more(checkpoints, reference, fraction):
    slots = max(1, round(NUM_EXPERTS * fraction))
    streamed = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=slots))
    cache = streamed.expert_cache
    blocks, seen = len(cache.paths), []
    assert cache.preload(progress=lambda done, total: seen.append((done, total))) == slots * blocks
    assert seen == [(b + 1, blocks) for b in range(blocks)]
    assert all(cache.resident(path) == list(range(slots)) for path in cache.paths)  # file order
    assert cache.preload() == 0  # nothing free, nothing missing: nothing read again
    prompt = token_stream(5, 30)

    def decode(model, drafts):
        out, stats = [], DecodeStats()
        for step in generate(WindowEngine(model), prompt, options=GenerateOptions(max_tokens=16),
                             spec=SpecOptions(max_drafts=drafts), eos_ids=(), stats=stats):
            out += step.tokens
        return out, stats.summary()["experts"]

    want, _ = decode(reference, 0)
    for drafts in (0, 3):
        got, experts = decode(streamed, drafts)
        assert got == want
        assert (experts["bytes_read"] == 0) == (fraction == 1.0)
    cache.close()
