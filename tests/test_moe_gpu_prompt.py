"""The routed experts' GPU prompt form (model/moe.py: `padded_by_expert`, SwiGLU and Nemotron-H's
relu² experts), run here on the CPU with the device check pointed at a GPU: the same products as
the pick-by-pick gather, for resident and quantized experts."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from strata_cli.model import moe, nemotron_h
from strata_cli.model.host_blas import HostBlas

TOL = 1e-5


def rel_diff(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def experts(quantized: bool) -> moe.SwitchGLU:
    glu = moe.SwitchGLU(64, 32, 12)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        setattr(glu, name, 0.2 * mx.random.normal(glu[name].shape, key=mx.random.key(10 + i)))
    return glu.to_quantized(group_size=32, bits=4) if quantized else glu


def relu2_experts(quantized: bool) -> nemotron_h.SwitchMLP:
    mlp = nemotron_h.SwitchMLP(64, 32, 12)
    for i, name in enumerate(("fc1", "fc2")):
        mlp[name].weight = 0.2 * mx.random.normal(mlp[name].weight.shape, key=mx.random.key(20 + i))
    if quantized:
        nn.quantize(mlp, group_size=32, bits=4)
    return mlp


@pytest.fixture
def on_gpu(monkeypatch):
    """mx.default_device() says GPU (the ops still run on the CPU); numpy's BLAS off."""
    monkeypatch.setattr(HostBlas, "mode", "mlx")
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)


@pytest.mark.parametrize("build", [experts, relu2_experts])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("inds", [
    mx.random.randint(0, 10, (100, 3), key=mx.random.key(5)),  # experts 10, 11 unused
    mx.array([[3, 7]] * 20),  # two experts, 20 picks each
    mx.array([[i % 12, (i + 5) % 12] for i in range(9)]),  # uneven: some experts one pick
])
def test_padded_batches_match_the_gather(build, quantized, inds, on_gpu, monkeypatch):
    glu = build(quantized)
    x = mx.random.normal((inds.shape[0], 64), key=mx.random.key(4))
    monkeypatch.setattr(moe, "GPU_PROMPT_EXPERTS", "gather")
    ref = glu(x, inds)
    monkeypatch.setattr(moe, "GPU_PROMPT_EXPERTS", "padded")
    monkeypatch.setattr(moe, "PADDED_MAX_ROWS_PER_PICK", 100)  # take every batch, however padded
    out = glu(x, inds)
    assert out.shape == ref.shape == (inds.shape[0], inds.shape[1], 64)
    assert rel_diff(out, ref) < TOL


def test_padded_batches_each_expert_once(on_gpu, monkeypatch):
    """One batched call per projection over (E, C, H), C the most picks of an expert."""
    calls = []
    inds = mx.array([[0, 2], [2, 1], [2, 0], [1, 2]])  # expert 2 has 4 picks

    def matmul(name, xs, ids, is_sorted):
        calls.append((name, xs.shape, ids.tolist(), is_sorted))
        return xs if name != "down_proj" else xs * 2

    x = mx.random.normal((4, 8))
    out = moe.glu_padded(x, inds, matmul)
    assert [c[1] for c in calls] == [(3, 4, 8)] * 3 and all(c[2] == [0, 1, 2] and c[3] for c in calls)
    # The identity "experts" return silu(x)·x·2 per pick: every pick got its own token's row back.
    expect = mx.broadcast_to((mx.sigmoid(x) * x * x * 2)[:, None], (4, 2, 8))
    assert mx.allclose(out, expect, atol=1e-6).item()


def test_skewed_routing_gathers_instead_of_padding(on_gpu, monkeypatch):
    """One expert taking most picks would pad every other expert's row to its length: past
    PADDED_MAX_ROWS_PER_PICK rows per pick the block gathers pick by pick."""
    glu = experts(quantized=True)
    batched = []
    real = moe.gather_qmatmul
    monkeypatch.setattr(moe, "gather_qmatmul", lambda x, *a, **k: batched.append(x.shape) or real(x, *a, **k))
    x = mx.random.normal((40, 64))
    skewed = mx.array([[0, i % 12] for i in range(40)])  # expert 0: 44 of 80 picks, the others 3-4
    monkeypatch.setattr(moe, "PADDED_MAX_ROWS_PER_PICK", 4)  # 12 x 44 padded rows > 4 x 80 picks
    ref = glu(x, skewed)
    assert [s[1] for s in batched] == [1, 1, 1]  # (picks, 1, H): the gather
    batched.clear()
    monkeypatch.setattr(moe, "PADDED_MAX_ROWS_PER_PICK", 100)
    assert rel_diff(glu(x, skewed), ref) < TOL and [s for s in batched] == [(12, 44, 64), (12, 44, 64), (12, 44, 32)]


def test_the_cpu_and_decode_windows_never_pad(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "glu_padded", lambda *a: calls.append(1))
    glu = experts(quantized=True)
    glu(mx.random.normal((40, 64)), mx.random.randint(0, 12, (40, 2)))  # the CPU
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    glu(mx.random.normal((8, 64)), mx.random.randint(0, 12, (8, 2)))  # a decode window
    assert calls == []
