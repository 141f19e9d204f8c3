"""metal_shaders/backends.py: one kernel body for CUDA and Metal behind a thin prelude each.

There is no GPU here. The bodies run behind each backend's prelude through
scripts/lab/kernel_emulate.py (g++, with a shim for that backend's names): a T-row call must equal its
1-row calls bit for bit and stay near the reference. Which maker (`mx.fast.cuda_kernel` or
`mx.fast.metal_kernel`) gets which text is checked with stand-ins.
"""

import logging
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import (add_norm, attention_prep, attention_window, backends, embed_rows, gated_norm, gdn_window,
                           mamba2_window, moe_combine, probe, router_window)
from metal_shaders import rows_matvec as kernels

BODIES = {
    "rows_matvec.DENSE": kernels.DENSE,
    "rows_matvec.QUANTIZED": kernels.QUANTIZED,
    "rows_matvec.GATHER_QUANTIZED": kernels.GATHER_QUANTIZED,
    "rows_matvec.GATHER_MXFP4": kernels.GATHER_MXFP4,
    "rows_matvec.DENSE_GLU": kernels.DENSE_GLU,
    "rows_matvec.QUANTIZED_GLU": kernels.QUANTIZED_GLU,
    "rows_matvec.GATHER_QUANTIZED_GLU": kernels.GATHER_QUANTIZED_GLU,
    "gdn_window.PREPARE": gdn_window.PREPARE,
    "gdn_window.SCAN": gdn_window.SCAN,
    "mamba2_window.PREPARE": mamba2_window.PREPARE,
    "mamba2_window.SCAN": mamba2_window.SCAN,
    "attention_window.SOURCE": attention_window.SOURCE,
    "attention_window.SPLIT_SOURCE": attention_window.SPLIT_SOURCE,
    "attention_window.COMBINE_SOURCE": attention_window.COMBINE_SOURCE,
    "attention_window.SINK_SPLIT_SOURCE": attention_window.SINK_SPLIT_SOURCE,
    "attention_window.SINK_COMBINE_SOURCE": attention_window.SINK_COMBINE_SOURCE,
    "router_window.SOURCE": router_window.SOURCE,
    "add_norm.SOURCE": add_norm.SOURCE,
    "moe_combine.SOURCE": moe_combine.SOURCE,
    "moe_combine.SOURCE_SHARED": moe_combine.SOURCE_SHARED,
    "moe_combine.SOURCE_RESIDUAL": moe_combine.SOURCE_RESIDUAL,
    "moe_combine.SOURCE_SHARED_RESIDUAL": moe_combine.SOURCE_SHARED_RESIDUAL,
    "gated_norm.SOURCE": gated_norm.SOURCE,
    "attention_prep.SOURCE": attention_prep.SOURCE,
    "attention_prep.SOURCE_PLAIN": attention_prep.SOURCE_PLAIN,
    "embed_rows.SOURCE": embed_rows.SOURCE,
}


@pytest.mark.parametrize("name", BODIES)
def test_a_body_names_nothing_only_one_backend_knows(name):
    body = BODIES[name]
    assert [w for w in backends.CUDA_ONLY + backends.METAL_ONLY if w in body] == []
    assert "thread_x" in body or "block_x" in body  # it reads its place from the prelude's names


def test_each_prelude_speaks_only_its_own_backend():
    for backend, foreign in ((backends.CUDA, backends.METAL_ONLY), (backends.METAL, backends.CUDA_ONLY)):
        text = backends.header(backend) + backends.source(backend, "")
        assert [w for w in foreign if w in text] == [], backend


def test_the_metal_body_names_the_attributes_mlx_must_pass():
    """metal_kernel declares a thread-position attribute only when the body (not the header)
    names it: the index names come first in the body for that reason."""
    start = backends.source(backends.METAL, "")
    for attribute in ("thread_position_in_threadgroup", "threadgroup_position_in_grid", "threads_per_threadgroup"):
        assert attribute in start
    assert backends.source(backends.METAL, "BODY").endswith("BODY")


def _stand_in_makers(monkeypatch, made):
    def maker(kind):
        def make(**spec):
            made.append((kind, spec))

            def launch(**kw):
                return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
            return launch
        return make

    monkeypatch.setattr(mx.fast, "cuda_kernel", maker(backends.CUDA))
    monkeypatch.setattr(mx.fast, "metal_kernel", maker(backends.METAL))
    monkeypatch.setattr(probe, "_kernels", {})


def test_kernels_are_made_for_the_running_backend(monkeypatch):
    made = []
    _stand_in_makers(monkeypatch, made)
    x, w = mx.zeros((2, 64)), mx.zeros((8, 64))
    for backend in (backends.METAL, backends.CUDA, backends.METAL):
        monkeypatch.setattr(probe, "backend", lambda backend=backend: backend)
        kernels.rows_matvec(x, w)
    assert [kind for kind, _ in made] == [backends.METAL, backends.CUDA]  # then the Metal kernel is reused
    for kind, spec in made:
        foreign = backends.CUDA_ONLY if kind == backends.METAL else backends.METAL_ONLY
        assert spec["source"] == backends.source(kind, kernels.DENSE)
        assert spec["header"] == backends.header(kind, kernels.HEADER)
        assert [word for word in foreign if word in spec["source"] + spec["header"]] == []


def test_the_attention_kernel_keeps_its_own_header_and_views_on_metal(monkeypatch):
    made = []
    _stand_in_makers(monkeypatch, made)
    monkeypatch.setattr(probe, "backend", lambda: backends.METAL)
    q, keys, values = attention_window.probe_inputs(1, 4, 2, 64, 20, capacity=40)
    attention_window.attention_window(q[:, :, :2], keys, values, 0.125)
    (kind, spec), = made
    assert kind == backends.METAL and spec["header"].endswith(attention_window.header())
    assert spec["ensure_row_contiguous"] is False


def test_a_probe_runs_on_metal_and_a_failure_turns_the_kernels_off(monkeypatch, caplog):
    monkeypatch.setattr(probe, "backend", lambda: backends.METAL)
    passing = probe.Probe("kernels", "fallback")
    assert passing.usable(lambda dtypes: None) is True
    failing = probe.Probe("kernels", "the reference path")

    def broken(dtypes):
        raise RuntimeError("Unable to build metal library from source")
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        assert failing.usable(broken) is False
        assert failing.usable(lambda dtypes: None) is False  # decided once per process
    assert "Unable to build metal library" in failing.status()["error"]
    assert "the reference path" in caplog.text


def test_a_failing_mamba2_probe_turns_its_kernels_off_and_the_layer_falls_back(monkeypatch, caplog):
    """On a (stand-in) Metal device the Mamba-2 kernels are made from the Metal prelude and probed
    once; stand-ins that return zeros disagree with the reference, so the kernels are turned off
    (logged once) and a decode window runs the layer's MLX ops."""
    from strata_cli.model.mamba2 import Mamba2Mixer

    made = []
    _stand_in_makers(monkeypatch, made)
    monkeypatch.setattr(probe, "backend", lambda: backends.METAL)
    monkeypatch.setattr(mamba2_window, "_probe", probe.Probe("Mamba-2 window kernels", "MLX ops"))
    layer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, eps=1e-5,
                        time_step_limit=(0.001, float("inf")))
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        assert layer.takes_kernels(3) is False
    assert mamba2_window.status() == {"usable": False, "probed": True,
                                      "error": "mamba2_prepare and reference disagree (mlx.core.float32)"}
    assert "Mamba-2 window kernels disabled" in caplog.text
    assert {kind for kind, _ in made} == {backends.METAL}
    assert made[0][1]["source"] == backends.source(backends.METAL, mamba2_window.PREPARE)
    assert layer.takes_kernels(3) is False and len(made) == 1  # decided once per process


def test_no_backend_off_the_gpu():
    if mx.default_device() != mx.cpu:
        pytest.fail("this check is for the CPU test machine")
    assert probe.backend() is None


def _f32(a):
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_matrix_bodies_are_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    emu = emulate.Emulator(tmp_path, backend)
    K, N, R = 512, 37, 3
    x = mx.random.normal((R, K), key=mx.random.key(1))
    w = mx.random.normal((N, K), key=mx.random.key(2)) * K**-0.5
    qw, qs, qb = mx.quantize(w, 64, 4)

    def quantized(i0, i1):
        return emu.launch("quantized", [np.array([i1 - i0, K, N], np.int32), _f32(x[i0:i1]), np.array(qw), _f32(qs),
                                        _f32(qb)], rows=i1 - i0, blocks_y=1, N=N, out_rows=i1 - i0, bits=4, gs=64)

    def dense(i0, i1):
        return emu.launch("dense", [np.array([i1 - i0, K, N], np.int32), _f32(x[i0:i1]), _f32(w)],
                          rows=i1 - i0, blocks_y=1, N=N, out_rows=i1 - i0)

    experts = mx.array([2, 0, 2, 2, 1], dtype=mx.uint32)
    ew = mx.random.normal((3, N, K), key=mx.random.key(3)) * K**-0.5
    eqw, eqs, eqb = mx.quantize(ew, 64, 4)
    xg = mx.random.normal((5, K), key=mx.random.key(4))

    def gather(i0, i1):
        return emu.launch("gather", [np.array([i1 - i0, K, N, 1], np.int32), _f32(xg[i0:i1]), np.array(eqw), _f32(eqs),
                                     _f32(eqb), np.array(experts[i0:i1])], rows=2 if i1 - i0 > 1 else 1,
                          blocks_y=i1 - i0, N=N, out_rows=i1 - i0, bits=4, gs=64)

    def shared_rows(i0, i1):  # picks i0..i1-1 of 6, two a row: x holds rows i0 // 2 .. (i1 - 1) // 2
        lo = i0 // 2 * 2  # picks come in whole rows
        return emu.launch("gather", [np.array([i1 - lo, K, N, 2], np.int32), _f32(xs[lo // 2:(i1 + 1) // 2]),
                                     np.array(eqw), _f32(eqs), _f32(eqb), np.array(paired[lo:i1])],
                          rows=1, blocks_y=i1 - lo, N=N, out_rows=i1 - lo, bits=4, gs=64)[i0 - lo:]

    assert emulate.check("quantized", quantized, R, _f32(kernels.reference_qmatvec(x, qw, qs, qb, group_size=64, bits=4)),
                         range(R))
    assert emulate.check("dense", dense, R, _f32(kernels.reference_matvec(x, w)), range(R))
    assert emulate.check("gather", gather, 5,
                         _f32(kernels.reference_gather_qmatvec(xg, eqw, eqs, eqb, experts, group_size=64, bits=4)),
                         range(5))
    paired, xs = mx.array([2, 0, 1, 2, 0, 0], dtype=mx.uint32), xg[:3]  # 3 rows, 2 picks each
    copied = _f32(kernels.reference_gather_qmatvec(mx.repeat(xs, 2, axis=0), eqw, eqs, eqb, paired, group_size=64,
                                                   bits=4))
    assert emulate.check("gather, picks sharing rows", shared_rows, 6, copied, range(6))
    fw, fs = mx.quantize(ew, 32, 4, mode="mxfp4")  # GPT-OSS's experts: e2m1 codes, e8m0 scales

    def gather_mxfp4(i0, i1, *, decode="f16", share=2, order="picks"):
        return emu.launch("gather_mxfp4", [np.array([i1 - i0, K, N], np.int32), _f32(xg[i0:i1]), np.array(fw),
                                           np.array(fs), np.array(experts[i0:i1])], rows=share if i1 - i0 > 1 else 1,
                          blocks_y=i1 - i0, N=N, out_rows=i1 - i0,
                          more={"DECODE": kernels.MXFP4_DECODES[decode], "PICKS_X": kernels.MXFP4_ORDERS[order]})

    # the default decode and order, expert 2's three picks two to a block, against 1-pick calls
    assert emulate.check("gather_mxfp4", gather_mxfp4, 5,
                         _f32(kernels.reference_gather_mxfp4matvec(xg, fw, fs, experts)), range(5))
    if backend == backends.CUDA:  # the other decode forms give the same values, so the same bits
        default = gather_mxfp4(0, 5)
        for decode in set(kernels.MXFP4_DECODES) - {"f16"}:
            assert np.array_equal(gather_mxfp4(0, 5, decode=decode, share=1, order="columns"), default), decode


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_glu_bodies_are_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """The routed experts' GLU form in bfloat16 (five picks of one expert, one block) and the
    dense one's column tail in float32: rows as their 1-row calls, each product the plain
    kernel's bits (tests/test_glu_kernels.py runs more forms behind the CUDA prelude)."""
    emu = emulate.Emulator(tmp_path, backend)
    assert emulate.check_glu(emu, "gather_glu", dtype=mx.bfloat16, rows=(1, 8))
    assert emulate.check_glu(emu, "dense_glu", rows=(3,))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_column_mapped_bodies_are_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """The affine form in bfloat16 and the dense one in float32 (a column tail at 3 rows): rows
    as their 1-row calls, the call the plain kernel's columns gathered by the map
    (tests/test_mapped_kernels.py runs more forms behind the CUDA prelude)."""
    emu = emulate.Emulator(tmp_path, backend)
    assert emulate.check_mapped(emu, "quantized_mapped", dtype=mx.bfloat16, rows=(1, 8))
    assert emulate.check_mapped(emu, "dense_mapped", rows=(3,))


def test_gdn_bodies_are_row_invariant_behind_the_metal_prelude(emulate, tmp_path):
    """(The CUDA prelude's run is tests/test_gdn_window.py's.)"""
    assert emulate.check_gdn(emulate.GDNEmulator(tmp_path, backends.METAL), 1, 2, 4, 32, 64, rows=(1, 3))


def test_mamba2_bodies_are_row_invariant_behind_the_metal_prelude(emulate, tmp_path):
    """(The CUDA prelude's run is tests/test_mamba2_window.py's.)"""
    assert emulate.check_mamba2(emulate.Mamba2Emulator(tmp_path, backends.METAL), 2, 4, 16, 2, 32, rows=(1, 3))


def test_the_attention_body_is_row_invariant_behind_the_metal_prelude(emulate, tmp_path):
    """(The CUDA prelude's run is tests/test_attention_window.py's.) 300 cells: warps take two
    chunks each, so the block-shared partials and both barriers are exercised."""
    assert emulate.check_attention(emulate.AttentionEmulator(tmp_path, backends.METAL), 1, 4, 2, 32, 300, rows=(1, 3))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_router_body_is_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's router (512 experts, top 10: four a thread, every barrier and the
    shared slots' alternation over ten picks) and the demo model's (48, top 2), with exact ties."""
    emu = emulate.RouterEmulator(tmp_path, backend)
    assert emulate.check_router(emu, 512, 10, rows=(1, 3))
    assert emulate.check_router(emu, 48, 2, rows=(2,))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_add_norm_body_is_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's hidden size in bfloat16 (eight values a thread, every warp's partial) and
    an odd one in float32 (threads past H idle)."""
    emu = emulate.AddNormEmulator(tmp_path, backend)
    assert emulate.check_add_norm(emu, 2048, rows=(1, 3), dtype=mx.bfloat16)
    assert emulate.check_add_norm(emu, 130, rows=(2,))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_combine_bodies_are_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's combine (H 2048, top 10, renormalised, a gated shared expert) in
    bfloat16, and an odd width's column tail with one pick, in float32; each with the layer's
    residual too."""
    emu = emulate.CombineEmulator(tmp_path, backend)
    for has_residual in (False, True):
        assert emulate.check_combine(emu, 2048, 10, dtype=mx.bfloat16, rows=(1, 3), has_residual=has_residual)
        assert emulate.check_combine(emu, 131, 1, normalize=False, has_shared=False, rows=(2,),
                                     has_residual=has_residual)


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_gated_norm_body_is_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's GDN heads in bfloat16 (a value a thread, four warps), Mamba-2's form over
    Nemotron-H's groups in bfloat16 (four values a thread, eight warps) and an odd size in float32
    (threads past D idle, a tiled weight)."""
    emu = emulate.GatedNormEmulator(tmp_path, backend)
    assert emulate.check_gated_norm(emu, 32, 128, rows=(1, 3), dtype=mx.bfloat16)
    assert emulate.check_gated_norm(emu, 8, 1024, rows=(2,), dtype=mx.bfloat16, gate_first=True, tiled=True)
    assert emulate.check_gated_norm(emu, 3, 130, rows=(2,), tiled=True)


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_attention_prep_body_is_row_invariant_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's attention head in bfloat16 (gate, partial rotary, q/k norm: a value a
    thread, eight warps) and a plain layout in float32 (no gate, full rotary, no norm), at a window
    offset where the angles span many turns (each prelude's sinf and cosf)."""
    emu = emulate.AttentionPrepEmulator(tmp_path, backend)
    assert emulate.check_attention_prep(emu, 16, 2, 256, 64, gate=True, norm=True, rows=(1, 3), dtype=mx.bfloat16,
                                        offsets=(4093,))
    assert emulate.check_attention_prep(emu, 4, 2, 64, 64, gate=False, norm=False, rows=(2,), base=1e4, offsets=(77,))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_embedding_body_gives_mlx_bits_behind_each_prelude(emulate, backend, tmp_path):
    """Qwen3-Next-80B's 4-bit table in bfloat16 and 2 and 8 bits in float32: each row its 1-row
    call's and the reference's bits, a bad id's row zeros (tests/test_embed_rows.py runs every
    form behind the CUDA prelude)."""
    emu = emulate.EmbedRowsEmulator(tmp_path, backend)
    assert emulate.check_embed_rows(emu, 4, 64, rows=(1, 3), dtype=mx.bfloat16)
    assert emulate.check_embed_rows(emu, 2, 128, rows=(2,))
    assert emulate.check_embed_rows(emu, 8, 32, rows=(2,), token_dtype=mx.uint32)


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_reduce_scatter_gives_the_butterflys_bits_behind_each_prelude(emulate, backend, tmp_path):
    """rows_matvec's tail sums over the warp by a reduce-scatter; every output must be the bits
    of the xor butterfly it replaced: the routed experts with up to 8 picks a block (rows 5 and 8
    carry 8 rows), a dense call at 8 columns a warp (two values a lane), the GLU tail's pairing
    (`python -m scripts.lab.kernel_emulate --only tails` runs every kind, R = 1..8)."""
    emu = emulate.Emulator(tmp_path, backend)
    butterfly = emulate.Emulator(tmp_path, backend)
    butterfly.kinds = emulate.butterfly_kinds()
    assert emulate.check_tail(emu, butterfly, "gather", dtype=mx.bfloat16, rows=(1, 5))
    assert emulate.check_tail(emu, butterfly, "dense", cols=8, rows=(8,))
    assert emulate.check_tail(emu, butterfly, "gather_glu", rows=(2,))


def test_the_tail_check_fails_a_tail_that_keeps_the_wrong_half(emulate, tmp_path):
    """A reduce-scatter whose lanes keep the half they should send ends with each sum in another
    lane than the one that writes its column: the check must say so."""
    emu = emulate.Emulator(tmp_path)
    wrong = emulate.Emulator(tmp_path)
    params, body, extra = emulate.KINDS["dense"]
    keep = "const bool upper = (lane & off) != 0;"
    assert body.count(keep) == 20  # five steps in each of four row counts
    wrong.kinds = {**emulate.KINDS, "dense": (params, body.replace(keep, keep.replace("!=", "==")), extra)}
    assert not emulate.check_tail(wrong, emu, "dense", rows=(1,))


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_a_quantized_field_is_the_shifted_field(emulate, tmp_path, backend):
    """strata_quant<BITS>(word, j) is strata_u2f((word >> (BITS * j)) & mask), the same float, for
    every 4- and 8-bit field j of every 16-bit pattern in either half of the word (a field's value
    depends on its own bits alone; the CUDA prelude reads it in place)."""
    body = """    int bad = 0;
    for (unsigned int v = 0; v < 65536u; ++v)
        for (int half = 0; half < 2; ++half) {
            const unsigned int word = half ? v << 16 : v;
            for (int j = 0; j < 8; ++j)
                bad += strata_quant<4>(word, j) != strata_u2f((word >> (4 * j)) & 15u);
            for (int j = 0; j < 4; ++j)
                bad += strata_quant<8>(word, j) != strata_u2f((word >> (8 * j)) & 255u);
        }
    out[0] = static_cast<float>(bad);
"""
    source = emulate.program(emulate.SHIM_BLOCK, backend, "", ["float* out"], "", body)
    source += "int main() { float bad = -1.0f; kernel(&bad); return bad == 0.0f ? 0 : 1; }\n"
    path = tmp_path / f"quant_{backend}"
    emulate.compile_program(path, source)
    assert subprocess.run([str(path)]).returncode == 0
