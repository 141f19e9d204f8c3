"""metal_shaders/moe_combine.py: a MoE layer's combine (weighted picks, renormalised or not, plus
a shared expert's gated output, plus the decoder layer's residual) in one kernel, its reference,
and where the MoE blocks and the decoder layer use it.

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, bfloat16 rounded
as the GPUs round it; tests/test_kernel_backends.py runs it behind the Metal prelude too). Each
row of an R-row call must equal its 1-row call bit for bit and stay within one output rounding
(plus 1e-6 of the row's largest value) of the reference.
"""

import logging
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metal_shaders import backends, moe_combine, probe, router_window
from scripts.bench.synthetic import randomized
from strata_cli.model import layers, moe
from strata_cli.model.decoder_layer import PreNormLayer

VARIANTS = {name: variant for variant, (name, _, _) in moe_combine.KERNELS.items()}  # (has_shared, has_residual)


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.CombineEmulator(tmp_path_factory.mktemp("combine-emulate"))


def test_the_reference_is_the_weighted_sum_renormalised_plus_the_gated_shared_output():
    picks = mx.array([[[1.0, 2.0], [3.0, -4.0]]])  # (1, k=2, H=2)
    weights = mx.array([[0.1, 0.3]])
    shared, gates = mx.array([[2.0, 1.0]]), mx.array([[5.0, 0.0, -1.0]])
    plain = moe_combine.reference_moe_combine(picks, weights)
    assert np.allclose(np.array(plain), [[1.0, -1.0]], rtol=1e-6)
    normed = moe_combine.reference_moe_combine(picks, weights, normalize=True)
    assert np.allclose(np.array(normed), [[2.5, -2.5]], rtol=1e-6)
    gated = moe_combine.reference_moe_combine(picks, weights, normalize=True, shared=shared, gates=gates,
                                              gate_column=1)  # sigmoid(0) = 1/2
    assert np.allclose(np.array(gated), [[3.5, -2.0]], rtol=1e-6)
    folded = moe_combine.reference_moe_combine(picks, weights, normalize=True, shared=shared, gates=gates,
                                               gate_column=1, residual=mx.array([[10.0, 20.0]]))
    assert np.allclose(np.array(folded), [[13.5, 18.0]], rtol=1e-6)
    assert moe_combine.reference_moe_combine(picks.astype(mx.bfloat16), weights).dtype == mx.bfloat16


@pytest.mark.parametrize("normalize", [True, False])
def test_the_reference_matches_the_blocks_mlx_ops(normalize):
    picks, weights, shared, gates = moe_combine.probe_inputs(64, 4, rows=3)
    routed = moe.picks_sum(picks, weights, normalize=normalize)  # the CPU: MLX's compiled ops
    expected = moe.add_gated(routed, shared, gates[:, 2:])
    got = moe_combine.reference_moe_combine(picks, weights, normalize=normalize, shared=shared, gates=gates,
                                            gate_column=2)
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("H, k, dtype, normalize, has_shared", [
    (2048, 10, mx.float32, True, True),  # Qwen3-Next-80B's width and top 10, a shared expert
    (2048, 10, mx.bfloat16, True, True),
    (131, 4, mx.bfloat16, False, False),  # an odd width: a column tail in the last block
    (131, 1, mx.float32, True, False),  # one pick: its weight over itself
    (1000, 16, mx.bfloat16, False, True),
])
def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator, H, k, dtype, normalize,
                                                                    has_shared):
    """(kernel_emulate.py runs R = 1..8 and more shapes.)"""
    assert emulate.check_combine(emulator, H, k, dtype=dtype, normalize=normalize, has_shared=has_shared,
                                 rows=(1, 3, 8))


@pytest.mark.parametrize("H, k, dtype, normalize, has_shared", [
    (2048, 10, mx.float32, True, True),
    (2048, 10, mx.bfloat16, True, True),
    (131, 4, mx.bfloat16, False, False),
    (131, 1, mx.float32, True, False),
])
def test_emulated_residual_variants_are_row_invariant_and_add_as_mlx_adds(emulate, emulator, H, k, dtype, normalize,
                                                                          has_shared):
    """check_combine's residual form: rows equal their 1-row calls and MLX's add of the residual
    to the unfolded variant's rows, bit for bit, and stay near the reference."""
    assert emulate.check_combine(emulator, H, k, dtype=dtype, normalize=normalize, has_shared=has_shared,
                                 has_residual=True, rows=(1, 3, 8))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_folded_residual_has_the_bits_of_the_unfused_add(emulator, dtype):
    """residual + the combine rounded to the dtype, rounded once more: MLX's add of the residual
    to the unfolded kernel's output, bit for bit. In bfloat16 that is not the float32 sum rounded
    once (residual + acc), which a body that skipped the inner rounding would give."""
    picks, weights, shared, gates = moe_combine.probe_inputs(300, 10, rows=4, dtype=dtype, seed=3)
    residual = moe_combine.probe_residual(300, rows=4, dtype=dtype, seed=3)
    extra = {"normalize": True, "shared": shared, "gates": gates, "gate_column": 2}
    folded = emulator.run(picks, weights, residual=residual, **extra)
    unfolded = emulator.run(picks, weights, **extra)
    assert folded.dtype == dtype and mx.array_equal(folded, residual + unfolded).item()
    if dtype == mx.bfloat16:
        wide = emulator.run(picks.astype(mx.float32), weights, **{**extra, "shared": shared.astype(mx.float32),
                                                                   "gates": gates.astype(mx.float32)})
        rounded_once = (residual.astype(mx.float32) + wide).astype(mx.bfloat16)
        assert not mx.array_equal(folded, rounded_once).item()


RESIDUAL_TERM = "static_cast<float>(residual[r * H + c])"


def test_the_checks_notice_a_dropped_residual(emulate, tmp_path):
    assert RESIDUAL_TERM in moe_combine.SOURCE_SHARED_RESIDUAL and RESIDUAL_TERM in moe_combine.SOURCE_RESIDUAL
    wrong = emulate.CombineEmulator(tmp_path)
    for variant in ((True, True), (False, True)):
        wrong.sources[variant] = moe_combine.KERNELS[variant][2].replace(RESIDUAL_TERM, "0.0f")
    assert not emulate.check_combine(wrong, 131, 4, rows=(2,), has_residual=True)
    assert not emulate.check_combine(wrong, 131, 4, rows=(2,), has_shared=False, has_residual=True)


def test_bfloat16_rounds_once_from_the_float32_sum(emulator):
    """The bfloat16 result is the float32 sum rounded once: equal to the float32 kernel's output
    rounded, bit for bit (the same float32 arithmetic on the same, bfloat16-valued, inputs)."""
    picks, weights, shared, gates = moe_combine.probe_inputs(300, 10, rows=4, dtype=mx.bfloat16, seed=2)
    extra = {"normalize": True, "shared": shared, "gates": gates, "gate_column": 0}
    low = emulator.run(picks, weights, **extra)
    wide = emulator.run(picks.astype(mx.float32), weights, **{**extra, "shared": shared.astype(mx.float32),
                                                                "gates": gates.astype(mx.float32)})
    assert low.dtype == mx.bfloat16 and mx.array_equal(low, wide.astype(mx.bfloat16)).item()


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path):
    drifting = emulate.CombineEmulator(tmp_path)
    drifting.sources[True, False] = moe_combine.SOURCE_SHARED.replace("float acc = 0.0f;",
                                                                      "float acc = 1e-7f * block_y;")
    assert drifting.sources[True, False] != moe_combine.SOURCE_SHARED
    assert not emulate.check_combine(drifting, 131, 4, rows=(3,))


@pytest.mark.parametrize("broken, has_shared", [
    ("normalise ? weights[r * K + j] / total : weights[r * K + j]", False),  # the renormalisation dropped
    ("1.0f / (1.0f + expf(-g))", True),  # the gate dropped: the shared output added whole
])
def test_the_checks_notice_a_dropped_renormalisation_or_gate(emulate, tmp_path, broken, has_shared):
    body = moe_combine.KERNELS[has_shared, False][2]
    assert broken in body
    wrong = emulate.CombineEmulator(tmp_path)
    wrong.sources[has_shared, False] = body.replace(broken, "weights[r * K + j]" if "normalise" in broken else "1.0f")
    assert not emulate.check_combine(wrong, 131, 4, rows=(2,), has_shared=has_shared)


def test_takes_and_launch():
    picks, weights, shared, gates = moe_combine.probe_inputs(64, 4, rows=2)
    assert moe_combine.takes(picks, weights) and moe_combine.takes(picks, weights, shared, gates, 2)
    assert moe_combine.takes(picks[None], weights[None], shared[None], gates[None])  # (B, T, ...) windows
    assert not moe_combine.takes(picks, weights, shared, gates, 3)  # a column past the gates' rows
    assert not moe_combine.takes(picks, weights.astype(mx.bfloat16))  # float32 weights only
    assert not moe_combine.takes(picks.astype(mx.float16), weights)  # float32 and bfloat16 picks only
    assert not moe_combine.takes(picks, weights, shared.astype(mx.bfloat16), gates)  # MLX would widen: its ops
    assert not moe_combine.takes(picks, weights, shared)  # a shared output without its gate
    assert not moe_combine.takes(picks, weights[:, :3])
    residual = moe_combine.probe_residual(64, rows=2)
    assert moe_combine.takes(picks, weights, residual=residual)
    assert moe_combine.takes(picks, weights, shared, gates, 2, residual)
    assert not moe_combine.takes(picks, weights, residual=residual.astype(mx.bfloat16))  # MLX would widen: its add
    assert not moe_combine.takes(picks, weights, residual=residual[None])  # not the output's shape: the caller's view
    assert not moe_combine.takes(picks, weights, residual=residual[:1])
    threads = moe_combine.THREADS
    assert moe_combine.launch(3, 2048) == {"grid": (2048, 3, 1), "threadgroup": (threads, 1, 1)}
    assert moe_combine.launch(1, threads + 1) == {"grid": (2 * threads, 1, 1), "threadgroup": (threads, 1, 1)}
    assert not moe_combine.usable(mx.float16)


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body with the launch the
    module asks for (its grid, the dtype as a template value, sizes as data)."""
    def make(name, inputs, outputs, source, header="", *, ensure_row_contiguous=True):
        has_shared, has_residual = VARIANTS[name]
        assert (name, inputs, source) == moe_combine.KERNELS[has_shared, has_residual]
        assert outputs == ["out"] and header == "" and ensure_row_contiguous

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            R, k, H, normalize, G, column = np.array(inputs[0]).tolist()
            picks = inputs[1]
            assert dict(template) == {"T_P": picks.dtype} and output_dtypes == [picks.dtype]
            assert (grid, threadgroup) == tuple(moe_combine.launch(R, H).values())
            calls.append((R, bool(normalize), has_shared, has_residual))
            extra = ({"shared": inputs[3].reshape(R, H), "gates": inputs[4].reshape(R, G), "gate_column": column}
                     if has_shared else {})
            if has_residual:
                assert inputs[-1].dtype == picks.dtype and inputs[-1].shape == tuple(output_shapes[0])
                extra["residual"] = inputs[-1].reshape(R, H)
            out = emu.run(picks.reshape(R, k, H), inputs[2].reshape(R, k), normalize=bool(normalize), **extra)
            return [out.reshape(output_shapes[0])]
        return launch
    return make


def shared_block(E=48, k=4, H=64):
    b = moe.SparseMoeBlock(hidden_size=H, expert_size=32, num_experts=E, top_k=k, norm_topk_prob=True,
                           shared_expert_size=32)
    randomized(b, 10)
    b.gate.weight = 0.02 * mx.random.normal(b.gate.weight.shape, key=mx.random.key(99))  # top 4 of 48: a small sum
    b.shared_expert_gate.weight = 0.3 * mx.random.normal(b.shared_expert_gate.weight.shape, key=mx.random.key(98))
    mx.eval(b.parameters())
    b.stack_linears()
    return b


@pytest.fixture
def gpu_forms(monkeypatch):
    """The MLX forms a GPU runs (no numpy host path for short calls)."""
    monkeypatch.setattr(layers.CpuShortCalls, "mode", "never")


def run_block_through(monkeypatch, emu, block, *args, **kwargs):
    """The block's output with the (emulated) combine kernel usable, and the kernel's calls."""
    calls = []
    with monkeypatch.context() as m:
        m.setattr(moe_combine, "usable", lambda dtype=None: True)
        m.setattr(moe_combine, "gpu_kernel", emulated_kernel(emu, calls))
        return block(*args, **kwargs), calls


def test_the_probe_passes_the_emulated_kernel_and_fails_one_that_drops_the_residual(monkeypatch, emulate, tmp_path):
    """`check` runs every variant, the residual ones held to MLX's add of the residual bit for bit."""
    cases = ((130, mx.bfloat16, 4), (130, mx.float32, 1))
    for name in ("right", "wrong"):
        (tmp_path / name).mkdir()
    calls = []
    with monkeypatch.context() as m:
        m.setattr(moe_combine, "gpu_kernel", emulated_kernel(emulate.CombineEmulator(tmp_path / "right"), calls))
        assert moe_combine.check(cases) is None
    assert {call[2:] for call in calls} == set(moe_combine.KERNELS)
    wrong = emulate.CombineEmulator(tmp_path / "wrong")
    wrong.sources[True, True] = moe_combine.SOURCE_SHARED_RESIDUAL.replace(RESIDUAL_TERM, "0.0f")
    with monkeypatch.context() as m:
        m.setattr(moe_combine, "gpu_kernel", emulated_kernel(wrong, []))
        assert moe_combine.check(cases) == ("moe_combine's residual differs from MLX's add (H=130, k=4, "
                                            "mlx.core.bfloat16, normalize=True, shared=True, residual=True)")


def test_a_shared_expert_window_is_combined_by_the_kernel_as_mlx_ops_combine_it(monkeypatch, emulator, gpu_forms):
    """A Qwen3-Next-style block (renormalised top k, a sigmoid-gated shared expert, its gate a
    column of the stacked router's output) combines a 5-row window in one kernel call, within
    float32 rounding of MLX's ops; a kernel that dropped the renormalisation or the gate would
    not be (both change the output far beyond that)."""
    b = shared_block()
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    expected = b(x)  # the CPU: MLX's ops
    got, calls = run_block_through(monkeypatch, emulator, b, x)
    assert calls == [(5, True, True, False)] and got.shape == x.shape
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    inds, weights = b.picks(b.gate(x))
    assert (weights.sum(axis=-1) < 0.5).all().item()  # renormalising changes every weight
    routed = moe.weighted_sum(b.switch_mlp(x, inds), weights / weights.sum(axis=-1, keepdims=True))
    shared = b.shared_expert(x)
    assert not mx.allclose(routed + shared, expected, rtol=1e-2, atol=1e-3).item()  # what a dropped gate gives
    assert not mx.allclose(moe.weighted_sum(b.switch_mlp(x, inds), weights) + shared * mx.sigmoid(
        b.shared_expert_gate(x)), expected, rtol=1e-2, atol=1e-3).item()  # what a dropped renormalisation gives


@pytest.mark.parametrize("broken", ["normalise ? weights[r * K + j] / total : weights[r * K + j]",
                                    "1.0f / (1.0f + expf(-g))"])
def test_the_block_test_fails_a_kernel_that_drops_the_renormalisation_or_the_gate(monkeypatch, emulate, tmp_path,
                                                                                  gpu_forms, broken):
    b = shared_block()
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    expected = b(x)
    wrong = emulate.CombineEmulator(tmp_path)
    wrong.sources[True, False] = moe_combine.SOURCE_SHARED.replace(broken, "weights[r * K + j]" if "normalise" in broken
                                                                   else "1.0f")
    got, calls = run_block_through(monkeypatch, wrong, b, x)
    assert calls == [(5, True, True, False)]
    assert not mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


def test_a_bfloat16_window_rounds_once(monkeypatch, emulator, gpu_forms):
    """In bfloat16 MLX's ops round every product and sum; the kernel rounds once, so it is within
    a few roundings of them and within one of the float32 block's output."""
    b = shared_block()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(4))
    wide = b(x)
    b.set_dtype(mx.bfloat16)
    b.stack_linears()  # set_dtype replaced the stacked linears' arrays
    x16 = x.astype(mx.bfloat16)
    expected = b(x16)
    got, calls = run_block_through(monkeypatch, emulator, b, x16)
    assert calls == [(3, True, True, False)] and got.dtype == mx.bfloat16
    scale = mx.abs(wide).max().item()
    assert (mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)) <= 2**-5 * scale).all().item()
    assert (mx.abs(got.astype(mx.float32) - wide) <= 2**-6 * scale).all().item()


def test_a_block_without_a_shared_expert_and_other_families_take_the_kernel(monkeypatch, emulator, gpu_forms):
    """weighted_sum takes the kernel for every family that calls it (its weights as given)."""
    b = moe.SparseMoeBlock(hidden_size=64, expert_size=32, num_experts=16, top_k=4, norm_topk_prob=False)
    randomized(b, 20)
    x = mx.random.normal((1, 4, 64), key=mx.random.key(5))
    expected = b(x)
    got, calls = run_block_through(monkeypatch, emulator, b, x)
    assert calls == [(4, False, False, False)]
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


def test_gpt_oss_renormalises_the_router_kernels_top_k_in_the_combine_kernel(monkeypatch, emulator, gpu_forms):
    """GPT-OSS's softmax over the top k logits is the router kernel's probabilities over their
    sum (here the router kernel's MLX reference stands in for it): the combine kernel is asked to
    renormalise, and the block's output equals its MLX ops' within float32 rounding."""
    from strata_cli.model.gpt_oss import GptOssMoe

    config = SimpleNamespace(num_experts_per_tok=4, hidden_size=64, num_local_experts=32, intermediate_size=32,
                             swiglu_alpha=1.702, swiglu_limit=7.0)
    block = randomized(GptOssMoe(config), 0)
    block.router.weight = 0.02 * mx.random.normal(block.router.weight.shape, key=mx.random.key(99))
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    expected = block(x)  # the CPU: MLX's ops
    monkeypatch.setattr(router_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(router_window, "router_window", router_window.reference_router_window)
    got, calls = run_block_through(monkeypatch, emulator, block, x)
    assert calls == [(5, True, False, False)]
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    # the layer's residual goes into the same launch, with the bits of the unfused add
    residual = residual_for(x)
    assert block.folds_residual
    folded, calls = run_block_through(monkeypatch, emulator, block, x, residual=residual)
    assert calls == [(5, True, False, True)] and folded.shape == x.shape
    assert mx.array_equal(folded, residual + got).item()


def test_mlx_ops_combine_prompt_chunks_unusable_dtypes_and_never_mode(monkeypatch):
    monkeypatch.setattr(moe_combine, "usable", lambda dtype=None: dtype == mx.float32)

    def unexpected(*args, **kwargs):
        raise AssertionError("the combine kernel was called")

    monkeypatch.setattr(moe_combine, "moe_combine", unexpected)
    picks, weights, shared, gates = moe_combine.probe_inputs(64, 4, rows=9)
    mx.eval(moe.picks_sum(picks, weights, normalize=True))  # more rows than a window
    mx.eval(moe.weighted_sum(picks[:2].astype(mx.float16), weights[:2]))  # a dtype whose probe did not pass
    monkeypatch.setattr(moe.RowSplit, "mode", "never")
    mx.eval(moe.weighted_sum(picks[:2], weights[:2]))
    monkeypatch.setattr(moe.RowSplit, "mode", "auto")
    assert moe.combine_kernel_takes(picks[:2], weights[:2], shared[:2], gates[:2], 1)


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    picks, weights, _, _ = moe_combine.probe_inputs(64, 4, rows=2)
    assert not moe.combine_kernel_takes(picks, weights)
    assert moe_combine.status() == {"usable": False, "probed": True, "error": None}


def test_a_failing_probe_turns_the_kernel_off_and_the_block_falls_back(caplog, failing_metal):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the block combines with MLX's ops."""
    made = failing_metal(moe_combine, "MoE combine kernel")
    picks, weights, _, _ = moe_combine.probe_inputs(64, 4, rows=3)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        got = moe.picks_sum(picks, weights, normalize=True)
    assert "MoE combine kernel disabled" in caplog.text
    assert moe_combine.status()["error"] == ("moe_combine differs from the reference (H=2048, k=10, mlx.core.float32, "
                                            "normalize=True, shared=True)")
    assert made[0]["source"] == backends.source(backends.METAL, moe_combine.SOURCE_SHARED)
    assert made[0]["ensure_row_contiguous"] is True
    assert mx.allclose(got, moe.normalized_picks_sum(picks, weights)).item()
    count = len(made)
    moe.picks_sum(picks, weights, normalize=True)
    assert len(made) == count  # decided once per process


def residual_for(x: mx.array, seed: int = 7) -> mx.array:
    return (4 * mx.random.normal(x.shape, key=mx.random.key(seed))).astype(x.dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_window_folds_the_residual_into_the_combine_with_the_bits_of_the_add(monkeypatch, emulator, gpu_forms,
                                                                               dtype):
    """Given the layer's residual, a shared-expert block runs one combine launch, the residual
    variant, whose output is MLX's add of the residual to the unfolded block's output through
    the same kernel, bit for bit, and near MLX's ops plus the residual."""
    b = shared_block()
    if dtype == mx.bfloat16:
        b.set_dtype(mx.bfloat16)
        b.stack_linears()  # set_dtype replaced the stacked linears' arrays
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2)).astype(dtype)
    residual = residual_for(x)
    expected = residual + b(x)  # the CPU: MLX's ops
    folded, calls = run_block_through(monkeypatch, emulator, b, x, residual=residual)
    assert calls == [(5, True, True, True)] and folded.shape == x.shape and folded.dtype == dtype
    unfolded, calls = run_block_through(monkeypatch, emulator, b, x)
    assert calls == [(5, True, True, False)]
    assert mx.array_equal(folded, residual + unfolded).item()
    scale = mx.abs(expected).max().item()
    bound = 2**-5 * scale if dtype == mx.bfloat16 else 1e-5 * scale
    assert (mx.abs(folded.astype(mx.float32) - expected.astype(mx.float32)) <= bound).all().item()


def test_a_block_without_a_shared_expert_folds_the_residual_as_the_picks_rows(monkeypatch, emulator, gpu_forms):
    """The block's picks are (N, k, H) rows of the (1, T, H) window: the residual goes in as those
    rows and the output comes back in the window's shape, the bits of the unfused add."""
    b = moe.SparseMoeBlock(hidden_size=64, expert_size=32, num_experts=16, top_k=4, norm_topk_prob=True)
    randomized(b, 20)
    x = mx.random.normal((1, 4, 64), key=mx.random.key(5))
    residual = residual_for(x)
    folded, calls = run_block_through(monkeypatch, emulator, b, x, residual=residual)
    assert calls == [(4, False, False, True)] and folded.shape == x.shape
    unfolded, _ = run_block_through(monkeypatch, emulator, b, x)
    assert mx.array_equal(folded, residual + unfolded).item()
    assert mx.allclose(folded, residual + b(x), rtol=1e-5, atol=1e-5).item()


def test_the_block_test_fails_a_kernel_that_drops_the_residual(monkeypatch, emulate, tmp_path, gpu_forms):
    b = shared_block()
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    residual = residual_for(x)
    wrong = emulate.CombineEmulator(tmp_path)
    wrong.sources[True, True] = moe_combine.SOURCE_SHARED_RESIDUAL.replace(RESIDUAL_TERM, "0.0f")
    got, calls = run_block_through(monkeypatch, wrong, b, x, residual=residual)
    assert calls == [(5, True, True, True)]
    assert not mx.allclose(got, residual + b(x), rtol=1e-5, atol=1e-5).item()


def test_off_the_kernel_the_residual_is_one_add_of_the_same_bits():
    """The CPU's paths (the host form of a shared-expert block, MLX's ops without one): the
    residual plus the block's output, as the layer added it before."""
    x = mx.random.normal((1, 3, 64), key=mx.random.key(3))
    residual = residual_for(x)
    plain = moe.SparseMoeBlock(hidden_size=64, expert_size=32, num_experts=16, top_k=4, norm_topk_prob=True)
    randomized(plain, 21)
    from strata_cli.model.gpt_oss import GptOssMoe

    config = SimpleNamespace(num_experts_per_tok=4, hidden_size=64, num_local_experts=32, intermediate_size=32,
                             swiglu_alpha=1.702, swiglu_limit=7.0)
    for b in (shared_block(), plain, randomized(GptOssMoe(config), 0)):
        assert mx.array_equal(b(x, residual=residual), residual + b(x)).item()


def test_only_blocks_that_keep_the_sparse_blocks_call_fold_the_residual():
    from strata_cli.model.deepseek_v3 import DeepseekMoE
    from strata_cli.model.deepseek_v4 import MoE
    from strata_cli.model.glm4_moe import Glm4MoeBlock
    from strata_cli.model.granitemoehybrid import GraniteMoe

    assert shared_block().folds_residual
    folds = moe.SparseMoeBlock.folds_residual.fget
    assert folds(GraniteMoe.__new__(GraniteMoe))  # its layer's tail scales the block's output: it never asks
    for own_call in (DeepseekMoE, MoE, Glm4MoeBlock):
        assert not folds(own_call.__new__(own_call))


class PassThrough(nn.Module):
    def tail(self, mixed: mx.array) -> mx.array:
        return mixed


class OneLayer(PreNormLayer):
    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.mix = PassThrough()
        self.post_attention_layernorm = layers.RMSNorm(64, 1e-6)
        self.mlp = ffn

    @property
    def mixer(self) -> nn.Module:
        return self.mix

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


def test_the_layers_tail_hands_its_residual_to_a_block_that_folds_it(monkeypatch, emulator, gpu_forms):
    """PreNormLayer.tail: h + ffn(norm(h)), the add inside the combine launch for a folding block,
    by MLX's add for a dense MLP; the same bits either way."""
    block = shared_block()
    layer = OneLayer(block)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(8))
    mixed = mx.random.normal((1, 5, 64), key=mx.random.key(9))
    got, calls = run_block_through(monkeypatch, emulator, layer.tail, x, mixed)
    assert calls == [(5, True, True, True)]
    h = x + mixed
    unfolded, _ = run_block_through(monkeypatch, emulator, block, layer.post_attention_layernorm(h))
    assert mx.array_equal(got, h + unfolded).item()
    dense = OneLayer(randomized(layers.MLP(64, 32), 11))
    assert mx.array_equal(dense.tail(x, mixed), h + dense.mlp(dense.post_attention_layernorm(h))).item()
