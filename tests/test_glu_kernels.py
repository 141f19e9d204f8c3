"""metal_shaders/rows_matvec.py's GLU forms: gate·x and up·x in one launch, silu(gate)·up written
(issue 37), and where the model uses them.

There is no GPU here: the bodies run through scripts/lab/kernel_emulate.py (g++, float32 and
bfloat16 in software; tests/test_kernel_backends.py runs them behind the Metal prelude too).
Each row (pick) of an R-row call must equal its 1-row call bit for bit, each product must be the
plain kernel's bits, and the result must stay near the reference.
"""

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metal_shaders import backends, precompiled, probe
from metal_shaders import rows_matvec as kernels
from scripts.bench.synthetic import randomized
from scripts.lab.kernel_emulate import KINDS, raw_bits
from strata_cli.model import layers, moe
from strata_cli.model.quant import quantize

# Each body the stand-in below runs, by the emulator kind that runs it (the column-mapped forms'
# too: tests/test_mapped_kernels.py).
EMULATED = {id(body): kind for kind, (_, body, _) in KINDS.items()}
DROPPED = {"activation": "#define STRATA_GLU(G, U) ((G) * (U))\n",
           "up projection": "#define STRATA_GLU(G, U) ((G) / (1.0f + expf(-(G))))\n"}


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.Emulator(tmp_path_factory.mktemp("glu-emulate"))


@pytest.mark.parametrize("kind, dtype, bits, gs", [
    ("gather_glu", mx.bfloat16, 4, 64),  # Qwen3-Next-80B's routed experts
    ("quantized_glu", mx.bfloat16, 4, 64),  # its shared expert
    ("quantized_glu", mx.float32, 8, 32),
    ("dense_glu", mx.float32, 4, 64),
])
def test_emulated_glu_is_row_invariant_each_product_the_plain_kernels(emulate, emulator, kind, dtype, bits, gs):
    """(kernel_emulate.py runs R = 1..8 and more forms.)"""
    assert emulate.check_glu(emulator, kind, dtype=dtype, bits=bits, gs=gs, rows=(1, 3, 8))


@pytest.mark.parametrize("dropped", DROPPED)
def test_the_check_fails_a_body_that_drops_the_activation_or_the_up(emulate, tmp_path, dropped):
    wrong = emulate.Emulator(tmp_path)
    wrong.glu = DROPPED[dropped]
    assert not emulate.check_glu(wrong, "quantized_glu", rows=(2,))


def test_the_reference_is_silu_of_the_gate_times_the_up_rounded_once():
    gate = mx.array([[0.0, 1.0, -2.0]])
    up = mx.array([[3.0, 2.0, 0.5]])
    got = kernels.reference_glu(gate, up)
    assert np.allclose(np.array(got), [[0.0, 2.0 / (1 + np.exp(-1.0)), -1.0 / (1 + np.exp(2.0))]], rtol=1e-6)
    assert mx.allclose(got, layers.swiglu(gate, up), rtol=1e-6).item()
    low = kernels.reference_glu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16))
    assert low.dtype == mx.bfloat16 and mx.array_equal(low, got.astype(mx.bfloat16)).item()


def test_glu_calls_launch_half_the_columns_a_warp_with_two_accumulators_each(monkeypatch):
    """The GLU forms' grid covers N with GLU_COLS columns a warp; their COLS template value is
    twice that (a gate and an up accumulator per column); shapes as the plain calls give them."""
    calls = []

    def fake(name, inputs, source, extra=""):
        def kernel(**kw):
            calls.append((name, inputs, source, extra, kw))
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    N, K = 40, 128
    w = mx.zeros((N, K))
    q = mx.quantize(w, 64, 4)
    eq = mx.quantize(mx.zeros((3, N, K)), 64, 4)
    x = mx.zeros((1, 3, K), dtype=mx.bfloat16)
    assert kernels.rows_glu_matvec(x, w, w).shape == (1, 3, N)
    assert kernels.rows_glu_qmatvec(x, q, q, group_size=64, bits=4).shape == (1, 3, N)
    picks = kernels.rows_gather_glu_qmatvec(x, eq, eq, mx.zeros((6,), dtype=mx.uint32), group_size=64, bits=4)
    assert picks.shape == (1, 3, 2, N)  # two picks a row, as rows_gather_qmatvec's shared rows
    blocks = -(-N // (kernels.WARPS * kernels.GLU_COLS))
    sources = [kernels.DENSE_GLU, kernels.QUANTIZED_GLU, kernels.GATHER_QUANTIZED_GLU]
    for (name, inputs, source, extra, kw), body in zip(calls, sources):
        assert source is body and extra == kernels.GLU_HEADER and "glu" in name
        assert dict(kw["template"])["COLS"] == 2 * kernels.GLU_COLS and dict(kw["template"])["ROWS"] == 1 + 3 * (
            body is not kernels.GATHER_QUANTIZED_GLU)  # 3 rows: the 4-row compile; picks: one a block
        assert kw["grid"][0] == blocks * kernels.WARPS * 32
        # the routed GLU's lane loop unrolls by the process's GLU_UNROLL (scripts/lab/glu_unroll.py)
        routed = body is kernels.GATHER_QUANTIZED_GLU
        assert dict(kw["template"]).get("UNROLL") == (kernels.GLU_UNROLL if routed else None)
    assert "#pragma unroll (ROWS > 2 ? 1 : UNROLL)" in kernels.GATHER_QUANTIZED_GLU
    assert calls[2][4]["grid"][1] == 6 and calls[2][4]["inputs"][0].tolist() == [6, K, N, 2]
    assert calls[1][1] == ["dims", "x", "w", "scales", "biases", "w_up", "scales_up", "biases_up"]


def test_glu_bodies_reduce_in_an_order_set_by_k_alone():
    """As the plain bodies: the row count only ends the loops over rows; the gate's and the
    up's accumulators are the plain body's columns, read from each matrix."""
    for source in (kernels.DENSE_GLU, kernels.QUANTIZED_GLU, kernels.GATHER_QUANTIZED_GLU):
        assert "for (int u = lane; u < KC; u += 32)" in source
        assert source.count("if (r >= R) break;") == 1 and "atomic" not in source
        assert source.endswith(kernels._GLU_TAIL) and "STRATA_GLU(gate, up)" in source  # the butterfly's tree
        assert "(c < HALF ? " in source and "n0 + c % HALF" in source
        inputs = ["dims", "x", "w", "scales", "biases", "w_up", "scales_up", "biases_up", "idx"]
        assert not precompiled.reads_shapes(source, inputs)  # strata's CUDA build keeps its cubin


# -- the model's use ----------------------------------------------------------------------------

def emulated_kernel(emu, calls):
    """A stand-in for rows_matvec's `gpu_kernel`: the g++ emulation of the body, with the launch
    the module asks for (its grid and template values, sizes as data)."""
    def make(name, inputs, outputs, source, header="", *, ensure_row_contiguous=True):
        kind = EMULATED[id(source)]
        glu = kind.endswith("_glu")
        assert header == kernels.HEADER + (kernels.GLU_HEADER if glu else "") and ensure_row_contiguous

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            values = dict(template)
            dtype = values["T"]
            assert values.get("TW", dtype) == dtype and values.get("TS", dtype) == dtype  # the emulator's typing
            shapes = np.array(inputs[0]).tolist()
            N = shapes[2]
            cols = values["COLS"] // 2 if glu else values["COLS"]
            config = (kernels.glu_launch_config if glu else kernels.launch_config)(values["ROWS"], N, cols=cols)
            assert (grid[0], threadgroup) == (config["grid"][0], config["threadgroup"])
            calls.append((kind, shapes[0]))
            arrays = [np.array(a) if a.dtype in (mx.int32, mx.uint32) else raw_bits(a) for a in inputs]
            out = emu.launch(kind, arrays, rows=values["ROWS"], blocks_y=grid[1], N=N, out_rows=shapes[0],
                             bits=values.get("BITS", 0), gs=values.get("GS", 0), cols=cols, dtype=dtype)
            return [mx.array(out).astype(output_dtypes[0]).reshape(output_shapes[0])]
        return launch
    return make


def quantized_block(dtype=mx.float32):
    """A Qwen3-Next-style block (routed experts, a gated shared expert, stacked router), 4-bit."""
    b = moe.SparseMoeBlock(hidden_size=64, expert_size=32, num_experts=16, top_k=4, norm_topk_prob=True,
                           shared_expert_size=32)
    randomized(b, 30, scale=0.3)
    b.set_dtype(dtype)
    quantize(b, group_size=32, bits=4)
    b.stack_linears()
    mx.eval(b.parameters())
    return b


def run_through(monkeypatch, emu, module, x):
    """`module(x)` with every row kernel usable and emulated, and the kernels' calls."""
    calls = []
    with monkeypatch.context() as m:
        m.setattr(layers.CpuShortCalls, "mode", "never")
        m.setattr(kernels, "kernels_usable", lambda dtype=None: True)
        m.setattr(kernels, "glu_usable", lambda dtype=None: True)
        m.setattr(kernels, "gpu_kernel", emulated_kernel(emu, calls))
        return module(x), calls


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_moe_window_through_the_glu_kernels_equals_mlx_ops(monkeypatch, emulator, dtype):
    """A 5-row window of a 4-bit Qwen3-Next-style block: the routed experts' gate and up in one
    GLU launch, the shared expert's from its two linears' weights in another, within rounding
    of MLX's ops (float32: the sums' order; bfloat16: a few roundings, as MLX's swiglu rounds
    each step)."""
    b = quantized_block(dtype)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2)).astype(dtype)
    expected = b(x)  # the CPU: MLX's ops
    got, calls = run_through(monkeypatch, emulator, b, x)
    assert [kind for kind, _ in calls] == ["quantized", "gather_glu", "gather", "quantized_glu", "quantized"]
    assert calls[1][1] == 20 and calls[3][1] == 5  # 5 rows, 4 picks each
    scale = mx.abs(expected).max().item()
    tol = 1e-5 if dtype == mx.float32 else 2**-5
    assert (mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)) <= tol * scale).all().item()


@pytest.mark.parametrize("dropped", DROPPED)
def test_the_block_test_fails_a_kernel_that_drops_the_activation_or_the_up(monkeypatch, emulate, tmp_path, dropped):
    b = quantized_block()
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    expected = b(x)
    wrong = emulate.Emulator(tmp_path)
    wrong.glu = DROPPED[dropped]
    got, calls = run_through(monkeypatch, wrong, b, x)
    assert len(calls) == 5
    assert not mx.allclose(got, expected, rtol=1e-2, atol=1e-3).item()


@pytest.mark.parametrize("quantized", [False, True])
def test_a_dense_mlp_window_takes_one_glu_launch(monkeypatch, emulator, quantized):
    mlp = randomized(layers.MLP(64, 96), 40)
    if quantized:
        quantize(mlp, group_size=32, bits=4)
    x = mx.random.normal((1, 3, 64), key=mx.random.key(3))
    expected = mlp(x)
    got, calls = run_through(monkeypatch, emulator, mlp, x)
    plain = "quantized" if quantized else "dense"
    assert calls == [(f"{plain}_glu", 3), (plain, 3)]
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()


def test_prompt_chunks_the_cpu_never_mode_and_mixed_forms_keep_mlx_ops(monkeypatch):
    def unexpected(*args, **kwargs):
        raise AssertionError("a GLU kernel was called")

    for name in ("rows_glu_matvec", "rows_glu_qmatvec", "rows_gather_glu_qmatvec"):
        monkeypatch.setattr(kernels, name, unexpected)
    mlp = randomized(layers.MLP(64, 96), 40)
    assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.up_proj) is None  # the CPU: no probe passes
    monkeypatch.setattr(kernels, "glu_usable", lambda dtype=None: True)
    assert layers.gate_up_kernel(mx.zeros((9, 64)), mlp.gate_proj, mlp.up_proj) is None  # a prompt chunk
    mlp.up_proj = nn.Linear(64, 96, bias=False)  # not a row linear
    assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.up_proj) is None
    mlp.up_proj = layers.RowLinear(64, 96, bias=True)  # a bias: another form
    assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.up_proj) is None
    q = randomized(layers.MLP(64, 96), 41)
    quantize(q, group_size=32, bits=4)
    q.up_proj = layers.RowQuantizedLinear.from_linear(layers.RowLinear(64, 96, bias=False), 64, 4)
    assert layers.gate_up_kernel(mx.zeros((2, 64)), q.gate_proj, q.up_proj) is None  # another group size
    monkeypatch.setattr(layers.RowSplit, "mode", "never")
    assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.gate_proj) is None


def test_clamped_experts_keep_their_activation(monkeypatch):
    """A family's clamped SwiGLU (DeepSeek-V4's, here on affine experts) never takes the GLU
    kernel, whose activation is plain SwiGLU's."""
    from functools import partial

    from strata_cli.model.deepseek_v4 import clamped_swiglu

    glu = randomized(moe.SwitchGLU(128, 64, 6, activation=partial(clamped_swiglu, limit=10.0)), 50)
    glu = glu.to_quantized(group_size=64, bits=4)
    monkeypatch.setattr(kernels, "glu_usable", lambda dtype=None: True)
    assert not glu.takes_gate_up(mx.zeros((2, 128)))
    plain = randomized(moe.SwitchGLU(128, 64, 6), 50).to_quantized(group_size=64, bits=4)
    assert plain.takes_gate_up(mx.zeros((2, 128)))


def test_a_failing_glu_probe_turns_only_the_glu_forms_off(monkeypatch, caplog):
    """Stand-in Metal makers return zeros: the GLU probe disagrees with the reference and turns
    the GLU forms off (logged once); the MLP then runs its linears and swiglu."""
    made = []

    def make(**spec):
        made.append(spec)

        def launch(**kw):
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return launch

    monkeypatch.setattr(mx.fast, "metal_kernel", make)
    monkeypatch.setattr(probe, "_kernels", {})
    monkeypatch.setattr(probe, "backend", lambda: backends.METAL)
    monkeypatch.setattr(kernels, "_glu_probe", probe.Probe("row-invariant GLU kernels", "MLX ops"))
    mlp = randomized(layers.MLP(64, 96), 40)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.up_proj) is None
    assert "row-invariant GLU kernels disabled" in caplog.text
    assert kernels.glu_status()["error"] == "GLU kernel and reference disagree (mlx.core.float32)"  # zeros: invariant
    assert made[0]["source"] == backends.source(backends.METAL, kernels.DENSE_GLU)
    count = len(made)
    assert layers.gate_up_kernel(mx.zeros((2, 64)), mlp.gate_proj, mlp.up_proj) is None
    assert len(made) == count  # decided once per process


def test_columns_a_warp_are_read_at_each_call(monkeypatch):
    """GLU_COLS (a launch setting: it moves no sum) is the module's at the call, so a study may set it."""
    two = kernels.glu_launch_config(1, 512)
    monkeypatch.setattr(kernels, "GLU_COLS", 1)
    one = kernels.glu_launch_config(1, 512)
    assert dict(two["template"])["COLS"] == 4 and dict(one["template"])["COLS"] == 2
    assert one["grid"][0] == 2 * two["grid"][0] and kernels.glu_launch_config(1, 512, cols=2) == two
