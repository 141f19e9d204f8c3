"""metal_shaders/rows_mma.py: the window projections on tensor cores (CUDA, bfloat16), 8 rows a call.

There is no GPU here: the bodies run through scripts/lab/mma_emulate.py (g++, the MMA and the bf16
pair conversion in software, from the PTX ISA's fragment layout). Every form must keep each row
(pick) the bits of its 1-row call and stay near the reference; a wrong fragment index must fail.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import backends, rows_mma
from metal_shaders import rows_matvec as kernels
from metal_shaders.columns import ColumnLayout
from scripts.lab.mma_emulate import MmaEmulator


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    emu = MmaEmulator(tmp_path)
    monkeypatch.setattr(rows_mma, "gpu_kernel", emu.gpu_kernel)
    return emu


@pytest.mark.parametrize("what", [case[0] for case in rows_mma.probe_cases()])
def test_each_form_is_row_invariant_and_near_the_reference(emulated, what):
    (case,) = [c for c in rows_mma.probe_cases() if c[0] == what]
    _, kernel, ref, x, experts = case
    assert rows_mma.check_case(kernel, ref, x, experts) is None


def test_picks_sharing_rows_give_the_copied_rows_bits(emulated):
    assert rows_mma.check_shared_rows() is None


def test_mapped_forms_give_the_plain_forms_columns_gathered(emulated):
    assert rows_mma.check_mapped_columns() is None


@pytest.mark.parametrize("mistake", ["weight row", "layout"])
def test_the_check_fails_a_mapped_form_that_ignores_the_map_or_the_layout(emulated, monkeypatch, mistake):
    """A mapped body that reads weight row n0 + g (the plain form's), or writes the plain (R, N)
    layout: its segments side by side are no longer the plain columns gathered."""
    body = rows_mma.QUANTIZED_MAPPED
    if mistake == "weight row":
        wrong = body.replace(rows_mma._COLUMNS_MAPPED, rows_mma._COLUMNS_PLAIN)
    else:
        wrong = body.replace(rows_mma._WRITE_MAPPED, rows_mma._WRITE_PLAIN)
    assert wrong != body
    monkeypatch.setattr(rows_mma, "QUANTIZED_MAPPED", wrong)
    assert rows_mma.check_mapped_columns() == "mapped affine: its columns differ from the plain form's gathered columns"


def test_mapped_bodies_change_only_the_weight_rows_read_and_the_output_index():
    for mapped, plain in ((rows_mma.DENSE_MAPPED, rows_mma.DENSE), (rows_mma.QUANTIZED_MAPPED, rows_mma.QUANTIZED)):
        assert (mapped.replace(rows_mma._COLUMNS_MAPPED, rows_mma._COLUMNS_PLAIN)
                .replace(rows_mma._WRITE_MAPPED, rows_mma._WRITE_PLAIN)) == plain


@pytest.mark.parametrize("old, new", [
    ("strata_mma(d, a0, b0, a1, b1, x0, x1)", "strata_mma(d, a1, b0, a0, b1, x0, x1)"),  # A's k halves
    ("strata_mma(d, a0, b0, a1, b1, x0, x1)", "strata_mma(d, a0, b0, a1, b1, x1, x0)"),  # B's
    ("strata_pairs(xg + at * 32", "strata_pairs(xg + (at ^ 1) * 32"),  # B from another lane's chunk
], ids=["A fragment", "B fragment", "chunk"])
def test_the_check_fails_a_wrong_fragment_or_chunk(emulated, monkeypatch, old, new):
    assert rows_mma.QUANTIZED.count(old) == 1
    monkeypatch.setattr(rows_mma, "QUANTIZED", rows_mma.QUANTIZED.replace(old, new))
    (case,) = [c for c in rows_mma.probe_cases() if c[0] == "affine"]
    assert rows_mma.check_case(*case[1:]) is not None


@pytest.mark.parametrize("split, unroll", [(1, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("what", ["affine", "routed GLU", "routed MXFP4"])
def test_each_k_loop_setting_is_row_invariant_and_near_the_reference(emulated, monkeypatch, what, split, unroll):
    """SPLIT (warps summing a tile's K: one tile a warp at 1) and UNROLL (steps loaded before any
    is multiplied) keep every row its 1-row call's bits; UNROLL never changes a bit."""
    (case,) = [c for c in rows_mma.probe_cases() if c[0] == what]
    _, kernel, ref, x, experts = case
    for kind in rows_mma.LOOPS:
        monkeypatch.setitem(rows_mma.LOOPS, kind, rows_mma.Loop(4, split, 1))
    base = kernel(x, experts)
    for kind in rows_mma.LOOPS:
        monkeypatch.setitem(rows_mma.LOOPS, kind, rows_mma.Loop(4, split, unroll))
    assert rows_mma.check_case(kernel, ref, x, experts) is None
    assert mx.array_equal(kernel(x, experts), base).item()


@pytest.mark.parametrize("warps", [8, 16])
def test_more_warps_summing_a_tile_keep_each_row_its_bits(emulated, monkeypatch, warps):
    """The plain forms' deeper K splits (gpu_owed.sh plain-loop): at the probe's K = 544 (5 steps)
    16 warps leave 11 without a step, and every row still keeps its 1-row call's bits near the
    reference."""
    (case,) = [c for c in rows_mma.probe_cases() if c[0] == "affine"]
    monkeypatch.setitem(rows_mma.LOOPS, "plain", rows_mma.Loop(warps, warps, 1))
    assert rows_mma.check_case(*case[1:]) is None


def test_the_cpu_never_takes_the_tensor_core_forms():
    if mx.default_device() != mx.cpu:
        pytest.fail("this check is for the CPU test machine")
    x = mx.zeros((1, 64), dtype=mx.bfloat16)
    assert not rows_mma.supports(x, 64)
    assert rows_mma.usable() is False and rows_mma.usable(mx.float32) is False
    assert rows_mma.status() == {"usable": False, "probed": True, "error": None}


def test_only_bfloat16_rows_of_a_width_they_take_go_to_tensor_cores(monkeypatch):
    monkeypatch.setattr(rows_mma.probe, "backend", lambda: backends.CUDA)
    monkeypatch.setattr(rows_mma, "usable", lambda dtype=mx.bfloat16: True)
    bf = mx.zeros((2, 128), dtype=mx.bfloat16)
    assert rows_mma.supports(bf, 128) and rows_mma.supports(bf, 128, group_size=64, bits=4)
    assert not rows_mma.supports(bf.astype(mx.float32), 128)
    assert not rows_mma.supports(bf, 100) and not rows_mma.supports(bf, 128, group_size=64, bits=3)
    assert not rows_mma.supports(bf, 96, group_size=64, bits=4)
    monkeypatch.setenv(rows_mma.ENV, "0")
    assert not rows_mma.supports(bf, 128)


def test_the_environment_names_the_forms_left_on(monkeypatch):
    monkeypatch.setattr(rows_mma.probe, "backend", lambda: backends.CUDA)
    monkeypatch.setattr(rows_mma, "usable", lambda dtype=mx.bfloat16: True)
    bf = mx.zeros((2, 128), dtype=mx.bfloat16)
    for value, on in [("", set(rows_mma.DEFAULT_FORMS)), ("1", set(rows_mma.FORMS)), ("0", set()),
                      ("dense, affine", {"dense", "affine"}), ("glu", {"glu"})]:
        monkeypatch.setenv(rows_mma.ENV, value)
        assert rows_mma.forms_on() == on
        assert {f for f in rows_mma.FORMS if rows_mma.supports(bf, 128, form=f)} == on
        assert rows_mma.supports(bf, 128) == bool(on)  # a call that names no form: any form on
    monkeypatch.delenv(rows_mma.ENV)
    assert rows_mma.forms_on() == set(rows_mma.FORMS) - {"glu"}  # the routed GLU join: its FMA form
    monkeypatch.setenv(rows_mma.ENV, "dense,mxfp")
    with pytest.raises(ValueError, match="comma list of dense, affine, routed, glu, plain-glu, mapped; got 'dense,mxfp'"):
        rows_mma.supports(bf, 128, form="dense")


def test_rows_matvec_sends_bfloat16_windows_to_tensor_cores_unless_told(monkeypatch, emulated):
    """The dispatch: with the tensor-core forms usable, rows_matvec's calls at bfloat16 take them
    (the emulated kernels' bits), `tensor_cores=False` its own FMA form (here its reference)."""
    monkeypatch.setattr(rows_mma, "supports", lambda x, K, **kw: x.dtype == mx.bfloat16)
    fma = []
    monkeypatch.setattr(kernels, "_kernel", lambda name, *a, **k: fma.append(name) or (lambda **kw: [
        mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]))
    K, N = 128, 48
    x = mx.random.normal((3, K), key=mx.random.key(1)).astype(mx.bfloat16)
    w = (mx.random.normal((N, K), key=mx.random.key(2)) * K**-0.5).astype(mx.bfloat16)
    qw, qs, qb = mx.quantize(w, 64, 4)
    got = kernels.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4)
    expected = rows_mma.reference(x, rows_mma._dense(qw, qs, qb, group_size=64))
    assert np.allclose(np.array(got.astype(mx.float32)), np.array(expected.astype(mx.float32)), atol=0.03)
    assert emulated.launches == 1 and not fma
    kernels.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4, tensor_cores=False)
    assert fma == ["strata_rows_qmatvec_v4"] and emulated.launches == 1
    # the GLU of one pair and the column-mapped forms likewise
    up = mx.quantize(w[::-1], 64, 4)
    glu = kernels.rows_glu_qmatvec(x, (qw, qs, qb), up, group_size=64, bits=4)
    expected = rows_mma.reference_glu(expected, rows_mma.reference(x, rows_mma._dense(*up, group_size=64)))
    assert np.allclose(np.array(glu.astype(mx.float32)), np.array(expected.astype(mx.float32)), atol=0.03)
    layout = ColumnLayout(mx.array([5, 0, 47, 3, 3], dtype=mx.uint32), (2,))
    for tc in (True, False):
        parts = kernels.rows_qmatvec_mapped(x, qw, qs, qb, layout, group_size=64, bits=4, tensor_cores=tc)
        assert [p.shape for p in parts] == [(3, 2), (3, 3)]
        parts = kernels.rows_matvec_mapped(x, w, layout, tensor_cores=tc)
    assert emulated.launches == 4
    assert fma[1:] == ["strata_rows_qmatvec_mapped_v3", "strata_rows_matvec_mapped_v3"]


def test_launch_shapes(monkeypatch):
    """Plain forms: 16 output columns a block (8 for the GLU join), its warps splitting K.
    Routed experts: each of a block's 4 warps sums its own tile over all of K, so a block holds 4
    tiles; picks on the grid's second axis unless `picks_x`."""
    assert rows_mma._grid(151936, rows_mma.PLAIN_COLS) == ((9496 * 256, 1, 1), (256, 1, 1))  # the default 8/8/1
    monkeypatch.setitem(rows_mma.LOOPS, "plain", rows_mma.Loop(4, 4, 1))
    assert rows_mma._grid(151936, rows_mma.PLAIN_COLS) == ((9496 * 128, 1, 1), (128, 1, 1))
    assert rows_mma._grid(512, rows_mma.GLU_COLS) == ((64 * 128, 1, 1), (128, 1, 1))
    assert rows_mma._grid(2048, rows_mma.PLAIN_COLS, 80, kind="routed") == ((32 * 128, 80, 1), (128, 1, 1))
    assert rows_mma._grid(512, rows_mma.GLU_COLS, 80, kind="routed") == ((16 * 128, 80, 1), (128, 1, 1))
    assert rows_mma._grid(2880, rows_mma.PLAIN_COLS, 12, True, kind="routed") == ((12 * 128, 45, 1), (128, 1, 1))


def test_routed_calls_run_the_routed_loop(monkeypatch):
    """The routed forms launch with LOOPS["routed"]'s grid and template, the plain ones with
    LOOPS["plain"]'s, so a study can set one kind without the other."""
    monkeypatch.setitem(rows_mma.LOOPS, "routed", rows_mma.Loop(4, 1, 2))
    seen = {}

    def recording(name, inputs, outputs, body, header=""):
        def launch(*, template, grid, threadgroup, output_shapes, output_dtypes, **_):
            seen[name] = (tuple(dict(template)[k] for k in ("WARPS", "SPLIT", "UNROLL")), grid)
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(rows_mma, "gpu_kernel", recording)
    for _, kernel, _, x, experts in rows_mma.probe_cases():
        kernel(x, experts)
    routed = {n for n in seen if "gather" in n}
    assert len(routed) == 3 and all(seen[n][0] == (4, 1, 2) for n in routed)
    assert len(seen) > 3 and all(seen[n][0] == tuple(rows_mma.LOOPS["plain"]) for n in set(seen) - routed)
    assert seen["strata_mma_gather_qmatvec_v2"][1][0] == -(-200 // 64) * 128  # N = 200: 4 tiles of 16 a block
    monkeypatch.setitem(rows_mma.LOOPS, "routed", rows_mma.Loop(4, 2, 1))
    with pytest.raises(ValueError, match="split is 1 or its warps"):
        rows_mma._grid(2048, rows_mma.PLAIN_COLS, kind="routed")


def test_a_k_loop_setting_is_read_and_set_as_written(monkeypatch):
    from scripts.lab import mma_loop
    monkeypatch.setattr(rows_mma, "LOOPS", dict(rows_mma.LOOPS))
    mma_loop.apply("8/1/2", "routed")
    assert rows_mma.LOOPS == {"plain": (8, 8, 1), "routed": (8, 1, 2)}
    mma_loop.apply("2/2/4")
    assert rows_mma.LOOPS == {"plain": (2, 2, 4), "routed": (2, 2, 4)}
    for bad in ("4/2/1", "4/4", "4/4/0", "a/4/1"):
        with pytest.raises(ValueError, match="WARPS/SPLIT/UNROLL"):
            mma_loop.parse(bad)
