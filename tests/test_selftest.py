"""`strata selftest`: identity of drafts against serial decoding on this backend, and its exit status."""

import json

from click.testing import CliRunner

from strata_cli.bench import selftest as selftest_module
from strata_cli.cli import cli


def test_selftest_reports_identity_and_window_costs():
    result = CliRunner().invoke(cli, ["selftest", "-n", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["backend"].startswith("Device(cpu")
    assert report["gdn_kernels"] == {"usable": False, "probed": True, "error": None}  # the CPU runs the GDN window as MLX ops
    assert report["attention_kernel"] == {"usable": False, "probed": True, "error": None}
    router = report["router_kernel"]  # probed or not: the CPU's host path may route without asking
    assert router["usable"] is False and router["error"] is None
    add_norm = report["add_norm_kernel"]  # probed or not: the CPU's host tail may add and norm without asking
    assert add_norm["usable"] is False and add_norm["error"] is None
    combine = report["combine_kernel"]  # likewise: the host path combines without asking
    assert combine["usable"] is False and combine["error"] is None
    gated = report["gated_norm_kernel"]  # likewise: the host path norms the GDN tail without asking
    assert gated["usable"] is False and gated["error"] is None
    prep = report["attention_prep_kernel"]  # likewise: CPU windows run the attention head as MLX ops
    assert prep["usable"] is False and prep["error"] is None
    glu = report["glu_kernels"]  # likewise: CPU windows join gate and up with MLX's ops
    assert glu["usable"] is False and glu["error"] is None
    mapped = report["mapped_kernels"]  # likewise: CPU windows gather GDN's projected columns with MLX's ops
    assert mapped["usable"] is False and mapped["error"] is None
    embed = report["embed_kernel"]  # likewise: the CPU keeps the demo's embedding dense, so nothing asks
    assert embed["usable"] is False and embed["error"] is None
    assert report["mamba2_kernels"] == {"usable": False, "probed": True, "error": None}  # asked by the hybrid's layers
    for key in ("pool_copies", "argmax_kernels"):  # CUDA's alone: the CPU never asks
        assert report[key]["usable"] is False and report[key]["error"] is None
    assert {(r["model"], r["mode"], r["dtype"]) for r in report["results"]} == {
        (model, mode, "float32") for model in ("demo", "mamba2-hybrid") for mode in ("3", "auto")}
    demo = [r for r in report["results"] if r["model"] == "demo"]
    hybrid = [r for r in report["results"] if r["model"] == "mamba2-hybrid"]
    assert len(demo) == 2 * len(selftest_module.PROMPTS) and len(hybrid) == 2 * 3
    assert len(report["results"]) == len(demo) + len(hybrid)
    assert all(r["identical"] and r["first_difference"] is None for r in hybrid)
    assert all(r["tokens"] == 6 for r in report["results"])  # end-of-text never cuts a comparison short
    assert sorted(report["window_ms"]["float32"], key=int) == [str(T) for T in range(1, 9)]
    assert all(ms > 0 for ms in report["window_ms"]["float32"].values())


def test_selftest_exits_1_on_a_difference(monkeypatch):
    real = selftest_module._tokens

    def broken(engine, ids, max_tokens, spec):
        tokens = real(engine, ids, max_tokens, spec)
        return tokens[:-1] + [(tokens[-1] + 1) % engine.vocab_size] if spec.max_drafts else tokens

    monkeypatch.setattr(selftest_module, "_tokens", broken)
    result = CliRunner().invoke(cli, ["selftest", "-n", "4"])
    assert result.exit_code == 1 and "differ from serial decoding" in result.output
    runs = 2 * (len(selftest_module.PROMPTS) + 3)  # both models' runs, each one broken
    assert f"{runs} of {runs} runs differ" in result.output
    rows = [line for line in result.output.splitlines() if "DIFFERS at token 3" in line]
    assert any("demo" in row for row in rows) and any("mamba2-hybrid" in row for row in rows)


def test_the_mamba2_hybrid_is_built_deterministically_and_its_drafts_are_kept_and_rejected():
    """The probe model: every Nemotron-H block kind, the same parameters on every build, logits
    far from flat, and prompts on which the suffix drafter's drafts are kept in full, kept in
    part and rejected (else identity would check no rollback)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from strata_cli.bench import hybrid_probe
    from strata_cli.decode import DecodeStats, generate
    from strata_cli.options import GenerateOptions, SpecOptions

    engine = hybrid_probe.build_engine()
    assert "".join(layer.block_type for layer in engine.model.layers) == "ME*M-E"
    assert [type(s).__name__ for s in engine.states] == ["Mamba2State", "KVState", "Mamba2State"]
    again = dict(tree_flatten(hybrid_probe.build_model().parameters()))
    assert all(mx.array_equal(p, again[name]) for name, p in tree_flatten(engine.model.parameters()))
    logits = engine.run([1, 2, 3], 0).logits
    engine.commit(3)
    assert float(logits.std()) > 1.0
    prompts = hybrid_probe.prompts(lambda ids, n: selftest_module._tokens(engine, ids, n, SpecOptions()))
    assert len(prompts) == 3 and all(len(ids) == 64 for ids in prompts)
    keeps = set()
    for ids in prompts:
        for _, spec in selftest_module.MODES:
            stats = DecodeStats()
            for _ in generate(engine, ids, options=GenerateOptions(max_tokens=64), spec=spec, eos_ids=(), stats=stats):
                pass
            keeps |= {(w.T, w.keep) for w in stats.windows if w.proposed}
    assert any(keep == T > 1 for T, keep in keeps)  # kept in full
    assert any(1 < keep < T for T, keep in keeps)  # kept in part
    assert any(keep == 1 < T for T, keep in keeps)  # rejected
