"""metal_shaders/embed_rows.py: a quantized embedding's lookup in one kernel, its reference, and
where the models use it (`lookup_embedding`, model/layers.py).

There is no GPU here: the body runs through scripts/lab/kernel_emulate.py (g++, a thread at a time,
bfloat16 in software; tests/test_kernel_backends.py runs it behind the Metal prelude too). Its
output must equal the reference (`nn.QuantizedEmbedding`'s MLX ops) bit for bit, each row its
1-row call's, and an out-of-range id must give a zero row.
"""

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from state_checks import serial_decode, speculation_matches_serial

from metal_shaders import backends, embed_rows, precompiled, probe
from strata_cli.model.layers import lookup_embedding


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.EmbedRowsEmulator(tmp_path_factory.mktemp("embed-rows-emulate"))


def quantized_embedding(bits: int = 4, group_size: int = 64, dtype=mx.float32, *, vocab: int = 40, dims: int = 128,
                        mode: str = "affine", seed: int = 0) -> nn.QuantizedEmbedding:
    dense = nn.Embedding(vocab, dims)
    dense.weight = mx.random.normal((vocab, dims), key=mx.random.key(seed)).astype(dtype)
    return dense.to_quantized(group_size=group_size, bits=bits, mode=mode)


@pytest.mark.parametrize("bits, group_size, dtype", [(4, 64, mx.bfloat16), (2, 32, mx.float32), (8, 128, mx.float32)])
def test_the_reference_is_quantized_embeddings_own_call_bit_for_bit_on_the_cpu(bits, group_size, dtype):
    embed = quantized_embedding(bits, group_size, dtype)
    spec = {"group_size": group_size, "bits": bits}
    for tokens in (mx.array([3, 0, 39, 3]), mx.array([[1, 2, 3], [39, 38, 0]], dtype=mx.uint32), mx.array([7])):
        expected = embed_rows.reference_embed_rows(tokens, embed.weight, embed.scales, embed.biases, **spec)
        assert expected.shape == (*tokens.shape, 128) and expected.dtype == dtype
        assert mx.array_equal(expected, embed(tokens)).item()


@pytest.mark.parametrize("bits, group_size, dtype", [
    (bits, gs, dtype) for bits in embed_rows.BITS for gs in embed_rows.GROUP_SIZES for dtype in (mx.float32, mx.bfloat16)])
def test_emulated_kernel_is_the_references_bits_row_by_row(emulate, emulator, bits, group_size, dtype):
    """(kernel_emulate.py: R = 1..8 tokens, a (2, 4) batch, out-of-range ids.)"""
    assert emulate.check_embed_rows(emulator, bits, group_size, dtype=dtype)


@pytest.mark.parametrize("token_dtype", [mx.uint32, mx.int64])
def test_emulated_kernel_takes_other_id_dtypes(emulate, emulator, token_dtype):
    assert emulate.check_embed_rows(emulator, 4, 64, rows=(1, 5, 8), dtype=mx.bfloat16, token_dtype=token_dtype)


BROKEN = {  # bodies a bit-for-bit check must refuse
    "one rounding": ("o[i] = scale * static_cast<T>(d) + bias;",
                     "o[i] = static_cast<T>(fmaf(static_cast<float>(scale), static_cast<float>(d), "
                     "static_cast<float>(bias)));"),
    "group": ("(j * VALS) / GS", "j / GS"),
    "codes high bits first": ("(q >> (BITS * i))", "(q >> (BITS * (VALS - 1 - i)))"),
    "row count": ("const T bias = biases[g];",
                  "const T bias = static_cast<T>(static_cast<float>(biases[g]) + 1e-2f * dims[0]);"),
    "out of range": ("o[i] = static_cast<T>(0.0f);", "o[i] = static_cast<T>(1.0f);"),
}


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_checks_refuse_a_body_that_differs(emulate, tmp_path, broken, dtype):
    """Rounding once (a fused multiply-add in float32) where MLX rounds the product and the sum,
    the wrong group, the codes in the wrong order, a row that sees the row count, a bad id's row
    not zero: each fails."""
    old, new = BROKEN[broken]
    emu = emulate.EmbedRowsEmulator(tmp_path)
    emu.source = embed_rows.SOURCE.replace(old, new)
    assert emu.source != embed_rows.SOURCE
    assert not emulate.check_embed_rows(emu, 4, 32, rows=(1, 3, 8), dtype=dtype)


def test_supported_forms_and_launch():
    assert embed_rows.supports(64, 4) and embed_rows.supports(32, 2) and embed_rows.supports(128, 8)
    assert not embed_rows.supports(64, 3) and not embed_rows.supports(64, 6) and not embed_rows.supports(16, 4)
    assert embed_rows.launch(3, 256) == {"grid": (768, 1, 1), "threadgroup": (128, 1, 1)}
    assert embed_rows.launch(1, 24) == {"grid": (128, 1, 1), "threadgroup": (128, 1, 1)}
    assert embed_rows.launch(0, 24)["grid"] == (128, 1, 1)  # a launch of one idle block, never an empty grid
    assert not precompiled.reads_shapes(embed_rows.SOURCE, embed_rows.INPUTS)  # strata's CUDA build keeps its cubin


def emulated_kernel(emu, calls):
    """A stand-in for `gpu_kernel` that runs the g++ emulation of the body (`emu.source`) with the
    launch the module asks for (grid, T, TI, BITS and GS compiled in, sizes as data)."""
    def make(name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        assert (name, inputs, outputs, body, header, ensure_row_contiguous) == (
            embed_rows.NAME, embed_rows.INPUTS, ["out"], embed_rows.SOURCE, "", True)

        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            N, W, G, V = np.array(inputs[0]).tolist()
            tokens, w, scales, biases = inputs[1:]
            values = dict(template)
            bits, gs = values["BITS"], values["GS"]
            assert values == {"T": scales.dtype, "TI": tokens.dtype, "BITS": bits, "GS": gs}
            assert (N, W, G, V) == (tokens.size, w.shape[1], scales.shape[1], w.shape[0]) and G * gs == W * 32 // bits
            assert (grid, threadgroup) == tuple(embed_rows.launch(N, W).values())
            assert output_shapes == [(*tokens.shape, W * 32 // bits)] and output_dtypes == [scales.dtype]
            calls.append(N)
            return [emu.run(tokens, w, scales, biases, group_size=gs, bits=bits)]
        return launch
    return make


@pytest.fixture
def kernel(monkeypatch, emulator):
    """The (emulated) kernel in use at every dtype: the calls' token counts."""
    calls = []
    monkeypatch.setattr(embed_rows, "usable", lambda dtype=None: True)
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    return calls


def test_the_start_up_probe_passes_the_emulated_kernel_and_refuses_broken_ones(monkeypatch, emulate, emulator,
                                                                                tmp_path):
    """`check` (the probe's body) over its own cases with the emulated kernel: None; with a body
    that rounds otherwise, sees the row count or reads an out-of-range id, what failed."""
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emulator, []))
    assert embed_rows.check() is None
    failures = {"one rounding": "embed_rows differs from the reference (4 bits, groups of 64, mlx.core.bfloat16)",
                "row count": "embed_rows rows differ with the row count (4 bits, groups of 64, mlx.core.bfloat16)",
                "out of range": "embed_rows reads out-of-range ids (4 bits, groups of 64, mlx.core.bfloat16)"}
    for broken, error in failures.items():
        emu = emulate.EmbedRowsEmulator(tmp_path)
        emu.source = embed_rows.SOURCE.replace(*BROKEN[broken])
        monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emu, []))
        assert embed_rows.check(embed_rows.PROBE_CASES[:1]) == error


@pytest.mark.parametrize("bits, group_size, dtype", [(4, 64, mx.bfloat16), (8, 32, mx.float32), (2, 128, mx.float32)])
def test_lookup_embedding_takes_the_kernel_for_an_affine_quantized_table(kernel, bits, group_size, dtype):
    embed = quantized_embedding(bits, group_size, dtype, seed=1)
    for tokens in (mx.array([[5, 0, 39, 5]]), mx.array([[1], [2]]), mx.array([17, 3, 3], dtype=mx.uint32)):
        got = lookup_embedding(embed, tokens)
        assert kernel[-1] == tokens.size
        assert got.shape == (*tokens.shape, 128) and got.dtype == dtype
        assert mx.array_equal(got, embed(tokens)).item()
    assert len(kernel) == 3


def test_lookup_embedding_keeps_mlx_ops_for_other_tables_and_off_the_gpu(monkeypatch, emulator):
    """A dense table, MX floats (no biases), widths the kernel does not take (3 and 6 bits), a
    subclass, float ids, a dtype whose probe did not pass, and the CPU (no probe passes): each
    is `embed(tokens)` with no kernel call."""
    calls = []
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    tokens = mx.array([[4, 9, 0]])
    assert not embed_rows.usable(mx.float32)  # the CPU
    quantized = quantized_embedding(4, 64)
    assert mx.array_equal(lookup_embedding(quantized, tokens), quantized(tokens)).item()
    monkeypatch.setattr(embed_rows, "usable", lambda dtype=None: dtype == mx.bfloat16)
    assert mx.array_equal(lookup_embedding(quantized, tokens), quantized(tokens)).item()  # float32: not probed
    dense = nn.Embedding(40, 128)

    class Shifted(nn.QuantizedEmbedding):
        def __call__(self, x):
            return super().__call__(x) + 1

    shifted = Shifted(40, 128, 64, 4)
    shifted.set_dtype(mx.bfloat16)
    mxfp4 = quantized_embedding(4, 32, mx.bfloat16, mode="mxfp4")
    assert mxfp4.get("biases") is None
    for embed in (dense, mxfp4, quantized_embedding(3, 64, mx.bfloat16), quantized_embedding(6, 64, mx.bfloat16),
                  shifted):
        assert mx.array_equal(lookup_embedding(embed, tokens), embed(tokens)).item()
    bf16 = quantized_embedding(4, 64, mx.bfloat16)
    with pytest.raises(ValueError):  # float ids: MLX's gather refuses them, the kernel is never asked
        lookup_embedding(bf16, tokens.astype(mx.float32))
    assert calls == []
    mx.eval(lookup_embedding(bf16, tokens))
    assert calls == [3]  # the same table at its probed dtype takes it


def test_off_the_gpu_the_kernel_is_never_usable():
    assert probe.backend() is None
    assert not embed_rows.usable() and not embed_rows.usable(mx.float16)
    assert embed_rows.status() == {"usable": False, "probed": True, "error": None}


def test_a_failing_probe_turns_the_kernel_off_and_the_lookup_falls_back(caplog, failing_metal):
    """Stand-in Metal makers return zeros: the probe disagrees with the reference, the kernel is
    turned off (logged once) and the lookup runs MLX's ops."""
    made = failing_metal(embed_rows, "embedding kernel")
    embed = quantized_embedding(4, 64)
    tokens = mx.array([[3, 1, 4]])
    expected = embed(tokens)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        out = lookup_embedding(embed, tokens)
    assert "embedding kernel disabled" in caplog.text
    assert embed_rows.status()["error"] == "embed_rows differs from the reference (8 bits, groups of 32, mlx.core.float32)"
    assert made[0]["source"] == backends.source(backends.METAL, embed_rows.SOURCE)
    assert made[0]["header"] == backends.header(backends.METAL, "")
    assert mx.array_equal(out, expected).item()
    mx.eval(lookup_embedding(embed, tokens))
    assert len(made) == 1  # decided once per process


# -- whole models -------------------------------------------------------------------------------

def quantized_qwen3_next():
    """The tiny Qwen3-Next, 4-bit as the window tests quantize it (its embedding too)."""
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.model.layers import stack_rows
    from strata_cli.model.quant import quantize

    model = random_model(tiny_qwen3_next_config(), seed=5)
    quantize(model, group_size=32, bits=4)
    stack_rows(model)
    mx.eval(model.parameters())
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    return model


def test_a_quantized_model_decodes_the_same_logits_and_tokens_through_the_kernel(monkeypatch, emulate, emulator,
                                                                                 tmp_path):
    """The tiny 4-bit Qwen3-Next: serial decoding's logits are the same bits with the (emulated)
    kernel as with MLX's lookup, every step through the kernel; speculative windows give serial
    decoding's tokens; a body that reads the codes in the wrong order changes the logits."""
    from strata_cli.engine.window import WindowEngine
    from strata_cli.options import EngineOptions

    model = quantized_qwen3_next()
    _, expected, _ = serial_decode(model, 10)
    calls = []
    monkeypatch.setattr(embed_rows, "usable", lambda dtype=None: True)
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    _, got, _ = serial_decode(model, 10)
    assert calls == [1] * 10
    assert all(mx.array_equal(g, e).item() for g, e in zip(got, expected))
    speculation_matches_serial(WindowEngine(model, EngineOptions()), calls, max_tokens=10)
    broken = emulate.EmbedRowsEmulator(tmp_path)
    broken.source = embed_rows.SOURCE.replace(*BROKEN["codes high bits first"])
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(broken, calls))
    _, wrong, _ = serial_decode(model, 3)
    assert not mx.array_equal(wrong[0], expected[0]).item()


def nemotron_h():
    from strata_cli.bench import hybrid_probe

    model = hybrid_probe.build_model()
    model.backbone.embeddings = model.backbone.embeddings.to_quantized(group_size=64, bits=4)
    return model, model.backbone.embeddings


GRANITE = dict(model_type="granitemoehybrid", vocab_size=512, hidden_size=64, max_position_embeddings=512,
               num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, num_hidden_layers=4,
               layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4, intermediate_size=64,
               shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
               mamba_d_conv=4, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.0625,
               logits_scaling=2.0, position_embedding_type="nope", tie_word_embeddings=True, rms_norm_eps=1e-6)
DEEPSEEK_V4 = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=64, moe_intermediate_size=32,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                   partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
                   max_position_embeddings=1024, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                              "heavily_compressed_attention",
                                                              "compressed_sparse_attention"],
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                   mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=20,
                   sliding_window=12, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
                   swiglu_limit=1.5, rope_theta=10000.0, compress_rope_theta=40000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False)


def granite():
    from strata_cli.model import granitemoehybrid

    model = granitemoehybrid.Model(granitemoehybrid.Config.from_dict(GRANITE))
    model.model.embed_tokens = model.model.embed_tokens.to_quantized(group_size=32, bits=8)  # tied: the head too
    mx.eval(model.parameters())
    return model, model.model.embed_tokens


def deepseek_v4():
    from strata_cli.model import deepseek_v4 as dsv4

    model = dsv4.Model(dsv4.Config.from_dict(DEEPSEEK_V4))
    model.model.embed_tokens = model.model.embed_tokens.to_quantized(group_size=64, bits=4)
    mx.eval(model.parameters())
    return model, model.model.embed_tokens


@pytest.mark.parametrize("build", [nemotron_h, granite, deepseek_v4], ids=["nemotron_h", "granite", "deepseek_v4"])
def test_each_familys_own_embedding_lookup_takes_the_kernel(monkeypatch, emulator, build):
    """Nemotron-H, Granite-4.0-H (the embedding times its multiplier) and DeepSeek-V4 (its forward
    embeds inline) look their quantized tables up through the kernel: a prompt's logits are the
    same bits as with MLX's lookup."""
    from strata_cli.engine.window import WindowEngine

    model, embed = build()
    assert type(embed) is nn.QuantizedEmbedding
    tokens = [5, 17, 42, 8, 311]
    expected = WindowEngine(model).run(tokens, 0).logits
    calls = []
    monkeypatch.setattr(embed_rows, "usable", lambda dtype=None: True)
    monkeypatch.setattr(embed_rows, "gpu_kernel", emulated_kernel(emulator, calls))
    got = WindowEngine(model).run(tokens, 0).logits
    assert calls == [5]
    assert mx.array_equal(got, expected).item()

