"""metal_shaders/gdn_window.py: the GDN decode-window kernels, their references, and where they run.

The CUDA bodies run here through scripts/lab/kernel_emulate.py (g++, float32): a T-row call must equal
T chained 1-row calls bit for bit and stay within 1e-5 of the reference. The references are held
to an independent float64 NumPy version of the layer's math, and decoding with the (emulated)
kernels is shown to keep greedy speculation token-identical to serial decoding.
"""


import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import gdn_window


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.GDNEmulator(tmp_path_factory.mktemp("gdn-emulate"))


def numpy_prepare(window, w, a, b, A_log, dt_bias, Hk, Dk):
    window, w, a, b, A_log, dt_bias = (np.array(x, np.float64) for x in (window, w, a, b, A_log, dt_bias))
    K = w.shape[1]
    T = window.shape[1] - (K - 1)
    conv = sum(window[:, j : j + T] * w[:, j] for j in range(K))
    mixed = conv / (1 + np.exp(-conv))
    B, Hv = a.shape[0], a.shape[2]
    q = mixed[..., : Hk * Dk].reshape(B, T, Hk, Dk)
    k = mixed[..., Hk * Dk : 2 * Hk * Dk].reshape(B, T, Hk, Dk)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + gdn_window.L2_EPS) / np.sqrt(Dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + gdn_window.L2_EPS)
    v = mixed[..., 2 * Hk * Dk :].reshape(B, T, Hv, -1)
    g = -np.exp(A_log) * np.log1p(np.exp(a + dt_bias))
    return q, k, v, g, 1 / (1 + np.exp(-b))


def numpy_scan(q, k, v, g, beta, S):
    q, k, v, g, beta, S = (np.array(x, np.float64) for x in (q, k, v, g, beta, S))
    group = v.shape[2] // k.shape[2]
    ys = []
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        k_t = np.repeat(k[:, t], group, axis=1)  # (B, Hv, Dk)
        delta = (v[:, t] - np.einsum("bhij,bhi->bhj", S, k_t)) * beta[:, t][..., None]
        S = S + k_t[..., None] * delta[:, :, None, :]
        ys.append(np.einsum("bhij,bhi->bhj", S, np.repeat(q[:, t], group, axis=1)))
    return np.stack(ys, axis=1), S


def inputs(emulate, B=1, Hk=2, Hv=4, Dk=32, Dv=64, rows=5):
    return emulate.gdn_inputs(B, Hk, Hv, Dk, Dv, rows=rows)


def test_references_match_the_layer_math(emulate):
    window, w, a, b, A_log, dt_bias = inputs(emulate)
    got = gdn_window.reference_prepare(window, w, a, b, A_log, dt_bias, num_k_heads=2, head_k_dim=32)
    expected = numpy_prepare(window, w, a, b, A_log, dt_bias, 2, 32)
    for x, y in zip(got, expected):
        assert x.dtype == mx.float32 and x.shape == y.shape
        assert np.allclose(np.array(x), y, rtol=1e-5, atol=1e-6)
    S = mx.random.normal((1, 4, 32, 64), key=mx.random.key(3)) * 0.1
    y, S_final = gdn_window.reference_scan(*got, S)
    y_np, S_np = numpy_scan(*got, S)
    assert np.allclose(np.array(y), y_np, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.array(S_final), S_np, rtol=1e-5, atol=1e-6)


def test_emulated_kernels_are_row_invariant_and_match_the_reference(emulate, emulator):
    """Hv = 2·Hk and Dk != Dv, so a head or a column read from the wrong place shows."""
    assert emulate.check_gdn(emulator, 1, 2, 4, 32, 64, rows=(1, 3, 8))


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path, monkeypatch):
    inputs_, outputs, body = emulate.GDN_KINDS["scan"]
    drifting = body.replace("float memory = 0.0f;", "float memory = 1e-3f * (T - 1);")
    assert drifting != body
    monkeypatch.setitem(emulate.GDN_KINDS, "scan", (inputs_, outputs, drifting))
    assert not emulate.check_gdn(emulate.GDNEmulator(tmp_path), 1, 1, 1, 32, 32, rows=(2,))


def test_supported_head_dims_and_launch_shapes():
    assert gdn_window.supports(128, 128) and gdn_window.supports(64, 32)
    assert not gdn_window.supports(8, 8) and not gdn_window.supports(128, 320) and not gdn_window.supports(48, 64)
    scan = gdn_window.scan_launch(1, 32, 128)
    assert scan["threadgroup"] == (gdn_window.THREADS, 1, 1) and scan["grid"][0] == 32 * 128 * gdn_window.SCAN_SPLIT
    prepare = gdn_window.prepare_launch(1, 3, 16, 32)  # a warp per (row, head segment)
    assert prepare["grid"][0] == 3 * (2 * 16 + 32) * 32


def _emulated_kernels(monkeypatch, emulator, calls):
    def scan(q, k, v, g, beta, S):
        calls.append(("scan", q.shape[1]))
        return tuple(mx.array(x) for x in emulator.scan(*(np.array(a) for a in (q, k, v, g, beta, S))))

    def prepare(history, raw, w, a, b, A_log, dt_bias, **heads):  # bfloat16 read as float32, as the kernel does
        calls.append(("prepare", a.shape[1]))
        arrays = (np.array(x.astype(mx.float32)) for x in (history, raw, w, a, b, A_log, dt_bias))
        *rows, window = emulator.prepare(*arrays, **heads)
        return (*(mx.array(x) for x in rows), mx.array(window).astype(raw.dtype))

    monkeypatch.setattr(gdn_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(gdn_window, "gdn_scan", scan)
    monkeypatch.setattr(gdn_window, "gdn_prepare", prepare)


def test_decode_windows_take_the_kernels_and_prompts_do_not(monkeypatch, emulator):
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.engine.state import GDNState, Mode
    from strata_cli.model.layers import RowSplit

    model = random_model(tiny_qwen3_next_config(linear_key_head_dim=32, linear_value_head_dim=32), seed=1)
    layer = next(m for _, m in model.named_modules() if type(m).__name__ == "GatedDeltaNet")
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    x = mx.random.normal((1, 12, 32), key=mx.random.key(4))
    kernel_state, mlx_state = GDNState(4, lazy=False), GDNState(4, lazy=False)
    for state in (kernel_state, mlx_state):
        state.begin(0, 12, Mode.COMMIT_ALL)
        layer(x, state)  # a prompt chunk: MLX ops (and the same committed state for both)
    assert calls == []
    for state in (kernel_state, mlx_state):
        state.begin(12, 3, Mode.WINDOW)
    y = layer(x[:, :3], kernel_state)
    assert calls == [("prepare", 3), ("scan", 3)]
    kernel_state.commit(2)  # the eager fold of the kept rows reuses the window's scan
    assert calls[-1] == ("scan", 2)
    monkeypatch.setattr(RowSplit, "mode", "never")
    y_mlx = layer(x[:, :3], mlx_state)
    assert len(calls) == 3
    assert mx.allclose(y, y_mlx, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("fold, partial", [("lazy", False), ("eager", True)])
def test_speculation_with_the_kernels_is_token_identical_to_serial(monkeypatch, emulator, fold, partial):
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.decode import generate
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
    from strata_cli.telemetry import DecodeStats

    model = random_model(tiny_qwen3_next_config(linear_key_head_dim=32, linear_value_head_dim=32), seed=0)
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    engine = WindowEngine(model, EngineOptions(fold=fold, partial=partial))
    ids = [5, 17, 42, 8, 5, 17, 42, 8, 5, 17, 42, 8, 5, 17]

    def decode(drafts):
        stats = DecodeStats()
        tokens = [t for step in generate(engine, ids, options=GenerateOptions(max_tokens=12),
                                         spec=SpecOptions(max_drafts=drafts), eos_ids=[], stats=stats)
                  for t in step.tokens]
        return tokens, stats.summary()

    serial, _ = decode(0)
    spec, summary = decode(3)
    assert spec == serial
    assert summary["drafts_offered"] > 0 and summary["drafts_kept"] > 0
    assert {n for kind, n in calls if kind == "scan"} > {1}  # multi-row windows went through the kernel


@pytest.mark.parametrize("fold, partial", [("lazy", False), ("eager", True)])
def test_rejected_drafts_leave_the_kernels_joined_history_as_serial_decoding(monkeypatch, emulator, fold, partial):
    """Forced rejections through the emulated kernels, whose prepare joins history and rows
    itself (the conv state keeps that join): every keep of T = 2..8 at one offset, logits and
    committed state against serial decoding, which takes the same kernels at T = 1."""
    from state_checks import check_forced_rejections, serial_decode

    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.options import EngineOptions

    # one GDN layer and one attention layer: each emulated call is a process of its own
    config = tiny_qwen3_next_config(linear_key_head_dim=32, linear_value_head_dim=32, num_hidden_layers=2,
                                    full_attention_interval=2)
    model = random_model(config, seed=3)
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    serial = serial_decode(model, 17)  # pos0 8, a window of 8, the row after it
    assert check_forced_rejections(model, EngineOptions(fold=fold, partial=partial), serial, 8, 1e-5) == 35
    assert {n for kind, n in calls if kind == "prepare"} >= set(range(1, 9))  # every window size took the kernel


def test_kernel_bench_times_the_gdn_window_on_the_cpu():
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_gdn("gdn", 1, 2, 32, 32, use_kernel=False, repeats=1, inner=1, peak_gbs=1.0)
    assert [r["R"] for r in records] == list(kernel_bench.ROWS)
    assert all(r["identical_to_1_row"] and r["max_abs_diff"] == 0.0 and r["ms"]["mlx"] > 0 for r in records)


def test_the_start_up_probe_passes_row_invariant_kernels_and_refuses_others(monkeypatch, emulator):
    """The probe's own checks (float32 and bfloat16), run here on the emulated kernels."""
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    assert gdn_window.check() is None
    assert ("prepare", 8) in calls and ("scan", 1) in calls
    emulated_scan = gdn_window.gdn_scan

    def drifting_scan(q, k, v, g, beta, S):
        y, S = emulated_scan(q, k, v, g, beta, S)
        return y * (1 + 1e-6 * (q.shape[1] - 1)), S

    monkeypatch.setattr(gdn_window, "gdn_scan", drifting_scan)
    assert gdn_window.check() == "gdn_scan rows differ with the row count"
    emulated_prepare = gdn_window.gdn_prepare

    def stale_history(history, raw, *rest, **heads):  # the rows right, the joined window's history not
        *rows, window = emulated_prepare(history, raw, *rest, **heads)
        return (*rows, mx.concatenate([mx.zeros_like(history), raw], axis=1))

    monkeypatch.setattr(gdn_window, "gdn_prepare", stale_history)
    assert gdn_window.check() == "gdn_prepare's joined window is not its history and rows (mlx.core.float32)"


def test_calls_pass_shapes_as_data_and_dtypes_as_template_values(monkeypatch):
    """What the wrappers hand to the GPU backend's kernel maker: shapes in `dims`, every input dtype and
    the compiled sizes (DK, PER, the conv's taps KS) as template values, float32 outputs of the contract's shapes."""
    calls = []

    def fake(name, inputs, outputs, source, header):
        def kernel(**kw):
            calls.append((source, kw))
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return kernel

    monkeypatch.setattr(gdn_window, "gpu_kernel", fake)
    B, T, Hk, Hv, Dk, Dv, K = 2, 3, 2, 4, 32, 64, 4
    C = 2 * Hk * Dk + Hv * Dv
    history, raw = mx.zeros((B, K - 1, C), dtype=mx.bfloat16), mx.zeros((B, T, C), dtype=mx.bfloat16)
    a = mx.zeros((B, T, Hv), dtype=mx.bfloat16)
    q, k, v, g, beta, window = gdn_window.gdn_prepare(history, raw, mx.zeros((C, K), dtype=mx.bfloat16), a, a,
                                                      mx.zeros((Hv,)), mx.zeros((Hv,)), num_k_heads=Hk, head_k_dim=Dk)
    assert [x.shape for x in (q, k, v, g, beta)] == [(B, T, Hk, Dk)] * 2 + [(B, T, Hv, Dv)] + [(B, T, Hv)] * 2
    assert window.shape == (B, K - 1 + T, C) and window.dtype == mx.bfloat16
    y, S = gdn_window.gdn_scan(q, k, v, g, beta, mx.zeros((B, Hv, Dk, Dv)))
    assert y.shape == (B, T, Hv, Dv) and S.shape == (B, Hv, Dk, Dv)
    (prepare_source, prepare), (scan_source, scan) = calls
    assert prepare_source is gdn_window.PREPARE and scan_source is gdn_window.SCAN
    assert prepare["inputs"][0].tolist() == [B, T, Hk, Hv, Dk, Dv, K] and scan["inputs"][0].tolist() == [B, T, Hk, Hv, Dv]
    assert dict(prepare["template"]) == {"TX": mx.bfloat16, "TW": mx.bfloat16, "TA": mx.bfloat16, "TB": mx.bfloat16,
                                         "TL": mx.float32, "TD": mx.float32, "PER": 2, "KS": K}
    assert dict(scan["template"])["DK"] == Dk and len(scan["template"]) == 7
    assert all(d == mx.float32 for d in prepare["output_dtypes"][:5] + scan["output_dtypes"])
    assert prepare["output_dtypes"][5] == mx.bfloat16  # the joined window keeps the rows' dtype
    with pytest.raises(ValueError, match="does not go with raw"):
        gdn_window.gdn_prepare(history[:, 1:], raw, mx.zeros((C, K), dtype=mx.bfloat16), a, a, mx.zeros((Hv,)),
                               mx.zeros((Hv,)), num_k_heads=Hk, head_k_dim=Dk)


@pytest.mark.parametrize("nk, nv", [(2, 4), (3, 3)])
def test_project_takes_the_per_head_split_in_four_gathers(nk, nv):
    """`GatedDeltaNet.project` gives exactly the checkpoint's per-key-head split: [q | k | v]
    concatenated over heads for the conv, z per value head, b and a (one gather each)."""
    from strata_cli.model.gdn import GatedDeltaNet

    dk, dv, H = 8, 4, 16
    layer = GatedDeltaNet(hidden_size=H, num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv,
                          conv_kernel=4, eps=1e-6)
    layer.in_proj_qkvz.weight = mx.random.normal(layer.in_proj_qkvz.weight.shape, key=mx.random.key(1))
    layer.in_proj_ba.weight = mx.random.normal(layer.in_proj_ba.weight.shape, key=mx.random.key(2))
    x = mx.random.normal((1, 3, H), key=mx.random.key(3))
    raw, z, b, a = layer.project(x)
    qkvz = layer.in_proj_qkvz(x).reshape(1, 3, nk, -1)
    pv = nv // nk * dv
    q, k, v, zz = mx.split(qkvz, [dk, 2 * dk, 2 * dk + pv], axis=-1)
    bb, aa = mx.split(layer.in_proj_ba(x).reshape(1, 3, nk, -1), 2, axis=-1)
    expected = mx.concatenate([q.reshape(1, 3, -1), k.reshape(1, 3, -1), v.reshape(1, 3, -1)], axis=-1)
    assert mx.array_equal(raw, expected).item()
    assert mx.array_equal(z, zz.reshape(1, 3, nv, dv)).item()
    assert mx.array_equal(b, bb.reshape(1, 3, nv)).item() and mx.array_equal(a, aa.reshape(1, 3, nv)).item()
