"""metal_shaders/mamba2_window.py: the Mamba-2 decode-window kernels, their references, and where they run.

MLX custom kernels need a GPU, so on the CPU the bodies run through scripts/lab/kernel_emulate.py
(g++, float32; the Metal prelude in tests/test_kernel_backends.py): a T-row call must equal T
chained 1-row calls bit for bit and stay within 1e-5 of the reference, which is the layer's own
MLX math (model/mamba2.py runs `reference_prepare` / `reference_scan`). The references are held
to an independent float64 NumPy version of the layer's math, and decoding with the (emulated)
kernels is shown to keep greedy speculation token-identical to serial decoding.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import mamba2_window

SHAPES = {"num_heads": 4, "head_dim": 16, "n_groups": 2, "state_size": 32, "dt_limits": (0.001, float("inf"))}


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.Mamba2Emulator(tmp_path_factory.mktemp("mamba2-emulate"))


def numpy_prepare(window, w, bias, dt, dt_bias, A_log, *, num_heads, head_dim, n_groups, state_size, dt_limits):
    window, w, bias, dt, dt_bias, A_log = (np.array(a, np.float64) for a in (window, w, bias, dt, dt_bias, A_log))
    K = w.shape[1]
    T = window.shape[1] - (K - 1)
    conv = sum(window[:, j : j + T] * w[:, j] for j in range(K)) + bias
    mixed = conv / (1 + np.exp(-conv))
    B, I, GN = dt.shape[0], num_heads * head_dim, n_groups * state_size
    x = mixed[..., :I].reshape(B, T, num_heads, head_dim)
    Bm = mixed[..., I : I + GN].reshape(B, T, n_groups, state_size)
    Cm = mixed[..., I + GN :].reshape(B, T, n_groups, state_size)
    step = np.clip(np.log1p(np.exp(dt + dt_bias)), *dt_limits)
    return x, Bm, Cm, step, step * -np.exp(A_log)


def numpy_scan(x, Bm, Cm, dt, g, S):
    x, Bm, Cm, dt, g, S = (np.array(a, np.float64) for a in (x, Bm, Cm, dt, g, S))
    group = x.shape[2] // Bm.shape[2]
    ys = []
    for t in range(x.shape[1]):
        Bh, Ch = np.repeat(Bm[:, t], group, axis=1), np.repeat(Cm[:, t], group, axis=1)  # (B, H, N)
        S = S * np.exp(g[:, t])[..., None, None] + (x[:, t] * dt[:, t][..., None])[..., None] * Bh[:, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", S, Ch))
    return np.stack(ys, axis=1), S


def test_references_match_the_layer_math():
    window, w, bias, dt, dt_bias, A_log = mamba2_window.probe_inputs(1, 5, 4, 16, 2, 32)
    for limits in ((0.001, float("inf")), (0.2, 1.0)):  # the second clips both ends
        shapes = dict(SHAPES, dt_limits=limits)
        got = mamba2_window.reference_prepare(window, w, bias, dt, dt_bias, A_log, **shapes)
        expected = numpy_prepare(window, w, bias, dt, dt_bias, A_log, **shapes)
        for a, b in zip(got, expected):
            assert a.dtype == mx.float32 and a.shape == b.shape
            assert np.allclose(np.array(a), b, rtol=1e-5, atol=1e-6)
    S = mx.random.normal((1, 4, 16, 32), key=mx.random.key(3)) * 0.1
    y, S_final = mamba2_window.reference_scan(*got, S)
    y_np, S_np = numpy_scan(*got, S)
    assert np.allclose(np.array(y), y_np, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.array(S_final), S_np, rtol=1e-5, atol=1e-6)


def test_emulated_kernels_are_row_invariant_and_match_the_reference(emulate, emulator):
    """H = 2·G heads per group, P != N, a batch of 2: a head, group or channel read from the
    wrong place shows; with and without a conv bias, dt clipped at both ends."""
    assert emulate.check_mamba2(emulator, 2, 4, 16, 2, 32, rows=(1, 3, 8))
    assert emulate.check_mamba2(emulator, 1, 2, 8, 1, 16, rows=(1, 4), bias=False, dt_limits=(0.2, 1.0))


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path, monkeypatch):
    inputs, outputs, body = emulate.MAMBA2_KINDS["scan"]
    drifting = body.replace("float out = 0.0f;", "float out = 1e-3f * (T - 1);")
    assert drifting != body
    monkeypatch.setitem(emulate.MAMBA2_KINDS, "scan", (inputs, outputs, drifting))
    assert not emulate.check_mamba2(emulate.Mamba2Emulator(tmp_path), 1, 1, 8, 1, 16, rows=(2,))


def test_supported_state_sizes_and_launch_shapes():
    assert mamba2_window.supports(128) and mamba2_window.supports(16) and mamba2_window.supports(256)
    assert not mamba2_window.supports(0) and not mamba2_window.supports(512)
    scan = mamba2_window.scan_launch(1, 64, 64)  # a thread per (head, head channel)
    assert scan["threadgroup"] == (mamba2_window.THREADS, 1, 1) and scan["grid"][0] == 64 * 64
    prepare = mamba2_window.prepare_launch(2, 3, 6144, 64)  # a thread per (row, channel or head)
    assert prepare["grid"][0] >= 2 * 3 * (6144 + 64) > prepare["grid"][0] - mamba2_window.THREADS


def _emulated_kernels(monkeypatch, emulator, calls):
    def scan(x, Bm, Cm, dt, g, S):
        calls.append(("scan", x.shape[1]))
        return tuple(mx.array(a) for a in emulator.scan(*(np.array(a) for a in (x, Bm, Cm, dt, g, S))))

    def prepare(history, raw, w, bias, dt, dt_bias, A_log, **shapes):  # bfloat16 read as float32, as the kernel does
        calls.append(("prepare", dt.shape[1]))
        arrays = [None if a is None else np.array(a.astype(mx.float32))
                  for a in (history, raw, w, bias, dt, dt_bias, A_log)]
        *rows, window = emulator.prepare(*arrays, **shapes)
        return (*(mx.array(a) for a in rows), mx.array(window).astype(raw.dtype))

    monkeypatch.setattr(mamba2_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(mamba2_window, "mamba2_scan", scan)
    monkeypatch.setattr(mamba2_window, "mamba2_prepare", prepare)


def test_decode_windows_take_the_kernels_and_prompts_do_not(monkeypatch, emulator):
    from strata_cli.bench import hybrid_probe
    from strata_cli.engine.state import Mamba2State, Mode
    from strata_cli.model.layers import RowSplit

    model = hybrid_probe.build_model()
    layer = model.layers[0].mixer
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    x = mx.random.normal((1, 20, 64), key=mx.random.key(4))
    kernel_state, mlx_state = Mamba2State(4, lazy=False), Mamba2State(4, lazy=False)
    for state in (kernel_state, mlx_state):
        state.begin(0, 17, Mode.COMMIT_ALL)
        layer(x[:, :17], state)  # a prompt chunk: MLX ops (and the same committed state for both)
    assert calls == []
    for state in (kernel_state, mlx_state):
        state.begin(17, 3, Mode.WINDOW)
    y = layer(x[:, 17:], kernel_state)
    assert calls == [("prepare", 3), ("scan", 3)]
    kernel_state.commit(2)  # the eager fold of the kept rows reuses the window's scan
    assert calls[-1] == ("scan", 2)
    monkeypatch.setattr(RowSplit, "mode", "never")
    y_mlx = layer(x[:, 17:], mlx_state)
    assert len(calls) == 3
    assert mx.allclose(y, y_mlx, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("fold, partial", [("lazy", False), ("eager", True)])
def test_speculation_with_the_kernels_is_token_identical_to_serial(monkeypatch, emulator, fold, partial):
    from strata_cli.bench import hybrid_probe
    from strata_cli.decode import generate
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
    from strata_cli.telemetry import DecodeStats

    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    engine = WindowEngine(hybrid_probe.build_model(), EngineOptions(fold=fold, partial=partial))
    head = mx.random.randint(0, hybrid_probe.VOCAB, (8,), key=mx.random.key(5)).tolist()

    def decode(ids, drafts, n):
        stats = DecodeStats()
        tokens = [t for step in generate(engine, ids, options=GenerateOptions(max_tokens=n),
                                         spec=SpecOptions(max_drafts=drafts), eos_ids=[], stats=stats)
                  for t in step.tokens]
        return tokens, stats.summary()

    ids = head + decode(head, 0, 12)[0] + head  # the model's own continuation follows `head` again
    serial, _ = decode(ids, 0, 12)
    spec, summary = decode(ids, 3, 12)
    assert spec == serial
    assert summary["drafts_offered"] > 0 and summary["drafts_kept"] > 0
    assert {n for kind, n in calls if kind == "scan"} > {1}  # multi-row windows went through the kernel


@pytest.mark.parametrize("fold, partial", [("lazy", False), ("eager", True)])
def test_rejected_drafts_leave_the_kernels_joined_history_as_serial_decoding(monkeypatch, emulator, fold, partial):
    """Forced rejections through the emulated kernels, whose prepare joins history and rows
    itself (the conv state keeps that join): every keep of T = 2..8 at one offset, logits and
    committed state against serial decoding, which takes the same kernels at T = 1."""
    from state_checks import check_forced_rejections, serial_decode

    from strata_cli.bench import hybrid_probe
    from strata_cli.options import EngineOptions

    model = hybrid_probe.build_model()
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    serial = serial_decode(model, 20)
    assert check_forced_rejections(model, EngineOptions(fold=fold, partial=partial), serial, 8, 1e-5) == 35
    assert {n for kind, n in calls if kind == "prepare"} >= set(range(1, 9))  # every window size took the kernel


def test_the_start_up_probe_passes_row_invariant_kernels_and_refuses_others(monkeypatch, emulator):
    """The probe's own checks (float32 and bfloat16), run here on the emulated kernels."""
    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    assert mamba2_window.check() is None
    assert ("prepare", 8) in calls and ("scan", 1) in calls
    emulated_scan = mamba2_window.mamba2_scan

    def drifting_scan(x, Bm, Cm, dt, g, S):
        y, S = emulated_scan(x, Bm, Cm, dt, g, S)
        return y * (1 + 1e-6 * (x.shape[1] - 1)), S

    monkeypatch.setattr(mamba2_window, "mamba2_scan", drifting_scan)
    assert mamba2_window.check() == "mamba2_scan rows differ with the row count"


def test_no_kernel_off_the_gpu():
    assert mamba2_window.usable() is False and mamba2_window.status()["usable"] is False


def test_calls_pass_shapes_as_data_and_dtypes_as_template_values(monkeypatch):
    """What the wrappers hand to the GPU backend's kernel maker: shapes in `dims`, every input
    dtype, the state size (NS) and the conv's taps (KS) as template values, float32 outputs of the contract's shapes."""
    calls = []

    def fake(name, inputs, outputs, source, header=""):
        def kernel(**kw):
            calls.append((source, inputs, kw))
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return kernel

    monkeypatch.setattr(mamba2_window, "gpu_kernel", fake)
    B, T, H, P, G, N, K = 2, 3, 4, 16, 2, 32, 4
    C = H * P + 2 * G * N
    history, raw = mx.zeros((B, K - 1, C), dtype=mx.bfloat16), mx.zeros((B, T, C), dtype=mx.bfloat16)
    dt = mx.zeros((B, T, H), dtype=mx.bfloat16)
    shapes = dict(SHAPES, dt_limits=(0.001, 0.5))
    x, Bm, Cm, step, g, window = mamba2_window.mamba2_prepare(history, raw, mx.zeros((C, K), dtype=mx.bfloat16), None,
                                                              dt, mx.zeros((H,)), mx.zeros((H,)), **shapes)
    assert [a.shape for a in (x, Bm, Cm, step, g)] == [(B, T, H, P)] + [(B, T, G, N)] * 2 + [(B, T, H)] * 2
    assert window.shape == (B, K - 1 + T, C) and window.dtype == mx.bfloat16
    y, S = mamba2_window.mamba2_scan(x, Bm, Cm, step, g, mx.zeros((B, H, P, N)))
    assert y.shape == (B, T, H, P) and S.shape == (B, H, P, N)
    (prepare_source, prepare_inputs, prepare), (scan_source, _, scan) = calls
    assert prepare_source is mamba2_window.PREPARE and scan_source is mamba2_window.SCAN
    assert prepare["inputs"][0].tolist() == [B, T, H, P, G, N, K] and scan["inputs"][0].tolist() == [B, T, H, G, P]
    assert np.allclose(prepare["inputs"][prepare_inputs.index("limits")].tolist(), [0.001, 0.5])
    bias = prepare["inputs"][prepare_inputs.index("conv_bias")]
    assert bias.shape == (C,) and not bias.any().item()  # no conv bias: zeros, which add nothing
    assert [d for _, d in prepare["template"]] == [mx.bfloat16, mx.bfloat16, mx.float32, mx.bfloat16, mx.float32,
                                                   mx.float32, K]  # the dtypes, then the conv's taps (KS)
    assert dict(scan["template"])["NS"] == N and len(scan["template"]) == 7
    assert all(d == mx.float32 for d in prepare["output_dtypes"][:5] + scan["output_dtypes"])
    assert prepare["output_dtypes"][5] == mx.bfloat16  # the joined window keeps the rows' dtype
    with pytest.raises(ValueError, match="does not go with raw"):
        mamba2_window.mamba2_prepare(history[:, 1:], raw, mx.zeros((C, K), dtype=mx.bfloat16), None, dt,
                                     mx.zeros((H,)), mx.zeros((H,)), **shapes)


def test_kernel_bench_times_the_mamba2_window_on_the_cpu():
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_mamba2("mamba2", 4, 16, 2, 32, use_kernel=False, repeats=1, inner=1, peak_gbs=1.0)
    assert [r["R"] for r in records] == list(kernel_bench.ROWS)
    assert all(r["identical_to_1_row"] and r["max_abs_diff"] == 0.0 and r["ms"]["mlx"] > 0 for r in records)


def test_selftest_hybrid_check_passes_in_bfloat16_through_the_kernels(monkeypatch, emulator):
    """What `strata selftest` runs for the Mamba-2 hybrid on a GPU backend: bfloat16 weights, the
    window kernels (emulated here) in every decode window, drafts against serial decoding."""
    from strata_cli.bench import hybrid_probe, selftest
    from strata_cli.options import SpecOptions

    calls = []
    _emulated_kernels(monkeypatch, emulator, calls)
    engine = hybrid_probe.build_engine(mx.bfloat16)
    assert engine.model.layers[0].mixer.in_proj.weight.dtype == mx.bfloat16
    prompts = hybrid_probe.prompts(lambda ids, n: selftest._tokens(engine, ids, n, SpecOptions()), count=1)
    results = []
    selftest._check(engine, selftest.HYBRID, "bfloat16", prompts, 8, results, None)
    assert [r["mode"] for r in results] == ["3", "auto"] and all(r["identical"] for r in results)
    assert {n for kind, n in calls if kind == "scan"} > {1}
