"""metal_shaders/gated_norm.py: a recurrent layer's gated RMSNorm in one kernel, its reference,
and where the layers use it (GatedRMSNorm for GDN, GroupedGatedRMSNorm for Mamba-2).

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, a block's
threads at once, bfloat16 in software; tests/test_kernel_backends.py runs it behind the Metal
prelude too). Each row of an R-row call must equal its 1-row call bit for bit, and the output
must stay within gated_norm.TOLERANCE of the reference (the layers' own MLX ops).
"""

import logging
import math

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import backends, gated_norm, probe
from strata_cli.model.layers import CpuShortCalls, GatedRMSNorm, RowSplit
from strata_cli.model.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer

EPS = 1e-6


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.GatedNormEmulator(tmp_path_factory.mktemp("gated-norm-emulate"))


@pytest.fixture
def mlx_forms(monkeypatch):
    """The MLX forms a GPU runs (no numpy linears, no host traces): the layer ends run eagerly,
    so the emulated kernel can stand in."""
    monkeypatch.setattr(CpuShortCalls, "mode", "never")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_reference_is_the_layers_own_ops_bit_for_bit_on_the_cpu(dtype):
    y, z, weight = gated_norm.probe_inputs(4, 16, dtype=dtype, seed=1)
    norm = GatedRMSNorm(16, EPS)
    norm.weight = weight
    spec = {"groups": 4, "group_size": 16}
    expected = gated_norm.reference_gated_norm(y[None], z[None], weight, EPS, **spec)  # (1, 8, C), as a window
    assert expected.dtype == dtype and expected.shape == (1, 8, 64)
    assert mx.array_equal(expected[0], norm(y, z.reshape(8, 4, 16)).reshape(8, 64)).item()
    assert mx.array_equal(expected[0], norm.over_heads(y, z, mx.tile(weight, 4))).item()
    assert mx.array_equal(expected[0, 1], mx.zeros((64,), dtype=dtype)).item()  # the zero row
    y, z, weight = gated_norm.probe_inputs(2, 24, dtype=dtype, tiled=True, seed=2)
    grouped = GroupedGatedRMSNorm(48, 2, EPS)
    grouped.weight = weight
    expected = gated_norm.reference_gated_norm(y, z, weight, EPS, groups=2, group_size=24, gate_first=True)
    assert mx.array_equal(expected, grouped(y.reshape(8, 48), z)).item()


CASES = [  # (groups, group size, dtype, gate_first, tiled weight)
    (32, 128, mx.bfloat16, False, False),  # Qwen3-Next-80B's value heads
    (32, 128, mx.float32, False, True),
    (3, 130, mx.bfloat16, False, True),  # an odd size: threads past D idle, PER 1
    (1, 37, mx.float32, False, False),
    (8, 1024, mx.bfloat16, True, True),  # Nemotron-H's groups, Mamba-2's form
    (2, 1000, mx.float32, True, True),
]


@pytest.mark.parametrize("groups, group_size, dtype, gate_first, tiled", CASES)
def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator, groups, group_size, dtype,
                                                                    gate_first, tiled):
    """(kernel_emulate.py runs R = 1..8.)"""
    assert emulate.check_gated_norm(emulator, groups, group_size, rows=(1, 3, 8), dtype=dtype, gate_first=gate_first,
                                    tiled=tiled)


def test_the_emulated_bfloat16_gdn_form_is_the_layers_bits_on_these_inputs(emulator):
    """Where the sums round alike (bfloat16 hides the float32 sum's order), the kernel's output
    is MLX's ops' bits: the cast of y, the rounded normed value, the product in bfloat16."""
    y, z, weight = gated_norm.probe_inputs(32, 128, rows=2, dtype=mx.bfloat16, seed=3)
    got = emulator.run(y, z, weight, EPS, groups=32, group_size=128)
    assert mx.array_equal(got, gated_norm.reference_gated_norm(y, z, weight, EPS, groups=32, group_size=128)).item()


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path):
    drifting = emulate.GatedNormEmulator(tmp_path)
    drifting.source = gated_norm.SOURCE.replace("float s = 0.0f;", "float s = 1e-3f * dims[0];")
    assert drifting.source != gated_norm.SOURCE
    assert not emulate.check_gated_norm(drifting, 3, 130, rows=(3,))


def test_supported_shapes_and_launch():
    assert gated_norm.supports(128) and gated_norm.supports(8192) and not gated_norm.supports(8193)
    assert not gated_norm.supports(0)
    assert (gated_norm.warps(128), gated_norm.per_thread(128)) == (4, 1)
    assert (gated_norm.warps(130), gated_norm.per_thread(130)) == (5, 1)
    assert (gated_norm.warps(1024), gated_norm.per_thread(1024)) == (8, 4)
    assert (gated_norm.warps(8192), gated_norm.per_thread(8192)) == (8, 32)
    assert gated_norm.launch(3, 32, 128) == {"grid": (3 * 32 * 128, 1, 1), "threadgroup": (128, 1, 1)}
    y, z, w = mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 256)), mx.zeros((64,))
    spec = {"groups": 4, "group_size": 64}
    assert gated_norm.takes(y, z, w, **spec) and gated_norm.takes(y, z.reshape(y.shape), w, **spec)
    assert gated_norm.takes(y, z, mx.zeros((256,)), **spec)  # tiled
    assert not gated_norm.takes(y, z, mx.zeros((128,)), **spec)
    assert not gated_norm.takes(y.astype(mx.bfloat16), z, w, **spec)  # y is the recurrence's float32
    assert not gated_norm.takes(y, z.astype(mx.bfloat16), w, **spec)  # a weight in another dtype
    assert not gated_norm.takes(y[:, :2], z, w, **spec)
    assert not gated_norm.usable(mx.float16)  # float32 and bfloat16 only


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body (`emu.source`) with the
    launch the module asks for (grid, compiled PER and WARPS, T, the form, sizes as data)."""
    def make(name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        assert (body, header, inputs, outputs, ensure_row_contiguous) == (
            gated_norm.SOURCE, "", gated_norm.INPUTS, ["out"], True)

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            R, G, D, step = np.array(inputs[0]).tolist()
            eps, y, z, weight = inputs[1:]
            values = dict(template)
            assert values == {"T": z.dtype, "PER": gated_norm.per_thread(D), "WARPS": gated_norm.warps(D),
                              "GATE_FIRST": values["GATE_FIRST"]}
            assert step == (0 if weight.size == D else D)
            assert (grid, threadgroup) == tuple(gated_norm.launch(R, G, D).values())
            assert output_dtypes == [z.dtype] and output_shapes == [z.shape]
            calls.append(R)
            return [emu.run(y, z, weight, eps.item(), groups=G, group_size=D, gate_first=values["GATE_FIRST"])]
        return launch
    return make


def qwen3_next_gdn(dtype=mx.float32):
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    mixer = random_model(tiny_qwen3_next_config(), seed=5).model.layers[0].mixer  # a GDN layer
    mixer.norm.weight = 1.0 + 0.5 * mx.random.normal(mixer.norm.weight.shape, key=mx.random.key(11))
    mixer.set_dtype(dtype)
    mixer.tile_norm_weight()  # as loading does: the stacked projections' z stays flat
    mx.eval(mixer.parameters())
    return mixer


def gdn_tail_inputs(mixer, T: int, dtype=mx.float32):
    """The recurrence's y (1, T, Hv, Dv) float32 and the gate z (1, T, Hv·Dv) for a T-row window."""
    Hv, Dv = mixer.num_v_heads, mixer.head_v_dim
    y = mx.random.normal((1, T, Hv, Dv), key=mx.random.key(T))
    z = (2.0 * mx.random.normal((1, T, Hv * Dv), key=mx.random.key(20 + T))).astype(dtype)
    return y, z


BROKEN = {  # bodies that drop one part of GDN's form
    "gate": ("static_cast<float>(p) * (g * (g < 0.0f ? e : 1.0f - e))", "static_cast<float>(p)"),
    "weight": ("const float w = wv[j];", "const float w = 1.0f;"),
    "norm": ("rsqrtf(total / static_cast<float>(D) + epsilon)", "1.0f"),
}


@pytest.mark.parametrize("flat_gate", [True, False], ids=["stacked", "by-heads"])
def test_a_gdn_layers_tail_through_the_kernel_equals_mlx_ops_and_misses_no_operand(monkeypatch, mlx_forms, emulate,
                                                                                  emulator, tmp_path, flat_gate):
    """The GDN tail (gated norm, then out_proj), with the (emulated) kernel, equals its MLX ops'
    within float32 rounding, row by row as the 1-row calls; the gate as the stacked projections
    give it (flat, the tiled weight) or by heads (the norm's own weight). Bodies that drop the
    gate, the weight or the norm are caught."""
    mixer = qwen3_next_gdn()
    y, z = gdn_tail_inputs(mixer, 5)
    if not flat_gate:
        z = z.reshape(y.shape)
    expected = mixer.tail(y, z)  # the CPU: MLX's ops
    calls = []
    monkeypatch.setattr(gated_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(gated_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    got = mixer.tail(y, z)
    assert calls == [5] and got.shape == expected.shape
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()
    alone = mx.concatenate([mixer.tail(y[:, t : t + 1], z[:, t : t + 1]) for t in range(5)], axis=1)
    assert calls == [5] + [1] * 5
    assert mx.array_equal(got, alone).item()
    for old, new in BROKEN.values():
        emu = emulate.GatedNormEmulator(tmp_path)
        emu.source = gated_norm.SOURCE.replace(old, new)
        assert emu.source != gated_norm.SOURCE
        monkeypatch.setattr(gated_norm, "gpu_kernel", emulated_kernel(emu, calls))
        assert not mx.allclose(mixer.tail(y, z), expected, rtol=1e-2, atol=1e-3).item()


def test_a_bfloat16_gdn_tail_through_the_kernel_stays_near_mlx_ops(monkeypatch, mlx_forms, emulator):
    mixer = qwen3_next_gdn(mx.bfloat16)
    y, z = gdn_tail_inputs(mixer, 3, mx.bfloat16)
    expected = mixer.tail_input(y, z)
    calls = []
    monkeypatch.setattr(gated_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(gated_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    got = mixer.tail_input(y, z)
    assert calls == [3] and got.dtype == mx.bfloat16
    assert mx.array_equal(got, expected).item()  # these inputs: every value MLX's bits
    assert mx.allclose(mixer.tail(y, z).astype(mx.float32), mixer.out_proj(expected).astype(mx.float32)).item()


def mamba2_mixer():
    mixer = Mamba2Mixer(hidden_size=32, num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4, eps=1e-5,
                        time_step_limit=(0.0, math.inf))
    keys = mx.random.split(mx.random.key(7), 2)
    mixer.out_proj.weight = mx.random.normal(mixer.out_proj.weight.shape, key=keys[0]) * 128**-0.5
    mixer.norm.weight = 1.0 + 0.5 * mx.random.normal(mixer.norm.weight.shape, key=keys[1])
    mx.eval(mixer.parameters())
    return mixer


def test_a_mamba2_tail_through_the_kernel_equals_mlx_ops_and_misses_no_operand(monkeypatch, mlx_forms, emulate,
                                                                               emulator, tmp_path):
    """Mamba-2's grouped norm (the gate before the norm, the weight after, 2 groups of 64) through
    the kernel's gate-first form: within float32 rounding of MLX's ops, row by row as the 1-row
    calls; bodies without the gate, the weight or the norm are caught."""
    mixer = mamba2_mixer()
    y = mx.random.normal((1, 4, 128), key=mx.random.key(1))
    z = 2.0 * mx.random.normal((1, 4, 128), key=mx.random.key(2))
    expected = mixer.tail(y, z)
    calls = []
    monkeypatch.setattr(gated_norm, "usable", lambda dtype=None: True)
    monkeypatch.setattr(gated_norm, "gpu_kernel", emulated_kernel(emulator, calls))
    got = mixer.tail(y, z)
    assert calls == [4]
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()
    alone = mx.concatenate([mixer.tail(y[:, t : t + 1], z[:, t : t + 1]) for t in range(4)], axis=1)
    assert mx.array_equal(got, alone).item()
    for old, new in (("v[j] = v[j] * (g * (g < 0.0f ? e : 1.0f - e));", "v[j] = v[j];"),
                     BROKEN["weight"], BROKEN["norm"]):
        emu = emulate.GatedNormEmulator(tmp_path)
        emu.source = gated_norm.SOURCE.replace(old, new)
        assert emu.source != gated_norm.SOURCE
        monkeypatch.setattr(gated_norm, "gpu_kernel", emulated_kernel(emu, calls))
        assert not mx.allclose(mixer.tail(y, z), expected, rtol=1e-2, atol=1e-3).item()


def test_mlx_ops_norm_prompt_chunks_other_dtypes_and_subclasses(monkeypatch):
    monkeypatch.setattr(gated_norm, "usable", lambda dtype=None: dtype == mx.float32)

    def unexpected(*args, **kwargs):
        raise AssertionError("the gated-norm kernel was called")

    monkeypatch.setattr(gated_norm, "gated_norm", unexpected)
    norm = GatedRMSNorm(16, EPS)
    y = mx.random.normal((1, 9, 4, 16), key=mx.random.key(0))
    z = mx.random.normal((1, 9, 64), key=mx.random.key(1))
    mx.eval(norm.over_heads(y, z, mx.tile(norm.weight, 4)))  # more rows than a window
    mx.eval(norm(y[:, :2], z[:, :2].astype(mx.float16).reshape(1, 2, 4, 16)))  # a dtype whose probe did not pass
    mx.eval(norm(y[:, :2].astype(mx.bfloat16), z[:, :2].reshape(1, 2, 4, 16)))  # y not float32
    mx.eval(norm(y[:, :2, 0], z[:, :2, :16]))  # no (B, T, heads, dims) axes
    mx.eval(norm(y[:, :2], z[:, :1].reshape(1, 1, 4, 16)))  # a broadcast gate

    class Shifted(GatedRMSNorm):
        def __call__(self, x, gate):
            return super().__call__(x, gate) + 1

    mx.eval(Shifted(16, EPS)(y[:, :2], z[:, :2].reshape(1, 2, 4, 16)))
    grouped = GroupedGatedRMSNorm(64, 4, EPS)
    mx.eval(grouped(y.reshape(1, 9, 64), z))  # a prompt chunk
    monkeypatch.setattr(RowSplit, "mode", "never")
    mx.eval(norm(y[:, :2], z[:, :2].reshape(1, 2, 4, 16)), grouped(y[:, :2].reshape(1, 2, 64), z[:, :2]))


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    assert not gated_norm.usable()
    assert gated_norm.status() == {"usable": False, "probed": True, "error": None}


def test_a_failing_probe_turns_the_kernel_off_and_the_norm_falls_back(caplog, failing_metal):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the norm runs MLX's ops."""
    made = failing_metal(gated_norm, "gated-norm kernel")
    norm = GatedRMSNorm(130, EPS)
    y, z, _ = gated_norm.probe_inputs(3, 130, rows=3)
    y, z = y[None], z[None]  # a 3-row window
    expected = norm.over_heads(y, z, mx.tile(norm.weight, 3))  # the CPU: MLX's ops
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        out = norm.over_heads(y, z, mx.tile(norm.weight, 3))
    assert "gated-norm kernel disabled" in caplog.text
    assert gated_norm.status()["error"] == "gated_norm differs from the reference (G=3, D=130, mlx.core.float32)"
    assert made[0]["source"] == backends.source(backends.METAL, gated_norm.SOURCE)
    assert made[0]["header"] == backends.header(backends.METAL, "")
    assert mx.array_equal(out, expected).item()
    mx.eval(norm(y, z.reshape(y.shape)))
    assert len(made) == 1  # decided once per process
