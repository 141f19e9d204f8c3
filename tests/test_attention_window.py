"""metal_shaders/attention_window.py: the decode-window attention kernel, its reference, and where it runs.

The CUDA body runs here through scripts/lab/kernel_emulate.py (g++, float32, a block's threads at
once): each row of a T-row call must equal its 1-row call bit for bit and stay within 1e-5 of
the reference. The reference is held to plain causal sdpa and to float64 NumPy, and decoding
with the (emulated) kernel is shown to keep greedy speculation token-identical to serial.
"""


import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import attention_window
from state_checks import speculation_matches_serial


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.AttentionEmulator(tmp_path_factory.mktemp("attention-emulate"))


def numpy_attention(q, keys, values, scale):
    """Row t of T sees cells 0..L-T+t; float64; (B, T, Hq, D)."""
    q, keys, values = (np.array(x, np.float64) for x in (q, keys, values))
    B, Hq, T, D = q.shape
    keys, values = (np.repeat(x, Hq // x.shape[1], axis=1) for x in (keys, values))
    L = keys.shape[2]
    scores = np.einsum("bhtd,bhld->bhtl", q, keys) * scale
    scores = np.where(np.arange(L) <= (L - T + np.arange(T))[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhtl,bhld->bthd", weights, values)


@pytest.mark.parametrize("T, L", [(1, 1), (3, 3), (5, 40), (8, 300)])
def test_reference_matches_plain_causal_sdpa(T, L):
    q, keys, values = attention_window.probe_inputs(1, 4, 2, 32, L, seed=T)
    q = q[:, :, :T]
    got = attention_window.reference_attention_window(q, keys, values, 32**-0.5)
    plain = mx.fast.scaled_dot_product_attention(q, keys, values, scale=32**-0.5, mask="causal" if T > 1 else None)
    assert got.shape == (1, T, 4, 32)
    assert mx.allclose(got, plain.transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-6).item()
    assert np.allclose(np.array(got), numpy_attention(q, keys, values, 32**-0.5), rtol=1e-5, atol=1e-6)


def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator):
    """Hq = 2·Hkv, batch 2, and 300 cells: some warps of a block take two chunks, so a head,
    cell or chunk read from the wrong place shows (kernel_emulate.py runs T = 1..8, longer
    contexts and the models' head dims)."""
    assert emulate.check_attention(emulator, 2, 4, 2, 32, 300, rows=(1, 4))


# The body's loads grouped (keys 32 values a lane, values AHEAD cells) and as they were, one load then its use
LOADS_AHEAD = (
    ("    constexpr int AHEAD = PER > 4 ? 4 : 8;", "    constexpr int AHEAD = 1;"),
    ("""            for (int d0 = 0; d0 < DH; d0 += 32) {
                float kv[4][8];
                #pragma unroll
                for (int u = 0; u < 4; ++u) strata_load<TK, 8>(kp + d0 + 8 * u, kvec, kv[u]);
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    #pragma unroll
                    for (int c = 0; c < 8; ++c) part[c & 3] = fmaf(q_s[d0 + 8 * u + c], kv[u][c], part[c & 3]);
                }
            }
""", """            #pragma unroll 4
            for (int d0 = 0; d0 < DH; d0 += 8) {
                float kv[8];
                strata_load<TK, 8>(kp + d0, kvec, kv);
                #pragma unroll
                for (int c = 0; c < 8; ++c) part[c & 3] = fmaf(q_s[d0 + c], kv[c], part[c & 3]);
            }
"""),
)


@pytest.mark.parametrize("D, cells", [(32, 300), (256, 45), (128, 37)])
def test_loads_grouped_ahead_give_the_bits_of_one_load_at_a_time(emulate, emulator, tmp_path, D, cells):
    """Key values loaded 32 at a time and AHEAD cells' values before any is added in: the same
    sums in the same order as the body that loaded each and used it at once, at chunk tails that
    AHEAD does not divide (300 and 45 cells, a window's rows seeing one more each), bit for bit,
    sinks and a ring window included."""
    source = attention_window.SOURCE
    for grouped, one in LOADS_AHEAD:
        assert source.count(grouped) == 1
        source = source.replace(grouped, one)
    one_at_a_time = emulate.AttentionEmulator(tmp_path / "one")
    one_at_a_time.source = source
    (tmp_path / "one").mkdir()
    rng = np.random.default_rng(D)
    q = rng.standard_normal((1, 5, 4, D), np.float32)
    k, v = (rng.standard_normal((1, 2, cells + 9, D), np.float32) for _ in range(2))
    for T in (1, 5):
        got = emulator.run(q[:, :T], k, v, cells + T, D**-0.5)
        assert np.array_equal(got, one_at_a_time.run(q[:, :T], k, v, cells + T, D**-0.5))
    sinks_ahead = emulate.SinkAttentionEmulator(tmp_path / "sinks")
    sinks_one = emulate.SinkAttentionEmulator(tmp_path / "sinks-one")
    sinks_one.source = attention_window.with_sinks(one_at_a_time.source)
    (tmp_path / "sinks").mkdir(), (tmp_path / "sinks-one").mkdir()
    sinks = rng.standard_normal(4).astype(np.float32)
    for window in (0, 16):
        args = (q, k, v, cells, D**-0.5, sinks, 3, window)
        assert np.array_equal(sinks_ahead.run_sinks(*args), sinks_one.run_sinks(*args))


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path):
    drifting = emulate.AttentionEmulator(tmp_path)
    drifting.source = attention_window.SOURCE.replace("float total = 0.0f", "float total = 1e-6f * T")
    assert drifting.source != attention_window.SOURCE
    assert not emulate.check_attention(drifting, 1, 2, 1, 32, 7, rows=(2,))


@pytest.mark.parametrize("B, D, cells, rows", [(2, 32, 62, (1, 4, 8)), (1, 64, 300, (1, 8))])
def test_splits_keep_each_row_its_bits_across_the_threshold(emulate, monkeypatch, tmp_path, B, D, cells, rows):
    """Views past SPLIT_CELLS (64 here) attend in splits and their combine. At 62 cells a window's
    rows see 62-69: its 8-row call takes the splits, while serial decoding's 1-row calls of rows
    0-2 take the single kernel, and every row keeps the bits of its 1-row call; at 300 cells
    every row has five splits and stays near the reference."""
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 64)
    assert attention_window.splits(64) == 1 and attention_window.splits(65) == 2
    assert emulate.check_attention(emulate.AttentionEmulator(tmp_path), B, 4, 2, D, cells, rows=rows)


def test_a_split_walked_in_another_order_is_noticed(emulate, monkeypatch, tmp_path):
    """The threshold's check can fail: splits whose warps start one chunk over give a row of at
    most SPLIT_CELLS cells other bits than the single kernel's, and its 1-row call shows it."""
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 64)
    turned = "for (int j0 = s * SPLIT + ((warp + 1) % WARPS) * 32; j0 < end; j0 += WARPS * 32)"
    monkeypatch.setattr(attention_window, "SPLIT_SOURCE", attention_window.SPLIT_SOURCE.replace(
        "for (int j0 = s * SPLIT + warp * 32; j0 < end; j0 += WARPS * 32)", turned))
    assert turned in attention_window.SPLIT_SOURCE
    assert not emulate.check_attention(emulate.AttentionEmulator(tmp_path), 1, 2, 1, 32, 62, rows=(8,))


@pytest.mark.parametrize("cells, window, pos0, offset", [(62, 0, 0, 0.0), (62, 0, 0, 6.0), (300, 0, 0, 0.0),
                                                         (135, 128, 3000, 0.0)])
def test_sink_splits_keep_each_row_its_bits(emulate, monkeypatch, tmp_path, cells, window, pos0, offset):
    """With sinks (GPT-OSS), in 64-cell splits: across the threshold (62 cells), with sinks above
    every score (offset 6), over 300 cells, and over a 135-cell ring (every row walks all of it)."""
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 64)
    assert emulate.check_sink_attention(emulate.SinkAttentionEmulator(tmp_path), 1, 4, 2, 32, cells, window,
                                        pos0=pos0, rows=(1, 4, 8), sink_offset=offset)


def test_a_sink_left_out_of_a_splits_max_is_noticed(emulate, monkeypatch, tmp_path):
    """A split's max takes the sink in, so a lone split is weighted exp(0): taken into the
    combine's max instead, a row whose sink beats its scores gets other bits across the threshold."""
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 64)
    monkeypatch.setattr(attention_window, "SINK_SPLIT_SOURCE",
                        attention_window.SINK_SPLIT_SOURCE.replace("    M = fmaxf(M, sink);\n", ""))
    monkeypatch.setattr(attention_window, "SINK_COMBINE_SOURCE", attention_window.SINK_COMBINE_SOURCE.replace(
        "  // in every split's max already\n", "\n    M = fmaxf(M, sink);\n"))
    assert "M = fmaxf(M, sink)" not in attention_window.SINK_SPLIT_SOURCE
    assert not emulate.check_sink_attention(emulate.SinkAttentionEmulator(tmp_path), 1, 4, 2, 32, 62, 0, pos0=0,
                                            rows=(8,), sink_offset=6.0)


def test_a_long_view_launches_its_splits_then_their_combine(monkeypatch):
    calls = []

    def fake(name, inputs, outputs, source, header, *, ensure_row_contiguous=True):
        def kernel(**kw):
            calls.append((name, source, header, kw))
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return kernel

    monkeypatch.setattr(attention_window, "gpu_kernel", fake)
    assert attention_window.splits(1024) == 1 and attention_window.splits(1025) == 2  # the default: 1,024
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 64)
    q, keys, values = attention_window.probe_inputs(2, 4, 2, 32, 130, dtype=mx.bfloat16)
    out = attention_window.attention_window(q[:, :, :3], keys, values, 0.125)
    assert out.shape == (2, 3, 4, 32) and out.dtype == mx.bfloat16
    (split, split_source, header, first), (combine, combine_source, _, second) = calls
    assert split == "strata_attention_split_v1_w8_c64" and split_source is attention_window.SPLIT_SOURCE
    assert "#define SPLIT 64" in header and combine_source is attention_window.COMBINE_SOURCE
    threads = attention_window.WARPS * 32
    assert first["grid"][0] == 2 * 4 * 3 * 3 * threads  # 130 cells: three splits a row
    assert first["output_shapes"] == [(24, 3, 34)] and first["output_dtypes"] == [mx.float32]
    assert second["inputs"][1].shape == (24, 3, 34) and second["grid"] == (2 * 4 * 3 * 32, 1, 1)
    calls.clear()
    sinks = mx.zeros((4,), dtype=mx.bfloat16)
    out = attention_window.sink_attention_window(q[:, :, :3], keys, values, 0.125, sinks)
    assert [(c[0], c[1]) for c in calls] == [
        ("strata_attention_split_sinks_v1_w8_c64", attention_window.SINK_SPLIT_SOURCE),
        ("strata_attention_combine_sinks_v1_w8_c64", attention_window.SINK_COMBINE_SOURCE)]
    assert calls[1][3]["inputs"][2] is sinks and out.shape == (2, 3, 4, 32)
    monkeypatch.setattr(attention_window, "SPLIT_CELLS", 48 + 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        attention_window.attention_window(q[:, :, :3], keys, values, 0.125)


def test_supported_head_dims_and_launch_shape():
    assert attention_window.supports(256) and attention_window.supports(64) and attention_window.supports(32)
    assert not attention_window.supports(16) and not attention_window.supports(80) and not attention_window.supports(512)
    config = attention_window.launch(2, 16, 3)  # a block per (batch, head, row)
    threads = attention_window.WARPS * 32
    assert config["threadgroup"] == (threads, 1, 1) and config["grid"][0] == 2 * 16 * 3 * threads


def test_the_call_passes_views_shapes_as_data_and_dtypes_as_template_values(monkeypatch):
    calls = []

    def fake(name, inputs, outputs, source, header, *, ensure_row_contiguous=True):
        def kernel(**kw):
            calls.append((source, ensure_row_contiguous, kw))
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return kernel

    monkeypatch.setattr(attention_window, "gpu_kernel", fake)
    q, keys, values = attention_window.probe_inputs(2, 4, 2, 64, 20, capacity=40, dtype=mx.bfloat16)
    out = attention_window.attention_window(q[:, :, :3], keys, values, 0.125)
    assert out.shape == (2, 3, 4, 64) and out.dtype == mx.bfloat16
    (source, contiguous, kw), = calls
    assert source is attention_window.SOURCE and contiguous is False  # the cache's view, not a copy
    assert kw["inputs"][0].tolist() == [2, 4, 2, 3, 20] and kw["inputs"][1].tolist() == [0.125]
    assert dict(kw["template"]) == {"DH": 64, "TQ": mx.bfloat16, "TK": mx.bfloat16, "TV": mx.bfloat16}


def _emulated_kernel(monkeypatch, emulator, calls):
    def kernel(q, keys, values, scale):
        calls.append(q.shape[2])
        L = keys.shape[2]
        q_rows = np.array(q.transpose(0, 2, 1, 3).astype(mx.float32))
        out = emulator.run(q_rows, np.array(keys.astype(mx.float32)), np.array(values.astype(mx.float32)), L, scale)
        return mx.array(out).astype(q.dtype)

    monkeypatch.setattr(attention_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_window, "attention_window", kernel)


def _attention_layer(model):
    return next(m for _, m in model.named_modules() if type(m).__name__ == "GatedAttention")


def test_on_the_cpu_windows_attend_row_by_row_without_the_kernel(monkeypatch):
    """The CPU's path is unchanged: no kernel call, and with the row split each window row
    equals serial decoding's 1-row step bit for bit."""
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.engine.state import KVState, Mode
    from strata_cli.model.layers import RowSplit

    def refuse(*args):
        raise AssertionError("the kernel ran on the CPU")

    split_rows = []
    reference = attention_window.reference_attention_window

    def spy(q, *args):
        split_rows.append(q.shape[2])
        return reference(q, *args)

    monkeypatch.setattr(attention_window, "attention_window", refuse)
    monkeypatch.setattr(attention_window, "reference_attention_window", spy)
    monkeypatch.setattr(RowSplit, "mode", "always")
    layer = _attention_layer(random_model(tiny_qwen3_next_config(head_dim=32), seed=2))
    x = mx.random.normal((1, 20, 32), key=mx.random.key(7))
    window_state, serial_state = KVState(), KVState()
    for state in (window_state, serial_state):
        state.begin(0, 17, Mode.COMMIT_ALL)
        layer(x[:, :17], state)  # a prompt chunk (PREFILL_MIN_ROWS or more): blocked matmuls
    window_state.begin(17, 3, Mode.COMMIT_ALL)
    window = layer(x[:, 17:], window_state)
    serial = []
    for t in range(17, 20):
        serial_state.begin(t, 1, Mode.COMMIT_ALL)
        serial.append(layer(x[:, t : t + 1], serial_state))
    assert mx.array_equal(window, mx.concatenate(serial, axis=1)).item()
    assert split_rows == [3]  # the window split by row; prompts and 1-row steps take sdpa whole


def test_decode_windows_take_the_kernel_and_prompts_do_not(monkeypatch, emulator):
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.engine.state import KVState, Mode
    from strata_cli.model.layers import RowSplit

    layer = _attention_layer(random_model(tiny_qwen3_next_config(head_dim=32), seed=1))
    calls = []
    _emulated_kernel(monkeypatch, emulator, calls)
    x = mx.random.normal((1, 20, 32), key=mx.random.key(4))
    kernel_state, mlx_state = KVState(), KVState()
    for state in (kernel_state, mlx_state):
        state.begin(0, 17, Mode.COMMIT_ALL)
        layer(x[:, :17], state)  # a prompt chunk: MLX's sdpa
    assert calls == []
    for state in (kernel_state, mlx_state):
        state.begin(17, 3, Mode.WINDOW)
    y = layer(x[:, 17:], kernel_state)
    assert calls == [3]
    monkeypatch.setattr(RowSplit, "mode", "never")
    y_mlx = layer(x[:, 17:], mlx_state)
    assert calls == [3]
    assert mx.allclose(y, y_mlx, rtol=1e-4, atol=1e-5).item()


def test_speculation_with_the_kernel_is_token_identical_to_serial(monkeypatch, emulator):
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import EngineOptions

    model = random_model(tiny_qwen3_next_config(head_dim=32), seed=2)
    calls = []
    _emulated_kernel(monkeypatch, emulator, calls)
    speculation_matches_serial(WindowEngine(model, EngineOptions()), calls)


def test_kernel_bench_times_the_attention_window_on_the_cpu():
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_attention("attention", 4, 2, 32, 20, use_kernel=False, repeats=1, inner=1,
                                           peak_gbs=1.0)
    assert [r["R"] for r in records] == list(kernel_bench.ROWS)
    assert all(r["identical_to_1_row"] and r["max_abs_diff"] < 2e-2 and r["ms"]["mlx"] > 0 for r in records)


def test_the_start_up_probe_passes_a_row_invariant_kernel_and_refuses_others(monkeypatch, emulator):
    """The probe's own checks (float32 and bfloat16, views of a longer buffer), on the emulated
    kernel at smaller shapes than the device's probe (the emulator takes seconds per call there)."""
    calls = []
    _emulated_kernel(monkeypatch, emulator, calls)
    cases = ((32, mx.float32, 2, 40), (64, mx.bfloat16, 4, 100))
    assert attention_window.check(cases) is None
    assert 8 in calls and 1 in calls
    emulated = attention_window.attention_window

    def drifting(q, keys, values, scale):
        return emulated(q, keys, values, scale) * (1 + 1e-3 * (q.shape[2] - 1))

    monkeypatch.setattr(attention_window, "attention_window", drifting)
    assert attention_window.check(cases).startswith("attention_window rows differ with the row count")


# -- the sink kernel (GPT-OSS): sinks, and a sliding window kept as a ring -----------------------


@pytest.fixture(scope="module")
def sink_emulator(emulate, tmp_path_factory):
    return emulate.SinkAttentionEmulator(tmp_path_factory.mktemp("sink-attention-emulate"))


@pytest.mark.parametrize("cells, window, pos0", [(11, 4, 37), (11, 4, 2), (40, 0, 0)],
                         ids=["ring-wrapped", "ring-filling", "full"])
def test_emulated_sink_kernel_is_row_invariant_and_matches_the_reference(emulate, sink_emulator, cells, window, pos0):
    """Each row of a T-row call equals its 1-row call (serial decoding's step: the ring at that
    row's position) bit for bit, and the reference (serial's sdpa with sinks and the ring mask)
    within 1e-5; a ring wrapped many times, one still filling, and full attention with sinks."""
    assert emulate.check_sink_attention(sink_emulator, 2, 4, 2, 32, cells, window, pos0=pos0, rows=(1, 3, 8))


def test_the_sink_kernel_is_the_plain_kernel_plus_its_edits():
    """The plain kernel's text is untouched (its probe passed on the H200); each edit applies once."""
    assert attention_window.SINK_SOURCE != attention_window.SOURCE
    assert "sinks[h]" in attention_window.SINK_SOURCE and "sinks" not in attention_window.SOURCE
    with pytest.raises(AssertionError, match="SOURCE changed"):
        attention_window.with_sinks(attention_window.SOURCE.replace("    const int n = L - T + t + 1;\n", ""))


def test_sink_reference_is_serial_sdpa_and_ring_mask_is_the_states():
    from strata_cli.engine.sliding_state import SlidingKVState

    state = SlidingKVState(4)
    for pos0 in (0, 2, 3, 10, 37):
        assert mx.array_equal(attention_window.ring_mask(pos0, 8, 11, 4), state.visible(pos0, 8)).item()
    q, keys, values = attention_window.probe_inputs(1, 4, 2, 32, 11, seed=3)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    mask = attention_window.ring_mask(20, 8, 11, 4)
    got = attention_window.reference_sink_attention_window(q, keys, values, 32**-0.5, sinks, mask=mask)
    whole = mx.fast.scaled_dot_product_attention(q, keys, values, scale=32**-0.5, sinks=sinks, mask=mask)
    assert mx.allclose(got, whole.transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-6).item()


def test_the_sink_emulator_notices_a_wrong_ring_rule(emulate, tmp_path):
    wrong = emulate.SinkAttentionEmulator(tmp_path)
    wrong.source = attention_window.SINK_SOURCE.replace("< seen;", "<= seen;")
    assert wrong.source != attention_window.SINK_SOURCE
    assert not emulate.check_sink_attention(wrong, 1, 2, 1, 32, 11, 4, pos0=30, rows=(2,))


def test_emulated_sink_kernel_on_metal(emulate, tmp_path):
    from metal_shaders import backends

    metal = emulate.SinkAttentionEmulator(tmp_path, backends.METAL)
    assert emulate.check_sink_attention(metal, 1, 4, 2, 32, 11, 4, pos0=29, rows=(1, 3))


def test_gpt_oss_decodes_identically_through_the_emulated_sink_kernel(emulate, sink_emulator, monkeypatch):
    """GPT-OSS (window 4, ring of 11) decoding with the sink kernel (emulated) in every attention
    layer: greedy tokens with 3 drafts equal serial ones, and both equal the CPU attention's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from gpt_oss_checkpoints import strata_model
    from hybrid_parity import strata_tokens

    from strata_cli.options import SpecOptions

    model = strata_model(4, num_hidden_layers=2, head_dim=32)  # the kernel takes multiples of 32
    calls = []

    def emulated(q, keys, values, scale, sinks, *, pos0=0, window=0):
        calls.append(q.shape[2])
        q_rows = np.array(q.transpose(0, 2, 1, 3))
        return mx.array(sink_emulator.run_sinks(q_rows, np.array(keys), np.array(values), keys.shape[2], scale,
                                                np.array(sinks.astype(mx.float32)), pos0, window))

    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    reference = strata_tokens(model, prompt, SpecOptions())[0]
    monkeypatch.setattr(attention_window, "sinks_usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_window, "sink_attention_window", emulated)
    serial = strata_tokens(model, prompt, SpecOptions())[0]
    drafted = strata_tokens(model, prompt, SpecOptions(max_drafts=3))[0]
    assert calls and max(calls) > 1  # windows of several rows went through the kernel
    assert serial == drafted == reference


def test_sixteen_warps_keep_each_row_its_one_row_bits(emulate, monkeypatch, tmp_path):
    """WARPS is the process's (a study times 16): with twice the warps splitting the cells, each
    row of a T-row call still equals its 1-row call and stays near the reference."""
    monkeypatch.setattr(attention_window, "WARPS", 16)
    assert "#define WARPS 16" in attention_window.header()
    assert emulate.check_attention(emulate.AttentionEmulator(tmp_path), 2, 4, 2, 32, 300, rows=(1, 4))
