"""metal_shaders: the references the kernels are held to, and where the kernels may run.

The kernels themselves run only on a GPU (scripts/bench/row_probe.py and `strata selftest` check
them there, docs/benchmarks.md records the runs); here the references are checked against MLX's
own operations, and the CPU is shown to never take the kernel path.
"""

import re

import mlx.core as mx
import pytest

from metal_shaders import attention_window, gdn_window
from metal_shaders import rows_matvec as kernels


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_quantized_reference_matches_mlx(bits, group_size):
    x = mx.random.normal((5, 128), key=mx.random.key(1))
    w = mx.random.normal((48, 128), key=mx.random.key(2)) * 0.1
    qw, qs, qb = mx.quantize(w, group_size, bits)
    expected = mx.quantized_matmul(x, qw, qs, qb, transpose=True, group_size=group_size, bits=bits)
    got = kernels.reference_qmatvec(x, qw, qs, qb, group_size=group_size, bits=bits)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


def test_dense_reference_matches_mlx():
    x = mx.random.normal((3, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    w = mx.random.normal((40, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    got = kernels.reference_matvec(x, w)
    assert got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), (x @ w.T).astype(mx.float32), atol=0.1, rtol=2e-2).item()


def test_supported_shapes():
    assert kernels.supports(2048) and not kernels.supports(100)
    assert kernels.supports(2048, group_size=64, bits=4) and kernels.supports(512, group_size=32, bits=8)
    assert not kernels.supports(2048, group_size=64, bits=3) and not kernels.supports(96, group_size=64, bits=4)


@pytest.mark.parametrize("usable, status", [
    (kernels.kernels_usable, kernels.status),
    (kernels.glu_usable, kernels.glu_status),
    (kernels.mapped_usable, kernels.mapped_status),
    (gdn_window.usable, gdn_window.status),
    (attention_window.usable, attention_window.status),
], ids=["rows_matvec", "rows_matvec GLU", "rows_matvec column-mapped", "gdn_window", "attention_window"])
def test_the_cpu_never_takes_a_kernel_path(usable, status):
    """Every kernel family of metal_shaders stays off on the CPU, and says it was asked."""
    if mx.default_device() != mx.cpu:
        pytest.fail("this check is for the CPU test machine")
    assert usable() is False
    assert status() == {"usable": False, "probed": True, "error": None}


def test_row_capacity_and_launch_shape():
    assert [kernels.row_capacity(r) for r in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    config = kernels.launch_config(3, 151936)
    threads = kernels.WARPS * 32
    assert config["threadgroup"] == (threads, 1, 1)
    blocks = config["grid"][0] // threads
    assert (blocks - 1) * kernels.WARPS * kernels.COLS < 151936 <= blocks * kernels.WARPS * kernels.COLS
    assert dict(config["template"]) == {"ROWS": 4, "COLS": kernels.COLS}
    for bad in (0, 9):
        with pytest.raises(ValueError, match="1..8 rows"):
            kernels.launch_config(bad, 64)


def test_calls_pass_row_count_and_shapes_as_data(monkeypatch):
    """What `rows_qmatvec` hands to the kernel maker: one source per kind, the row tier and
    the columns per warp as template values, R/K/N as data, one output of (R, N)."""
    calls = []

    def fake(name, inputs, source):
        def kernel(**kw):
            calls.append((name, inputs, source, kw))
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    w = mx.random.normal((40, 128), key=mx.random.key(5))
    qw, qs, qb = mx.quantize(w, 64, 4)
    x = mx.zeros((5, 128), dtype=mx.bfloat16)
    out = kernels.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4)
    dense = kernels.rows_matvec(x[:1], w, cols=2)
    assert out.shape == (5, 40) and out.dtype == mx.bfloat16 and dense.shape == (1, 40)
    (qname, _, qsource, qkw), (dname, _, dsource, dkw) = calls
    assert qsource is kernels.QUANTIZED and dsource is kernels.DENSE and qname != dname
    assert qkw["inputs"][0].tolist() == [5, 128, 40]
    assert dict(qkw["template"]) == {"T": mx.bfloat16, "TS": mx.float32, "BITS": 4, "GS": 64, "ROWS": 8, "COLS": kernels.COLS}
    assert dict(dkw["template"]) == {"T": mx.bfloat16, "TW": mx.float32, "ROWS": 1, "COLS": 2}


def test_sources_reduce_in_an_order_set_by_k_alone():
    """The per-row order must not read the row count: before the tail the row count only ends
    the loop over rows (loads and multiply-adds); in the tail it picks how many rows the
    reduce-scatter carries and which it writes, never the order of a sum (the tails' bits are
    the butterfly's: kernel_emulate's check_tail)."""
    for source in (kernels.DENSE, kernels.QUANTIZED):
        assert "for (int u = lane; u < KC; u += 32)" in source
        assert "strata_xor(" in source and "atomic" not in source
        assert source.endswith(kernels._TAIL)
        body = source[: -len(kernels._TAIL)]
        assert body.count("if (r >= R) break;") == 1
        assert len(re.findall(r"\bR\b", body)) == 2  # declared, then read by the break alone
        assert "strata_xor(" not in body


def test_kernel_bench_runs_the_reference_path_on_the_cpu():
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_shape("t", 64, 40, use_kernel=False, repeats=1, inner=1, peak_gbs=1.0, cols=(2,))
    assert [r["R"] for r in records] == list(kernel_bench.ROWS)
    assert all(r["identical_to_1_row"] for r in records)
    assert all(r["max_abs_diff"] < 0.05 and r["ms"]["kernel"] > 0 for r in records)
    assert "lm_head" in kernel_bench.render({"device": "cpu", "mlx": "x", "path": "reference", "kernels": {},
                                             "all_rows_identical": True,
                                             "records": [dict(records[0], shape="lm_head")]})


def test_gather_reference_matches_mlx():
    x = mx.random.normal((6, 128), key=mx.random.key(11))
    w = mx.random.normal((5, 48, 128), key=mx.random.key(12)) * 0.1
    qw, qs, qb = mx.quantize(w, 64, 4)
    experts = mx.array([4, 0, 4, 2, 2, 4], dtype=mx.uint32)
    expected = mx.gather_qmm(x[:, None, :], qw, qs, qb, rhs_indices=experts, transpose=True, group_size=64, bits=4)
    got = kernels.reference_gather_qmatvec(x, qw, qs, qb, experts, group_size=64, bits=4)
    assert got.shape == (6, 48)
    assert mx.allclose(got, expected[:, 0], atol=1e-4, rtol=1e-4).item()


def test_window_picks_take_the_gather_kernel_where_it_runs(monkeypatch):
    """gather_qmatmul hands a window's unsorted picks (M, 1, K) to the routed-experts kernel and
    keeps its (M, 1, N) contract; sorted (prompt) calls and RowSplit "never" stay on MLX."""
    from strata_cli.model import moe
    from strata_cli.model.layers import RowSplit

    calls = []

    def fake(x, w, s, b, experts, *, group_size, bits):
        calls.append(x.shape)
        rows = x.reshape(-1, x.shape[-1])
        out = kernels.reference_gather_qmatvec(rows, w, s, b, experts, group_size=group_size, bits=bits)
        return out.reshape(*x.shape[:-1], -1)

    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "rows_gather_qmatvec", fake)
    x = mx.random.normal((4, 1, 128), key=mx.random.key(13))
    qw, qs, qb = mx.quantize(mx.random.normal((3, 40, 128), key=mx.random.key(14)) * 0.1, 64, 4)
    experts = mx.array([2, 0, 2, 1], dtype=mx.uint32)
    plain = mx.gather_qmm(x, qw, qs, qb, rhs_indices=experts, transpose=True, group_size=64, bits=4)
    got = moe.gather_qmatmul(x, qw, qs, qb, experts, group_size=64, bits=4, is_sorted=False)
    assert calls == [(4, 1, 128)] and got.shape == (4, 1, 40)  # handed over without a reshape
    assert mx.allclose(got, plain, atol=1e-4, rtol=1e-4).item()
    order = mx.array([1, 3, 0, 2])
    moe.gather_qmatmul(x[order], qw, qs, qb, experts[order], group_size=64, bits=4, is_sorted=True)
    monkeypatch.setattr(RowSplit, "mode", "never")
    moe.gather_qmatmul(x, qw, qs, qb, experts, group_size=64, bits=4, is_sorted=False)
    assert len(calls) == 1


def test_window_picks_sharing_rows_keep_the_copied_rows_bits(monkeypatch):
    """A resident quantized window hands the routed-experts kernel x's rows as they are (k picks
    a row, `glu_by_expert`'s `shared_rows`): no copy of each row per pick, no reshapes, and the
    same bits as the rows copied; without the kernel, gather_qmatmul copies the rows itself."""
    from strata_cli.model import moe

    calls = []

    def fake(x, w, s, b, experts, *, group_size, bits):
        rows = x.reshape(-1, x.shape[-1])
        per = experts.size // rows.shape[0]
        calls.append((x.shape, per))
        out = kernels.reference_gather_qmatvec(mx.repeat(rows, per, axis=0), w, s, b, experts, group_size=group_size,
                                               bits=bits)
        return out.reshape(*x.shape[:-1], -1) if per == 1 else out.reshape(*x.shape[:-1], per, -1)

    glu = moe.SwitchGLU(128, 64, 6)
    glu.update({k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.1
                for i, (k, v) in enumerate(glu.parameters().items())})
    glu = glu.to_quantized(group_size=64, bits=4)
    x = mx.random.normal((1, 3, 128), key=mx.random.key(15))
    inds = mx.array([[[2, 0], [5, 2], [1, 1]]], dtype=mx.uint32)
    assert not glu.takes_shared_rows(x, inds)  # the CPU: no kernel
    copied = moe.gather_qmatmul(mx.repeat(x.reshape(3, 1, 128), 2, axis=0), glu.gate_proj.weight, glu.gate_proj.scales,
                                glu.gate_proj.biases, inds.reshape(-1), group_size=64, bits=4, is_sorted=False)
    shared = moe.gather_qmatmul(x, glu.gate_proj.weight, glu.gate_proj.scales, glu.gate_proj.biases, inds.reshape(-1),
                                group_size=64, bits=4, is_sorted=False)
    assert shared.shape == (1, 3, 2, 64) and mx.array_equal(shared.reshape(copied.shape), copied).item()
    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "rows_gather_qmatvec", fake)
    assert glu.takes_shared_rows(x, inds)
    got = glu(x, inds)
    assert calls == [((1, 3, 128), 2), ((1, 3, 128), 2), ((1, 3, 2, 64), 1)]
    monkeypatch.setattr(moe.QuantizedSwitchGLU, "takes_shared_rows", lambda self, x, inds: False)
    want = glu(x, inds)  # each row copied per pick, as streamed experts send them
    assert calls[3:] == [((6, 1, 128), 1), ((6, 1, 128), 1), ((6, 1, 64), 1)]
    assert got.shape == want.shape == (1, 3, 2, 128) and mx.array_equal(got, want).item()


def test_sigmoid_router_windows_take_the_row_kernel_in_one_call(monkeypatch):
    """The float32 sigmoid router (Nemotron-H, GLM-4.x, DeepSeek-V3) hands a window's rows to the
    row-invariant kernel in one call where it runs, instead of one matmul per row; prompt chunks
    and RowSplit "never" keep MLX's matmul."""
    from strata_cli.model import moe
    from strata_cli.model.layers import RowSplit

    calls = []

    def fake(x, w):
        calls.append((x.shape, x.dtype, w.dtype))
        return x @ w.T

    router = moe.SigmoidTopkRouter(hidden_size=64, num_experts=8, top_k=2)
    router.weight = mx.random.normal((8, 64), key=mx.random.key(3))
    x = mx.random.normal((5, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    plain = router(x)
    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "rows_matvec", fake)
    assert mx.array_equal(router(x), plain).item()
    assert calls == [((5, 64), mx.float32, mx.float32)]
    router(mx.random.normal((40, 64)))  # a prompt chunk
    monkeypatch.setattr(RowSplit, "mode", "never")
    router(x)
    assert len(calls) == 1


def test_kernel_bench_routed_experts_on_the_cpu():
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_experts("e", 6, 64, 32, 3, use_kernel=False, repeats=1, inner=1, peak_gbs=1.0)
    assert [r["picks"] for r in records] == [3 * R for R in kernel_bench.ROWS]
    assert all(r["identical_to_1_row"] and r["max_abs_diff"] < 0.05 for r in records)
    assert all(1 <= r["unique_experts"] <= 6 for r in records)


def test_gather_serves_a_pick_per_block_unless_asked_to_share(monkeypatch):
    """The routed-experts call: one grid row per pick; a block serves one pick (the lean 1-row
    compile) unless `share` asks it to serve up to that many picks of its expert."""
    calls = []

    def fake(name, inputs, source):
        def kernel(**kw):
            calls.append((source, kw))
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    qw, qs, qb = mx.quantize(mx.random.normal((3, 40, 128), key=mx.random.key(15)), 64, 4)
    for M, share, tier in ((10, None, 1), (80, None, 1), (12, 8, 8), (12, 3, 4), (2, 2, 2)):
        x = mx.zeros((M, 128))
        experts = mx.zeros((M,), dtype=mx.uint32)
        assert kernels.rows_gather_qmatvec(x, qw, qs, qb, experts, group_size=64, bits=4, share=share).shape == (M, 40)
        source, kw = calls[-1]
        assert source is kernels.GATHER_QUANTIZED and kw["grid"][1] == M
        assert dict(kw["template"])["ROWS"] == tier and kw["inputs"][0].tolist() == [M, 128, 40, 1]


def test_the_mxfp4_gather_puts_its_picks_on_the_grid_axis_its_order_names(monkeypatch):
    """order "picks" (the default): grid x counts picks (a block of threads each), y the column
    blocks, so every pick of a column block is launched together; "columns": as the affine
    kernel. The decode form and the grid order travel as template values."""
    calls = []

    def fake(name, inputs, source, extra=""):
        def kernel(**kw):
            calls.append((source, extra, kw))
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    qw, qs = mx.quantize(mx.random.normal((3, 40, 128), key=mx.random.key(16)), 32, 4, mode="mxfp4")
    M, x, experts = 6, mx.zeros((6, 1, 128)), mx.zeros((6,), dtype=mx.uint32)
    blocks = -(-40 // (kernels.WARPS * kernels.COLS))
    threads = kernels.WARPS * 32
    for setting, grid, template in (({}, (M * threads, blocks, 1), {"DECODE": 0, "PICKS_X": 1, "ROWS": 1}),
                                     ({"order": "columns", "decode": "lut", "share": 2}, (blocks * threads, M, 1),
                                      {"DECODE": 1, "PICKS_X": 0, "ROWS": 2})):
        assert kernels.rows_gather_mxfp4matvec(x, qw, qs, experts, **setting).shape == (M, 1, 40)
        source, extra, kw = calls[-1]
        assert source is kernels.GATHER_MXFP4 and extra == kernels.MXFP4_HEADER
        assert kw["grid"] == grid and kw["threadgroup"] == (threads, 1, 1)
        assert template.items() <= dict(kw["template"]).items()
    for bad in ({"decode": "table"}, {"order": "rows"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            kernels.rows_gather_mxfp4matvec(x, qw, qs, experts, **bad)


def test_kernel_bench_mxfp4_settings_on_the_cpu():
    """`kernel_bench --mxfp4`'s records and summary (the reference path here): every setting
    at every R, checked against its 1-row calls and the default's bits."""
    from scripts.bench import kernel_bench

    records = kernel_bench.bench_mxfp4("m", 4, 64, 48, 2, use_kernel=False, repeats=1, inner=1, peak_gbs=1.0)
    settings = kernel_bench.mxfp4_variants()
    assert len(records) == len(settings) * len(kernel_bench.ROWS)
    assert records[0]["variant"] == "f16/cols4/share1/picks" and settings[0]["order"] == "picks"
    assert all(r["identical_to_1_row"] and r["identical_to_default_cols"] and r["max_abs_diff"] < 0.05
               for r in records)
    summary = kernel_bench.mxfp4_summary(records)
    assert len(summary) == len(records) and all(s["kernel_ms"] > 0 and s["mlx_ms"] > 0 for s in summary)
    assert "fastest at R=1" in kernel_bench.render_mxfp4(summary)


def test_gather_refuses_more_picks_than_its_shared_table_holds():
    qw, qs, qb = mx.quantize(mx.random.normal((3, 40, 128), key=mx.random.key(15)), 64, 4)
    M = kernels.MAX_PICKS + 1
    with pytest.raises(ValueError, match=f"at most {kernels.MAX_PICKS} picks"):
        kernels.rows_gather_qmatvec(mx.zeros((M, 128)), qw, qs, qb, mx.zeros((M,), dtype=mx.uint32), group_size=64,
                                    bits=4)


def test_row_kernels_take_leading_axes_without_reshapes(monkeypatch):
    """x (..., K) goes to the kernel as it stands and the result keeps x's leading axes: the
    kernel counts rows over all of them (a reshape would be one more op per projection)."""
    calls = []

    def fake(name, inputs, source):
        def kernel(**kw):
            calls.append(kw)
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return kernel

    monkeypatch.setattr(kernels, "_kernel", fake)
    w = mx.zeros((40, 128))
    qw, qs, qb = mx.quantize(w, 64, 4)
    x = mx.zeros((1, 3, 128))
    assert kernels.rows_matvec(x, w).shape == (1, 3, 40)
    assert kernels.rows_qmatvec(x, qw, qs, qb, group_size=64, bits=4).shape == (1, 3, 40)
    picks = mx.zeros((6, 1, 128))
    eqw, eqs, eqb = mx.quantize(mx.zeros((2, 40, 128)), 64, 4)
    out = kernels.rows_gather_qmatvec(picks, eqw, eqs, eqb, mx.zeros((6,), dtype=mx.uint32), group_size=64, bits=4)
    assert out.shape == (6, 1, 40)
    assert [c["inputs"][0].tolist() for c in calls] == [[3, 128, 40], [3, 128, 40], [6, 128, 40, 1]]
    assert all(c["inputs"][1] is x for c in calls[:2]) and calls[2]["inputs"][1] is picks


def test_tied_heads_take_the_row_kernel_in_one_call(monkeypatch):
    """A tied embedding's logits (`layers.tied_logits`), plain or affine-quantized, go to the
    row-invariant kernel in one call for a window's rows where it runs, as an untied `RowLinear`
    head does, instead of a matmul per row; RowSplit "never" keeps MLX's matmul."""
    import mlx.nn as nn

    from strata_cli.model.layers import RowSplit, tied_logits

    calls = []

    def fake_plain(x, w):
        calls.append(("plain", x.shape))
        return kernels.reference_matvec(x, w)

    def fake_quantized(x, w, s, b, *, group_size, bits):
        calls.append(("quantized", x.shape))
        return kernels.reference_qmatvec(x, w, s, b, group_size=group_size, bits=bits)

    embed = nn.Embedding(40, 128)
    quantized = nn.QuantizedEmbedding.from_embedding(embed, group_size=64, bits=4)
    h = mx.random.normal((1, 5, 128), key=mx.random.key(6))
    plain = [tied_logits(e, h) for e in (embed, quantized)]  # the CPU: MLX's matmul
    monkeypatch.setattr(kernels, "kernels_usable", lambda dtype=None: True)
    monkeypatch.setattr(kernels, "rows_matvec", fake_plain)
    monkeypatch.setattr(kernels, "rows_qmatvec", fake_quantized)
    got = [tied_logits(e, h) for e in (embed, quantized)]
    assert calls == [("plain", (1, 5, 128)), ("quantized", (1, 5, 128))]
    assert all(mx.allclose(g, p, atol=1e-4, rtol=1e-4).item() for g, p in zip(got, plain))
    monkeypatch.setattr(RowSplit, "mode", "never")
    tied_logits(embed, h)
    assert len(calls) == 2


def test_kernel_bench_can_time_the_butterfly_tail_the_kernels_had(monkeypatch):
    from scripts.bench import kernel_bench
    from scripts.lab import kernel_emulate

    for name, value in list(vars(kernels).items()):  # restored after the test
        monkeypatch.setattr(kernels, name, value)
    made = []
    monkeypatch.setattr(kernels, "_kernel", lambda name, inputs, body, extra="": made.append((name, body)))
    assert kernel_bench.use_butterfly_tail() == len(kernel_emulate.KINDS)
    assert kernels.DENSE.endswith(kernel_emulate.BUTTERFLY_TAIL)
    assert kernels.GATHER_QUANTIZED_GLU.endswith(kernel_emulate.BUTTERFLY_GLU_TAIL)
    kernels._kernel("strata_rows_matvec_v4", ["dims", "x", "w"], kernels.DENSE)
    assert made == [("strata_rows_matvec_v4_butterfly", kernels.DENSE)]  # its own name: no cache mixes them
