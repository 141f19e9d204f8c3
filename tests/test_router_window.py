"""metal_shaders/router_window.py: the MoE router's softmax and top-k in one kernel, its
reference, and where SparseMoeBlock uses it.

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, a block's
threads at once; tests/test_kernel_backends.py runs it behind the Metal prelude too). Each row
of an R-row call must equal its 1-row call bit for bit, pick the reference's experts in
descending probability (ties to the lower index) and weigh them within 1e-6 of the reference.
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import backends, probe, router_window
from strata_cli.model import moe


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.RouterEmulator(tmp_path_factory.mktemp("router-emulate"))


def test_the_reference_is_the_softmax_top_k_in_descending_order_ties_to_the_lower_index():
    logits = mx.array([[0.5, 2.0, -1.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    inds, weights = router_window.reference_router_window(logits, 4)
    assert inds.dtype == mx.uint32 and weights.dtype == mx.float32
    assert inds.tolist() == [[1, 3, 5, 0], [0, 1, 2, 3]]
    probs = mx.softmax(logits, axis=-1)
    assert mx.allclose(weights, mx.take_along_axis(probs, inds, axis=-1), rtol=1e-6, atol=0).item()
    assert weights[1].tolist() == [weights[1, 0].item()] * 4  # equal logits, equal bits


def test_the_reference_picks_the_experts_mlx_ops_pick():
    logits = router_window.probe_logits(512, seed=3)[3:]  # rows without ties: one top-k set
    inds, weights = router_window.reference_router_window(logits, 10)
    probs = mx.softmax(logits, axis=-1)
    parted = mx.argpartition(probs, kth=512 - 10, axis=-1)[..., 512 - 10:]
    assert np.array_equal(np.sort(np.array(inds), axis=-1), np.sort(np.array(parted), axis=-1))
    assert np.all(np.diff(np.array(weights), axis=-1) <= 0)  # descending


@pytest.mark.parametrize("E, k", [(512, 10), (48, 2)])  # Qwen3-Next-80B's router, the demo model's
def test_emulated_kernel_is_row_invariant_and_matches_the_reference(emulate, emulator, E, k):
    """(kernel_emulate.py runs R = 1..8 and bfloat16-valued logits.)"""
    assert emulate.check_router(emulator, E, k, rows=(1, 3, 8))


def test_bfloat16_valued_logits_tie_often_and_still_match(emulate, emulator):
    assert emulate.check_router(emulator, 512, 10, rows=(8,), dtype=mx.bfloat16, seed=4)


def test_nonfinite_logits_give_k_distinct_experts_in_range_with_nan_weights(emulator):
    """A NaN or infinite logit makes every probability of its row NaN: the row picks experts
    0..k-1 (a NaN ranks below every number, ties to the lower index) and never an index out of
    range; the other rows keep their bits."""
    E, k = 48, 4
    logits = np.array(router_window.probe_logits(E, rows=4, seed=5))
    clean = emulator.run(logits, E, k)
    logits[1, 7], logits[2, 30] = np.nan, np.inf
    inds, weights = emulator.run(logits, E, k)
    assert inds[1].tolist() == inds[2].tolist() == [0, 1, 2, 3]
    assert np.isnan(weights[1:3]).all()
    for row in (0, 3):
        assert np.array_equal(inds[row], clean[0][row]) and np.array_equal(weights[row], clean[1][row])
    ref_inds, _ = router_window.reference_router_window(mx.array(logits), k)
    assert np.array_equal(np.array(ref_inds), inds)


def test_the_emulator_notices_a_row_count_dependent_body(emulate, tmp_path):
    drifting = emulate.RouterEmulator(tmp_path)
    drifting.source = router_window.SOURCE.replace("float s = 0.0f;", "float s = 1e-7f * dims[0];")
    assert drifting.source != router_window.SOURCE
    assert not emulate.check_router(drifting, 48, 2, rows=(3,))


def test_supported_shapes_and_launch():
    assert router_window.supports(512, 10) and router_window.supports(48, 2) and router_window.supports(1024, 16)
    assert not router_window.supports(1025, 8) and not router_window.supports(64, 17)
    assert not router_window.supports(4, 8) and not router_window.supports(64, 0)
    assert router_window.per_thread(512) == 4 and router_window.per_thread(48) == 1
    threads = router_window.THREADS
    assert router_window.launch(3) == {"grid": (3 * threads, 1, 1), "threadgroup": (threads, 1, 1)}
    assert not router_window.takes(mx.zeros((1, 1, 2, 48)), 2)  # rank 2 or 3 only
    assert not router_window.usable(mx.float16)  # float32 and bfloat16 logits only


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body with the launch the
    module asks for (grid, compiled PER, shapes as data); `rows` records each call's logits."""
    def make(name, inputs, outputs, source, header, *, ensure_row_contiguous=True):
        assert (source, inputs, outputs, ensure_row_contiguous) == (router_window.SOURCE, ["dims", "logits"],
                                                                     ["inds", "weights"], True)

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            R, E, k, W = np.array(inputs[0]).tolist()
            logits = inputs[1]
            values = dict(template)
            assert values == {"PER": router_window.per_thread(E), "T_IN": logits.dtype} and W == logits.shape[-1]
            assert (grid, threadgroup) == tuple(router_window.launch(R).values())
            assert output_dtypes == [mx.uint32, mx.float32]
            calls.append(R)
            buffer = np.array(logits.astype(mx.float32)).reshape(R, W)
            inds, weights = emu.run(buffer, E, k)
            return [mx.array(inds).reshape(output_shapes[0]), mx.array(weights).reshape(output_shapes[1])]
        return launch
    return make


def block(E=48, k=4):
    b = moe.SparseMoeBlock(hidden_size=32, expert_size=16, num_experts=E, top_k=k, norm_topk_prob=True)
    mx.eval(b.parameters())
    return b


def test_a_window_routes_through_the_kernel_row_invariantly(monkeypatch, emulator):
    """With the (emulated) kernel usable, a window's picks come from it, in descending order, and
    equal the 1-row calls' bit for bit; the picked set and its weights are those of MLX's ops."""
    calls = []
    b = block()
    stacked = mx.concatenate([router_window.probe_logits(48, seed=6), mx.ones((8, 1))], axis=-1)[None]
    logits = stacked[..., :48]  # (1, 8, E): the router's columns of the stacked router's output
    expected = b.picks(logits)  # the CPU: MLX's ops
    monkeypatch.setattr(router_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(router_window, "gpu_kernel", emulated_kernel(emulator, calls))
    inds, weights = b.picks(logits, stacked)  # read in place, the gate's column beside them
    assert calls == [8] and inds.shape == (1, 8, 4) and weights.shape == (1, 8, 4)
    alone = [b.picks(logits[:, t : t + 1], stacked[:, t : t + 1]) for t in range(8)]
    assert calls == [8] + [1] * 8
    viewed = b.picks(logits)  # the slice alone: copied, the same rows
    assert mx.array_equal(viewed[0], inds).item() and mx.array_equal(viewed[1], weights).item()
    assert mx.array_equal(inds, mx.concatenate([a[0] for a in alone], axis=1)).item()
    assert mx.array_equal(weights, mx.concatenate([a[1] for a in alone], axis=1)).item()
    # Rows 3.. have no ties among their top k: one set, whoever picks. (Of tied experts
    # argpartition keeps the higher indices: row 2, all equal, picks 44..47 there, 0..3 here.)
    inds, weights, expected = inds[:, 3:], weights[:, 3:], [a[:, 3:] for a in expected]
    order = mx.argsort(expected[0], axis=-1)
    assert mx.array_equal(mx.sort(inds, axis=-1), mx.take_along_axis(expected[0], order, axis=-1)).item()
    assert mx.allclose(mx.take_along_axis(weights, mx.argsort(inds, axis=-1), axis=-1),
                       mx.take_along_axis(expected[1], order, axis=-1), rtol=1e-6, atol=0).item()


def test_mlx_ops_route_prompt_chunks_policies_and_unusable_dtypes(monkeypatch):
    b = block()
    monkeypatch.setattr(router_window, "usable", lambda dtype=None: dtype == mx.float32)

    def unexpected(*args, **kwargs):
        raise AssertionError("the router kernel was called")

    monkeypatch.setattr(router_window, "router_window", unexpected)
    mx.eval(b.picks(mx.zeros((9, 48))))  # more rows than a window
    mx.eval(b.picks(mx.zeros((2, 48), dtype=mx.float16)))  # a dtype whose probe did not pass
    monkeypatch.setattr(moe.RowSplit, "mode", "never")
    mx.eval(b.picks(mx.zeros((2, 48))))
    monkeypatch.setattr(moe.RowSplit, "mode", "auto")
    b.routing_policy = lambda probs, k: (mx.zeros((probs.shape[0], k), dtype=mx.uint32), mx.ones((probs.shape[0], k)))
    mx.eval(b.picks(mx.zeros((2, 48))))
    assert moe.router_kernel_takes(mx.zeros((2, 48)), 4)  # what the policy's block would have used


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    assert not moe.router_kernel_takes(mx.zeros((2, 48)), 4)
    assert router_window.status() == {"usable": False, "probed": True, "error": None}


def test_a_failing_probe_turns_the_kernel_off_and_picks_fall_back(caplog, failing_metal):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the block routes with MLX's ops."""
    made = failing_metal(router_window, "router window kernel")
    b = block()
    logits = router_window.probe_logits(48, rows=3)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        inds, weights = b.picks(logits)
    assert "router window kernel disabled" in caplog.text
    assert router_window.status()["error"] == "router_window picks differ from the reference (E=512, mlx.core.float32)"
    assert made[0]["source"] == backends.source(backends.METAL, router_window.SOURCE)
    assert made[0]["ensure_row_contiguous"] is True  # rows read in place: a view is copied first
    expected = mx.argpartition(mx.softmax(logits, axis=-1), kth=44, axis=-1)[..., 44:]
    assert mx.array_equal(inds, expected).item()
    b.picks(logits)
    assert len(made) == 1  # decided once per process


def test_gpt_oss_routes_a_window_through_the_kernel_and_folds_its_softmax_into_the_sum(monkeypatch, emulator):
    """GPT-OSS's softmax over each row's top-k logits is the kernel's top-k probabilities over
    their sum: the block's output with the (emulated) kernel equals its MLX ops' within float32
    rounding, and a top-1 router keeps MLX's ops."""
    from types import SimpleNamespace

    from strata_cli.model.gpt_oss import GptOssMoe

    config = SimpleNamespace(num_experts_per_tok=4, hidden_size=64, num_local_experts=32, intermediate_size=32,
                             swiglu_alpha=1.702, swiglu_limit=7.0)
    block = GptOssMoe(config)
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(block.parameters())
    block.update(tree_unflatten([(name, 0.1 * mx.random.normal(p.shape, key=mx.random.key(i)))
                                 for i, (name, p) in enumerate(params)]))
    # small logits: the top 4 hold well under all the probability, so the renormalisation shows
    block.router.weight = 0.02 * mx.random.normal(block.router.weight.shape, key=mx.random.key(99))
    mx.eval(block.parameters())
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    expected = block(x)  # the CPU: MLX's ops
    assert mx.abs(expected).max().item() > 1e-2
    calls = []
    monkeypatch.setattr(router_window, "usable", lambda dtype=None: True)
    monkeypatch.setattr(router_window, "gpu_kernel", emulated_kernel(emulator, calls))
    got = block(x)
    assert calls == [5]
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    block.top_k = 1  # one pick: its weight is 1 either way, and normalized_picks_sum needs k > 1
    mx.eval(block(x))
    assert calls == [5]
