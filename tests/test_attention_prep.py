"""metal_shaders/attention_prep.py: an attention head after its stacked projection in one kernel,
its reference, and where the attention layer uses it (the start of `GatedAttention.core`).

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, a block's
threads at once, bfloat16 in software; tests/test_kernel_backends.py runs it behind the Metal
prelude too). Each row t of an R-row call at offset p must equal its 1-row call at offset p + t
bit for bit, and the outputs must stay within attention_prep.TOLERANCE of the reference (the
head's own MLX ops and `cpu_rope`).
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import attention_prep, attention_window, backends, precompiled, probe
from strata_cli.model.attention import GatedAttention, cpu_rope
from strata_cli.model.layers import CpuShortCalls, RowSplit, stack
from state_checks import speculation_matches_serial

EPS = 1e-6


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.AttentionPrepEmulator(tmp_path_factory.mktemp("attention-prep-emulate"))


@pytest.fixture
def mlx_forms(monkeypatch):
    """The MLX forms a GPU runs (no numpy linears, no host traces), and the attention window's
    kernel as its reference (one sdpa a row): the prep kernel needs the window kernel's path."""
    monkeypatch.setattr(CpuShortCalls, "mode", "never")
    monkeypatch.setattr(attention_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_window, "attention_window", attention_window.reference_attention_window)


def attention(*, heads=4, kv_heads=2, head_dim=32, rotary_dim=16, gate=True, norm=True, dtype=mx.float32, seed=0):
    """A GatedAttention layer with random weights (norm weights away from 1), its q/k/v stacked."""
    layer = GatedAttention(hidden_size=48, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           rotary_dim=rotary_dim, rope_theta=1e4, eps=EPS, output_gate=gate, qk_norm=norm)
    keys = iter(mx.random.split(mx.random.key(seed), 8))
    for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        linear.weight = mx.random.normal(linear.weight.shape, key=next(keys)) * linear.weight.shape[1] ** -0.5
    if norm:
        layer.q_norm.weight = 1.0 + 0.5 * mx.random.normal((head_dim,), key=next(keys))
        layer.k_norm.weight = 1.0 + 0.5 * mx.random.normal((head_dim,), key=next(keys))
    layer.set_dtype(dtype)
    mx.eval(layer.parameters())
    stack(layer, "_qkv_rows", "q_proj", "k_proj", "v_proj")
    return layer


def spec_of(layer: GatedAttention) -> dict:
    norms = {"q_weight": layer.q_norm.weight, "k_weight": layer.k_norm.weight, "eps": EPS} if "q_norm" in layer else {}
    return {"num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads, "head_dim": layer.head_dim,
            "rotary_dim": layer.rotary_dim, "base": float(layer.rope_theta), "gate": layer.output_gate, **norms}


@pytest.mark.parametrize("gate, norm", [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_reference_is_the_heads_own_ops_and_cpu_rope_bit_for_bit(gate, norm, dtype):
    layer = attention(gate=gate, norm=norm, dtype=dtype)
    qkv = mx.random.normal((1, 5, attention_prep.width(4, 2, 32, gate)), key=mx.random.key(1)).astype(dtype)
    q, k, v = mx.split(qkv, layer._qkv_rows.bounds, axis=-1)
    (q, k, v), gate_out = layer.head_rest(q, k, v)
    q, k = cpu_rope(16, 1e4)(q, k, mx.array(37, dtype=mx.int32))
    expected = attention_prep.reference_attention_prep(qkv, 37, **spec_of(layer))
    assert len(expected) == 3 + len(gate_out)
    for got, want in zip(expected, (q, k, v, *gate_out)):
        assert got.dtype == dtype and mx.array_equal(got, want).item()


def test_the_reference_rope_is_mlx_fast_rope_within_rounding():
    """The GPU's prompt chunks rotate with `mx.fast.rope`; the reference (and the kernel) with
    cpu_rope's table: the same angles to float32 rounding."""
    x = mx.random.normal((1, 2, 8, 64), key=mx.random.key(2))
    for offset in (0, 4093):
        fast = mx.fast.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=offset)
        assert mx.allclose(attention_prep.reference_rope(x, offset, 32, 1e4), fast, rtol=1e-3, atol=1e-3).item()


CASES = [  # (Hq, Hkv, D, RD, gate, norm, dtype)
    (16, 2, 256, 64, True, True, mx.float32),  # Qwen3-Next-80B's attention
    (16, 2, 256, 64, True, True, mx.bfloat16),
    (4, 2, 64, 64, False, False, mx.float32),  # a plain layout: no gate, full rotary, no norm
    (4, 2, 64, 64, False, False, mx.bfloat16),
    (3, 1, 130, 32, True, False, mx.bfloat16),  # an odd size: threads past D idle
    (2, 1, 512, 128, False, True, mx.float32),  # two values a thread
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim, gate, norm, dtype", CASES)
def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator, heads, kv_heads, head_dim,
                                                                    rotary_dim, gate, norm, dtype):
    """(kernel_emulate.py runs R = 1..8.) Window offsets 0 and 4093."""
    assert emulate.check_attention_prep(emulator, heads, kv_heads, head_dim, rotary_dim, gate=gate, norm=norm,
                                        rows=(1, 3, 8), dtype=dtype)


@pytest.mark.parametrize("old, new", [
    ("float s = 0.0f;", "float s = 1e-3f * dims[0];"),  # a sum that depends on the row count
    ("offset[b] + t", "offset[b]"),  # every row at the window's first position
])
def test_the_emulator_notices_a_row_count_or_window_dependent_body(emulate, tmp_path, old, new):
    drifting = emulate.AttentionPrepEmulator(tmp_path)
    drifting.sources = {g: body.replace(old, new) for g, body in drifting.sources.items()}
    assert drifting.sources[True] != attention_prep.SOURCE
    assert not emulate.check_attention_prep(drifting, 3, 1, 130, 32, gate=True, norm=True, rows=(3,), offsets=(5,))


def test_supported_shapes_and_launch():
    assert attention_prep.supports(256, 64) and attention_prep.supports(1024, 0) and attention_prep.supports(64, 64)
    assert not attention_prep.supports(1025, 64) and not attention_prep.supports(64, 65)
    assert not attention_prep.supports(64, 66) and not attention_prep.supports(0, 0)
    assert (attention_prep.warps(256), attention_prep.per_thread(256)) == (8, 1)
    assert (attention_prep.warps(130), attention_prep.per_thread(130)) == (5, 1)
    assert (attention_prep.warps(512), attention_prep.per_thread(512)) == (8, 2)
    assert attention_prep.launch(3, 16, 2, 256) == {"grid": (3 * 20 * 256, 1, 1), "threadgroup": (256, 1, 1)}
    assert attention_prep.width(16, 2, 256, True) == 16 * 512 + 4 * 256
    assert not attention_prep.usable(mx.float16)  # float32 and bfloat16 only
    for _, _, body in attention_prep.KERNELS.values():  # sizes and the offset as data, no shapes read
        assert not precompiled.reads_shapes(body, attention_prep.INPUTS)  # strata's CUDA build keeps its cubin


def emulated_kernel(emu, calls, base):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body with the launch the
    module asks for (grid, compiled PER, WARPS and NORM, T, sizes and the offset as data)."""
    def make(name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        gate = name == attention_prep.KERNELS[True][0]
        assert (name, outputs, body) == attention_prep.KERNELS[gate]
        assert (header, inputs, ensure_row_contiguous) == ("", attention_prep.INPUTS, True)

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            T, Hq, Hkv, D, RD = np.array(inputs[0]).tolist()
            eps, offset, qkv, q_weight, k_weight, inv_freq = inputs[1:]
            values = dict(template)
            assert values == {"T": qkv.dtype, "PER": attention_prep.per_thread(D), "WARPS": attention_prep.warps(D),
                              "NORM": values["NORM"]}
            assert (grid, threadgroup) == tuple(attention_prep.launch(qkv.shape[0] * T, Hq, Hkv, D).values())
            assert mx.array_equal(inv_freq, attention_prep.inv_freq(RD, base)).item()
            rows = qkv.shape[0]  # the offset's values past B are padding (pooled.step_dims, with uploads on)
            assert offset.dtype == mx.int32 and len(set(np.array(offset).tolist()[:rows])) == 1
            calls.append((T, int(offset[0].item())))
            norms = {"q_weight": q_weight, "k_weight": k_weight, "eps": eps.item()} if values["NORM"] else {}
            outs = emu.run(qkv, int(offset[0].item()), num_heads=Hq, num_kv_heads=Hkv, head_dim=D, rotary_dim=RD,
                           base=base, gate=gate, **norms)
            assert [o.shape for o in outs] == output_shapes and [o.dtype for o in outs] == output_dtypes
            return list(outs)
        return launch
    return make


def run_layer(layer, x, state):
    core_in, tail_in = layer.head(x)
    return layer.tail(layer.core(*core_in, state), *tail_in), len(core_in)


def prefilled(layer, x, P):
    from strata_cli.engine.state import KVState, Mode

    state = KVState()
    state.begin(0, P, Mode.COMMIT_ALL)
    layer(x[:, :P], state)  # a prompt chunk: MLX's ops
    return state


BROKEN = {  # bodies that drop one part of the head
    "norm": ("rsqrtf(total / static_cast<float>(D) + epsilon)", "1.0f"),
    "rope": ("const float theta = p * fv[j];", "const float theta = 0.0f;"),
    "gate": ("gate[g + i] = qkv[in + D + i];", "gate[g + i] = static_cast<T>(0.0f);"),
}


def test_an_attention_layer_through_the_kernel_equals_mlx_ops_and_misses_no_part(monkeypatch, mlx_forms, emulate,
                                                                                 emulator, tmp_path):
    """A Qwen3-Next-shaped attention layer (output gate, partial rotary, q/k norm) at a window of
    3 rows after a 17-row prompt: through the (emulated) kernel it equals MLX's ops (split,
    norms, transposes, mx.fast.rope) within float32 rounding, each row as its serial 1-row step
    bit for bit; bodies that drop the norm, the rope or the gate are caught."""
    from strata_cli.engine.state import Mode

    layer = attention()
    x = mx.random.normal((1, 20, 48), key=mx.random.key(3))
    calls = []
    monkeypatch.setattr(attention_prep, "usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(emulator, calls, 1e4))
    kernel_state, mlx_state, serial_state = (prefilled(layer, x, 17) for _ in range(3))
    assert calls == []  # prompt chunks keep MLX's ops
    kernel_state.begin(17, 3, Mode.WINDOW)
    got, inputs = run_layer(layer, x[:, 17:], kernel_state)
    assert inputs == 1 and calls == [(3, 17)]  # the stacked rows went to the core's kernel
    serial = []
    for t in range(17, 20):
        serial_state.begin(t, 1, Mode.COMMIT_ALL)
        serial.append(run_layer(layer, x[:, t : t + 1], serial_state)[0])
    assert calls[1:] == [(1, 17), (1, 18), (1, 19)]
    assert mx.array_equal(got, mx.concatenate(serial, axis=1)).item()
    monkeypatch.setattr(RowSplit, "mode", "never")  # MLX's ops whole
    mlx_state.begin(17, 3, Mode.WINDOW)
    expected, inputs = run_layer(layer, x[:, 17:], mlx_state)
    assert inputs == 3 and len(calls) == 4
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()
    monkeypatch.setattr(RowSplit, "mode", "always")
    for old, new in BROKEN.values():
        emu = emulate.AttentionPrepEmulator(tmp_path)
        emu.sources = {g: body.replace(old, new) for g, body in emu.sources.items()}
        assert emu.sources[True] != attention_prep.SOURCE
        monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(emu, calls, 1e4))
        state = prefilled(layer, x, 17)
        state.begin(17, 3, Mode.WINDOW)
        broken, _ = run_layer(layer, x[:, 17:], state)
        assert not mx.allclose(broken, expected, rtol=1e-2, atol=1e-3).item()


def test_a_plain_bfloat16_layer_through_the_kernel_stays_near_mlx_ops(monkeypatch, mlx_forms, emulator):
    """No gate, full rotary, no norm, bfloat16: within a rounding of MLX's ops."""
    from strata_cli.engine.state import Mode

    layer = attention(gate=False, norm=False, rotary_dim=32, dtype=mx.bfloat16, seed=4)
    x = mx.random.normal((1, 12, 48), key=mx.random.key(5)).astype(mx.bfloat16)
    calls = []
    monkeypatch.setattr(attention_prep, "usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(emulator, calls, 1e4))
    kernel_state, mlx_state = prefilled(layer, x, 10), prefilled(layer, x, 10)
    kernel_state.begin(10, 2, Mode.WINDOW)
    got, _ = run_layer(layer, x[:, 10:], kernel_state)
    assert calls == [(2, 10)]
    monkeypatch.setattr(RowSplit, "mode", "never")
    mlx_state.begin(10, 2, Mode.WINDOW)
    expected, _ = run_layer(layer, x[:, 10:], mlx_state)
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), rtol=2e-2, atol=2e-2).item()


@pytest.mark.parametrize("uploads", [False, True])
def test_speculation_through_the_kernel_is_token_identical_to_serial(monkeypatch, mlx_forms, emulator, uploads):
    """The tiny Qwen3-Next model decoding with the (emulated) prep kernel: speculative windows
    (drafts kept and rejected) give serial decoding's tokens, and both take the kernel; with
    uploads on (CUDA's path) too, where the offset comes padded from pooled.step_dims."""
    from metal_shaders import pooled
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import EngineOptions

    monkeypatch.setattr(probe, "_upload", {"enabled": uploads, "device": mx.default_device(), "on": uploads})
    monkeypatch.setattr(pooled, "_step_dims", {})
    model = random_model(tiny_qwen3_next_config(head_dim=32), seed=2)
    layer = next(m for _, m in model.named_modules() if type(m) is GatedAttention)
    calls = []
    monkeypatch.setattr(attention_prep, "usable", lambda dtype=None: True)
    monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(emulator, calls, float(layer.rope_theta)))
    speculation_matches_serial(WindowEngine(model, EngineOptions()), calls, rows_of=lambda call: call[0], max_tokens=10)


def test_mlx_ops_run_prompt_chunks_other_dtypes_unstacked_layers_and_subclasses(monkeypatch, mlx_forms):
    monkeypatch.setattr(attention_prep, "usable", lambda dtype=None: dtype == mx.float32)

    def unexpected(*args, **kwargs):
        raise AssertionError("the attention-prep kernel was called")

    monkeypatch.setattr(attention_prep, "attention_prep", unexpected)
    layer = attention()
    x = mx.random.normal((1, 9, 48), key=mx.random.key(6))
    assert len(layer.head(x)[0]) == 3  # more rows than a window
    assert layer.takes_prep(2, mx.float32) and not layer.takes_prep(2, mx.float16)  # a dtype whose probe did not pass
    assert not layer.takes_prep(9, mx.float32) and attention(rotary_dim=0).takes_prep(2, mx.float32)  # NoPE too
    layer.__dict__.pop("_qkv_rows")
    assert not layer.takes_prep(2, mx.float32) and len(layer.head(x[:, :2])[0]) == 3  # no stack

    class OwnCore(GatedAttention):
        def core(self, q, k, v, state):
            return super().core(q, k, v, state)

    sub = OwnCore(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=16, rope_theta=1e4, eps=EPS)
    stack(sub, "_qkv_rows", "q_proj", "k_proj", "v_proj")
    assert not sub.takes_prep(2, mx.float32) and len(sub.head(x[:, :2])[0]) == 3
    stacked_layer = attention()
    monkeypatch.setattr(RowSplit, "mode", "never")
    assert not stacked_layer.takes_prep(2, mx.float32)


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    assert not attention_prep.usable()
    assert attention_prep.status() == {"usable": False, "probed": True, "error": None}


def test_the_start_up_probe_passes_the_emulated_kernel_and_refuses_a_drifting_one(monkeypatch, emulate, emulator,
                                                                                  tmp_path):
    """`check` (the probe's body) over its own cases with the emulated kernel: None; with a
    body whose rows see the window's first position, what failed."""
    monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(emulator, [], 1e7))
    cases = [case for case in attention_prep.PROBE_CASES if case[7] == 1e7]
    assert attention_prep.check(cases) is None
    drifting = emulate.AttentionPrepEmulator(tmp_path)
    drifting.sources = {g: body.replace("offset[b] + t", "offset[b]") for g, body in drifting.sources.items()}
    monkeypatch.setattr(attention_prep, "gpu_kernel", emulated_kernel(drifting, [], 1e7))
    assert attention_prep.check(cases[:1]).startswith("attention_prep rows differ with the row count")


def test_a_failing_probe_turns_the_kernel_off_and_the_head_falls_back(caplog, failing_metal, mlx_forms):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the head runs MLX's ops."""
    made = failing_metal(attention_prep, "attention-prep kernel")
    layer = attention()
    x = mx.random.normal((1, 3, 48), key=mx.random.key(7))
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        core_in, _ = layer.head(x)
    assert len(core_in) == 3
    assert "attention-prep kernel disabled" in caplog.text
    assert attention_prep.status()["error"].startswith("attention_prep differs from the reference")
    assert made[0]["source"] in {backends.source(backends.METAL, body) for _, _, body in attention_prep.KERNELS.values()}
    layer.head(x)
    assert len(made) == 1  # decided once per process
