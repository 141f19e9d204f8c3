"""Routed experts on the CPU's host path (model/host_experts.py): the numpy dequantization is
MLX's bit for bit, the routed sum is the MLX block's to float32 rounding, each row is computed as
it is alone, streamed experts take the same path (and so stay bit-identical to resident ones,
tests/test_stream_exact.py), and experts the path cannot or should not take stay in MLX."""

import mlx.core as mx
import numpy as np
import pytest
from stream_checkpoints import build_pair

from strata_cli.engine.window import WindowEngine
from strata_cli.experts.switch import StreamedSwitchGLU
from strata_cli.model import host_experts, load_model
from strata_cli.model.moe import SparseMoeBlock
from strata_cli.options import StreamOptions
from strata_cli.runtime import load_checkpoint


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_is_mlx_bit_for_bit(bits, group_size):
    w = mx.array(np.random.default_rng(bits + group_size).standard_normal((3, 48, 256)).astype(np.float32))
    q, scales, biases = mx.quantize(w, group_size, bits)
    expected = np.asarray(mx.dequantize(q, scales, biases, group_size, bits))
    for e in range(3):
        got = host_experts.dequantize(np.asarray(q)[e], np.asarray(scales)[e], np.asarray(biases)[e], bits, group_size)
        assert got.dtype == np.float32 and np.array_equal(got, expected[e])


def moe_block(bits: int | None, *, expert_size: int = 32, hidden: int = 64, norm_topk_prob: bool = True):
    mx.random.seed(5)
    block = SparseMoeBlock(hidden_size=hidden, expert_size=expert_size, num_experts=8, top_k=3,
                           norm_topk_prob=norm_topk_prob, shared_expert_size=16)
    block.switch_mlp.update({name: mx.random.normal(block.switch_mlp[name].shape) * 0.1
                             for name in ("gate_proj", "up_proj", "down_proj")})
    if bits:
        block.switch_mlp = block.switch_mlp.to_quantized(group_size=32, bits=bits)
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routed_matches_the_mlx_block_and_rows_are_alone(bits, norm_topk_prob):
    block = moe_block(bits, norm_topk_prob=norm_topk_prob)
    assert host_experts.applies(block)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    logits = rng.standard_normal((6, 8)).astype(np.float32)
    got = host_experts.routed(block, x, logits)
    expected = np.asarray(block.routed(mx.array(x), mx.array(logits)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for n in range(6):  # a row's bits are its own, whatever rows share the call
        assert np.array_equal(host_experts.routed(block, x[n:n + 1], logits[n:n + 1])[0], got[n])


def test_only_small_exact_affine_or_float_experts_take_the_host():
    assert host_experts.forms(moe_block(None).switch_mlp) is not None
    big = moe_block(8, expert_size=512, hidden=256)  # 3 x 512 x 256 x 4 bytes = 1.5 MiB dequantized
    assert host_experts.forms(big.switch_mlp) is None and not host_experts.applies(big)
    odd = moe_block(None)
    odd.switch_mlp = odd.switch_mlp.to_quantized(group_size=32, bits=6)
    assert host_experts.forms(odd.switch_mlp) is None
    approximate = moe_block(4)
    approximate.routing_policy = lambda probs, k: None  # cache-aware routing keeps MLX's form
    assert not host_experts.applies(approximate)
    recast = moe_block(8)
    assert host_experts.applies(recast)
    recast.set_dtype(mx.bfloat16)  # scales no longer float32: found again, and refused
    assert not host_experts.applies(recast)


def test_experts_kept_dequantized_follow_their_scales():
    """A round trip through bfloat16 rounds the scales: the experts dequantized before it are
    dropped, not reused (the weights, unchanged by `set_dtype`, cannot tell)."""
    block = moe_block(8)
    rng = np.random.default_rng(2)
    x, logits = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    host_experts.routed(block, x, logits)
    block.set_dtype(mx.bfloat16)
    block.set_dtype(mx.float32)
    assert host_experts.applies(block)
    got = host_experts.routed(block, x, logits)
    expected = np.asarray(block.routed(mx.array(x), mx.array(logits)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("host-experts"), bits=8, group_size=32)


@pytest.mark.parametrize("slots", [3, 12, 32])
def test_streamed_experts_take_the_host_path_bit_for_bit(pair, slots, monkeypatch):
    """3 slots (below top-4: a window in several passes), 12 and all 32: windows' logits and the
    served picks equal the resident model's, the picks served from the slot banks in numpy."""
    resident = load_model(pair[0])
    streamed = load_checkpoint(pair[1], stream=StreamOptions(resident_experts=slots))
    served = []
    real = StreamedSwitchGLU.host_picks
    monkeypatch.setattr(StreamedSwitchGLU, "host_picks", lambda self, x, ids: served.append(len(ids)) or real(self, x, ids))
    tokens = [(7 * i + 3) % 90 for i in range(40)]
    logits = []
    for model in (resident, streamed):
        engine = WindowEngine(model)
        engine.prefill(tokens[:20])
        out = []
        for pos, T, keep in ((20, 1, 1), (21, 8, 3), (24, 4, 4), (28, 1, 1)):
            out.append(np.array(engine.run(tokens[pos:pos + T], pos).logits))
            engine.commit(keep)
        logits.append(out)
    assert served and max(served) == 8  # the windows' experts came through the host path
    for a, b in zip(*logits):
        assert np.array_equal(a, b)
    streamed.expert_cache.close()
