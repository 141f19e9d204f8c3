"""metal_shaders/rows_matvec.py's column-mapped forms: output column j from weight row map[j], so
GDN's decode-window head writes [conv inputs | z | b | a] in one launch, with no gather after it,
each of the four contiguous (no copy before the kernels that read them).

There is no GPU here: the bodies run through scripts/lab/kernel_emulate.py (g++, float32 and
bfloat16 in software). Each row of an R-row call must equal its 1-row call bit for bit, and the
call (its segments side by side) must equal the plain kernel's output with its columns gathered
by the map bit for bit; a
GDN layer's head through the emulated mapped kernel must give today's bits (the plain kernel and
one gather).
"""

import logging

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from metal_shaders import backends, precompiled
from metal_shaders import rows_matvec as kernels
from metal_shaders.columns import ColumnLayout
from scripts.bench.synthetic import randomized
from strata_cli.model import gdn, layers
from strata_cli.model.mamba2 import Mamba2Mixer
from strata_cli.model.quant import quantize
from test_glu_kernels import emulated_kernel

# The plain row read of a body, and what a body that ignores the map reads instead of `mapped[c]`.
PLAIN_ROW = "const int n = n0 + c < N ? n0 + c : n0;"
MAPPED_ROW = "const int n = mapped[c];"


@pytest.fixture(scope="module")
def emulator(emulate, tmp_path_factory):
    return emulate.Emulator(tmp_path_factory.mktemp("mapped-emulate"))


@pytest.mark.parametrize("kind, dtype, bits, gs", [
    ("dense_mapped", mx.float32, 4, 64),
    ("dense_mapped", mx.bfloat16, 4, 64),  # the 80B's GDN projections stored in bfloat16
    ("quantized_mapped", mx.bfloat16, 4, 64),  # ... and 4-bit
    ("quantized_mapped", mx.float32, 8, 32),
])
def test_emulated_mapped_kernels_are_row_invariant_and_the_plain_columns_gathered(emulate, emulator, kind, dtype,
                                                                                   bits, gs):
    """(kernel_emulate.py --only mapped runs R = 1..8 and more forms.)"""
    assert emulate.check_mapped(emulator, kind, dtype=dtype, bits=bits, gs=gs, rows=(1, 3, 8))


@pytest.mark.parametrize("kind", ["dense_mapped", "quantized_mapped"])
def test_the_check_fails_a_body_that_ignores_the_map(emulate, emulator, tmp_path, monkeypatch, kind):
    """A body that reads weight row n0 + c (the plain kernel's) for output column n0 + c: a
    reordering map (every row once, so the plain rows stay in range) then shows."""
    params, body, extra = emulate.KINDS[kind]
    ignoring = body.replace(MAPPED_ROW, PLAIN_ROW)
    assert ignoring != body
    reversed_map = mx.arange(37, -1, -1).astype(mx.uint32)
    assert emulate.check_mapped(emulator, kind, rows=(2,), columns=reversed_map)
    monkeypatch.setitem(emulate.KINDS, kind, (params, ignoring, extra))
    assert not emulate.check_mapped(emulate.Emulator(tmp_path), kind, rows=(2,), columns=reversed_map)


@pytest.mark.parametrize("kind", ["dense_mapped", "quantized_mapped"])
def test_the_check_fails_a_body_that_writes_rows_whole(emulate, emulator, tmp_path, monkeypatch, kind):
    """A body that writes the plain (R, N) layout, not segment by segment: at R > 1 the
    segments it leaves are other rows' columns (at R = 1 the two layouts are one)."""
    params, body, extra = emulate.KINDS[kind]
    whole = body.replace(kernels._SEGMENT_OUT, kernels._PLAIN_OUT)
    assert whole != body
    monkeypatch.setitem(emulate.KINDS, kind, (params, whole, extra))
    assert emulate.check_mapped(emulate.Emulator(tmp_path), kind, rows=(1,))
    assert not emulate.check_mapped(emulate.Emulator(tmp_path), kind, rows=(2,))


def test_mapped_bodies_change_only_the_weight_row_read_and_the_output_index():
    """Taking the map's read out and writing the plain index gives the plain body back,
    character for character: the arithmetic and the reduction order are the plain kernel's. The
    plain bodies stay as they were (their compiled cubins are kept by source)."""
    for mapped, plain in ((kernels.DENSE_MAPPED, kernels.DENSE), (kernels.QUANTIZED_MAPPED, kernels.QUANTIZED)):
        assert mapped.count(MAPPED_ROW) == 1 and mapped.count(kernels._SEGMENT_OUT) == plain.count(kernels._PLAIN_OUT)
        assert "mapped[" not in plain and "col_map" not in plain
        assert (mapped.replace(kernels._MAPPED_ROWS, "").replace(MAPPED_ROW, PLAIN_ROW)
                .replace(kernels._SEGMENT_OUT, kernels._PLAIN_OUT)) == plain
        assert not precompiled.reads_shapes(mapped, ["dims", "x", "w", "scales", "biases", "col_map"])


def test_mapped_calls_pass_the_layout_as_data(monkeypatch):
    """What the wrappers hand to the kernel maker: their own names and bodies, the layout's data
    last, N its column count (as data), the plain kernels' template values, a flat (R·N,) output
    cut into its segments."""
    calls = []

    def fake(name, inputs, source, extra=""):
        def kernel(**kw):
            calls.append((name, inputs, source, kw))
            return [mx.arange(kw["output_shapes"][0][0]).astype(kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    w = mx.zeros((40, 128))
    q = mx.quantize(w, 64, 4)
    x = mx.zeros((1, 3, 128), dtype=mx.bfloat16)
    layout = ColumnLayout(mx.array([39, 0, 5, 5, 7], dtype=mx.uint32), (2,))
    assert layout.data.tolist() == [39, 0, 5, 5, 7] + [0, 0, 2, 2, 2] + [2, 2, 3, 3, 3]
    dense = kernels.rows_matvec_mapped(x, w, layout)
    assert [p.shape for p in dense] == [(1, 3, 2), (1, 3, 3)]
    assert dense[0].reshape(-1).tolist() == list(range(6)) and dense[1].reshape(-1).tolist() == list(range(6, 15))
    quantized = kernels.rows_qmatvec_mapped(x, *q, layout, group_size=64, bits=4)
    assert [p.shape for p in quantized] == [(1, 3, 2), (1, 3, 3)]
    (dname, dinputs, dsource, dkw), (qname, qinputs, qsource, qkw) = calls
    assert dsource is kernels.DENSE_MAPPED and qsource is kernels.QUANTIZED_MAPPED
    assert "mapped" in dname and "mapped" in qname and dname != "strata_rows_matvec_v3"
    assert dinputs[-1] == qinputs[-1] == "col_map"
    assert dkw["inputs"][-1] is layout.data and qkw["inputs"][-1] is layout.data
    assert dkw["inputs"][0].tolist() == qkw["inputs"][0].tolist() == [3, 128, 5]
    assert dkw["output_shapes"] == qkw["output_shapes"] == [(15,)]
    assert dict(dkw["template"]) == {"T": mx.bfloat16, "TW": mx.float32, "ROWS": 4, "COLS": kernels.COLS}
    assert dict(qkw["template"]) == {"T": mx.bfloat16, "TS": mx.float32, "BITS": 4, "GS": 64, "ROWS": 4,
                                     "COLS": kernels.COLS}
    columns = mx.array([1, 2, 3], dtype=mx.uint32)
    for bad in ((columns.reshape(1, 3), ()), (columns, (0,)), (columns, (2, 2)), (columns, (3,))):
        with pytest.raises(ValueError, match="column map|do not split"):
            ColumnLayout(*bad)


def test_segments_are_runs_of_the_flat_output_and_one_segment_is_the_plain_layout():
    """Each part a flat output is cut into is one run of it, rows one after another (a slice and
    a reshape: a kernel reading it needs no copy); with no bounds the one part is the (..., N)
    rows as written."""
    out = mx.arange(2 * 3 * 7)
    parts = ColumnLayout(mx.arange(7), (4, 5)).parts(out, (2, 3))
    assert [p.shape for p in parts] == [(2, 3, 4), (2, 3, 1), (2, 3, 2)]
    assert parts[1].reshape(-1).tolist() == list(range(24, 30))
    (whole,) = ColumnLayout(mx.arange(7)).parts(out, (2, 3))
    assert whole.tolist() == out.reshape(2, 3, 7).tolist()


# -- the model's use ----------------------------------------------------------------------------

def gdn_layer(dtype, bits: int | None) -> gdn.GatedDeltaNet:
    """A small GDN layer (Hk 2, Hv 4, Dk = Dv = 32, hidden 64: shapes the kernels take) with its
    input projections stacked, as loading leaves them."""
    layer = gdn.GatedDeltaNet(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
                              conv_kernel=4, eps=1e-6)
    randomized(layer, 60, scale=0.3)
    layer.set_dtype(dtype)
    if bits:
        quantize(layer, group_size=32, bits=bits)
    layer.stack_linears()
    mx.eval(layer.parameters())
    return layer


def run_through(monkeypatch, emu, fn, x, *, mapped: bool):
    """`fn(x)` with the plain row kernels usable and emulated (and the column-mapped forms where
    `mapped`), and the kernels' calls."""
    calls = []
    with monkeypatch.context() as m:
        m.setattr(layers.CpuShortCalls, "mode", "never")
        m.setattr(kernels, "kernels_usable", lambda dtype=None: True)
        m.setattr(kernels, "mapped_usable", lambda dtype=None: mapped)
        m.setattr(kernels, "gpu_kernel", emulated_kernel(emu, calls))
        out = fn(x)
        mx.eval(out)
        return out, calls


def same_bits(a, b) -> bool:
    flat_a, flat_b = tree_flatten(a), tree_flatten(b)
    return len(flat_a) == len(flat_b) and all(
        x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
        for (_, x), (_, y) in zip(flat_a, flat_b))


def assert_mapped_head_gives_plain_bits(monkeypatch, emulator, head, dtype, bits, windows):
    """`head` of (1, T, 64) inputs: one mapped launch, the bits of the plain launch (and its split or gather)."""
    plain = "quantized" if bits else "dense"
    for T in windows:
        x = mx.random.normal((1, T, 64), key=mx.random.key(T)).astype(dtype)
        want, plain_calls = run_through(monkeypatch, emulator, head, x, mapped=False)
        got, calls = run_through(monkeypatch, emulator, head, x, mapped=True)
        assert plain_calls == [(plain, T)] and calls == [(f"{plain}_mapped", T)]
        assert same_bits(got, want)


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (mx.bfloat16, None), (mx.bfloat16, 4),
                                         (mx.float32, 8)])
def test_a_gdn_head_through_the_mapped_kernel_gives_todays_bits(monkeypatch, emulator, dtype, bits):
    """A decode window's head (T = 1 and 5): one launch of the column-mapped kernel, where today
    runs the plain kernel and one gather, and every output (conv inputs, b, a, z) the same bits."""
    layer = gdn_layer(dtype, bits)
    assert_mapped_head_gives_plain_bits(monkeypatch, emulator, layer.head, dtype, bits, windows=(1, 5))


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (mx.bfloat16, 4)])
def test_a_mamba2_head_through_the_mapped_kernel_gives_the_plain_kernels_bits(monkeypatch, emulator, dtype, bits):
    """in_proj's [z | xBC | dt] as three contiguous parts of one mapped launch (no map: each
    column its own row), the bits of the plain kernel and a split; MLX's path (no kernel) splits."""
    layer = Mamba2Mixer(hidden_size=64, num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, eps=1e-5,
                        time_step_limit=(0.0, float("inf")), use_bias=False, use_conv_bias=True)
    randomized(layer, 64, scale=0.3)
    layer.set_dtype(dtype)
    if bits:
        quantize(layer, group_size=32, bits=bits)
    mx.eval(layer.parameters())
    assert_mapped_head_gives_plain_bits(monkeypatch, emulator, layer.head, dtype, bits, windows=(1, 3))
    monkeypatch.setattr(layers.CpuShortCalls, "mode", "never")
    I, C = layer.intermediate_size, layer.conv_dim
    x = mx.random.normal((1, 3, 64), key=mx.random.key(3)).astype(dtype)
    z, xBC, dt = mx.split(layer.in_proj(x), [I, I + C], axis=-1)
    assert same_bits(layer.head(x), ((xBC, dt), (z,)))  # the CPU: no probe passes, a matmul and a split


def test_a_gdn_head_whose_kernel_ignores_the_map_differs(monkeypatch, emulate, emulator, tmp_path):
    """The layer test notices a body that reads the plain kernel's rows."""
    params, body, extra = emulate.KINDS["dense_mapped"]
    layer = gdn_layer(mx.float32, None)
    x = mx.random.normal((1, 3, 64), key=mx.random.key(3))
    today, _ = run_through(monkeypatch, emulator, layer.head, x, mapped=False)
    monkeypatch.setitem(emulate.KINDS, "dense_mapped", (params, body.replace(MAPPED_ROW, PLAIN_ROW), extra))
    got, calls = run_through(monkeypatch, emulate.Emulator(tmp_path), layer.head, x, mapped=True)
    assert calls == [("dense_mapped", 3)] and not same_bits(got, today)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_stacked_heads_off_the_kernel_equal_the_unstacked_split(monkeypatch, dtype):
    """Without the kernels (the CPU's MLX path: `ColumnMap.take`, one gather) a stacked layer's
    head equals the unstacked projections' per-output gathers bit for bit, for a window and for
    a batch of two rows (whose gather broadcasts the map)."""
    monkeypatch.setattr(layers.CpuShortCalls, "mode", "never")
    layer = gdn_layer(dtype, None)
    for shape in ((1, 5, 64), (2, 1, 64)):
        x = mx.random.normal(shape, key=mx.random.key(7)).astype(dtype)
        stacked = layer.head(x)
        qkvz, ba = layer.in_proj_qkvz(x), layer.in_proj_ba(x)
        raw, z, b, a = layer.split(qkvz, ba)
        assert same_bits(stacked, ((raw, b, a), (z.reshape(*shape[:2], -1),)))


def test_column_maps_index_windows_without_a_broadcast():
    columns = layers.ColumnMap(mx.array([2, 0, 1]))
    assert columns.flat.dtype == mx.uint32 and columns.flat.tolist() == [2, 0, 1]
    assert [c.shape for c in columns.by_rows] == [(1, T, 3) for T in range(1, layers.WINDOW_ROWS + 1)]
    y = mx.arange(24).reshape(2, 4, 3)
    assert [p.tolist() for p in columns.take(y[:1])] == [y[:1, :, [2, 0, 1]].tolist()]
    assert [p.tolist() for p in columns.take(y)] == [y[:, :, [2, 0, 1]].tolist()]
    split = layers.ColumnMap(mx.array([2, 0, 1]), (1,))
    assert [p.tolist() for p in split.take(y)] == [y[:, :, [2]].tolist(), y[:, :, [0, 1]].tolist()]


def test_an_identity_column_map_splits_without_a_gather(monkeypatch):
    """Mamba-2's in_proj parts off the kernel: the columns in place, cut at the bounds; a map of
    the first columns only still gathers them."""
    parts = layers.ColumnMap(mx.arange(3), (1,))
    assert parts.identity and not layers.ColumnMap(mx.array([2, 0, 1])).identity
    y = mx.arange(24).reshape(2, 4, 3)
    monkeypatch.setattr(mx, "take_along_axis", lambda *a, **k: pytest.fail("an identity map gathered"))
    assert [p.tolist() for p in parts.take(y)] == [y[:, :, :1].tolist(), y[:, :, 1:].tolist()]
    monkeypatch.undo()
    wider = mx.arange(32).reshape(2, 4, 4)
    assert [p.tolist() for p in parts.take(wider)] == [wider[:, :, :1].tolist(), wider[:, :, 1:3].tolist()]


# -- the start-up probe -------------------------------------------------------------------------

def test_the_probe_passes_the_emulated_kernels_and_refuses_a_wrong_map(monkeypatch, emulator):
    """The probe's own checks (float32 here: each dtype is a dozen g++ builds), on the emulated
    kernels; a call that reads its columns in another order fails it."""
    calls = []
    monkeypatch.setattr(kernels, "gpu_kernel", emulated_kernel(emulator, calls))
    assert kernels._check_mapped(dtypes=(mx.float32,)) is None
    assert {kind for kind, _ in calls} == {"dense", "dense_mapped", "quantized", "quantized_mapped"}
    assert ("dense_mapped", 1) in calls and ("quantized_mapped", 8) in calls
    emulated = kernels.rows_matvec_mapped
    monkeypatch.setattr(kernels, "rows_matvec_mapped", lambda x, w, layout, **kw: emulated(
        x, w, ColumnLayout(mx.sort(layout.columns), layout.bounds), **kw))
    assert kernels._check_mapped(dtypes=(mx.float32,)) == (
        "column-mapped kernel and the plain kernel's gathered columns differ (mlx.core.float32)")


def test_a_failing_mapped_probe_turns_only_the_mapped_forms_off(monkeypatch, caplog, failing_metal):
    """Stand-in Metal makers return zeros: rows agree and zeros gather to zeros, but the
    reference does not, so the probe turns the column-mapped forms off (logged once), and the
    layer gathers the plain kernel's columns."""
    made = failing_metal(kernels, "row-invariant column-mapped matrix kernels", "_mapped_probe")
    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    linear = randomized(layers.RowLinear(64, 40, bias=False), 61)
    columns = layers.ColumnMap(mx.array([39, 1, 2]))
    x = mx.zeros((1, 2, 64))
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        assert [p.shape for p in linear.mapped(x, columns)] == [(1, 2, 3)]
    assert "row-invariant column-mapped matrix kernels disabled" in caplog.text
    assert kernels.mapped_status() == {"usable": False, "probed": True,
                                       "error": "column-mapped kernel and reference disagree (mlx.core.float32)"}
    assert any(spec["source"] == backends.source(backends.METAL, kernels.DENSE_MAPPED) for spec in made)
    count = len(made)
    linear.mapped(x, columns)
    assert len(made) == count  # decided once per process


def test_the_cpu_and_prompt_chunks_never_take_the_mapped_kernels(monkeypatch):
    def unexpected(*args, **kwargs):
        raise AssertionError("a column-mapped kernel was called")

    monkeypatch.setattr(kernels, "rows_matvec_mapped", unexpected)
    monkeypatch.setattr(kernels, "rows_qmatvec_mapped", unexpected)
    linear = randomized(layers.RowLinear(64, 40, bias=False), 62)
    columns = layers.ColumnMap(mx.array([39, 1, 2]), (1,))
    x = mx.random.normal((1, 2, 64), key=mx.random.key(8))
    expected = mx.split(linear(x)[..., mx.array([39, 1, 2])], [1], axis=-1)
    assert same_bits(linear.mapped(x, columns), expected)  # the CPU: no probe passes
    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "mapped_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "rows_matvec", kernels.reference_matvec)
    chunk = mx.random.normal((1, 9, 64), key=mx.random.key(9))
    assert [p.shape for p in linear.mapped(chunk, columns)] == [(1, 9, 1), (1, 9, 2)]  # a prompt chunk
    biased = randomized(layers.RowLinear(64, 40, bias=True), 63)
    assert [p.shape for p in biased.mapped(x, columns)] == [(1, 2, 1), (1, 2, 2)]  # a bias: a gather
    monkeypatch.setattr(layers.RowSplit, "mode", "never")
    assert same_bits(linear.mapped(x, columns), expected)
