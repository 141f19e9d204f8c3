"""The full-scale streaming bench (scripts/bench/stream_80b.py) end to end at tiny shapes on the CPU:
it builds its checkpoint (experts quantized by mx.quantize), measures the disk, decodes every mode
cold and warm at one cache size, runs the MoCE study, and writes the JSON issue 38 asks for, with
`speculative_identical` computed from the tokens each row decoded."""

import json

from scripts.bench import stream_80b, stream_curve


def test_tiny_run_writes_every_field_and_compares_tokens(tmp_path):
    out = tmp_path / "stream.json"
    common = ["--tiny", "--layers", "2", "--tokens", "6", "--fractions", "0.5", "--dir", str(tmp_path / "ckpt"),
              "--json-out", str(out)]
    first = stream_80b.main([*common, "--disk-seconds", "0.02", "--modes", "serial", "--temperatures", "cold",
                             "--moce", "none"])
    assert len(first["rows"]) == 1 and "moce" not in first and not first["build"]["reused"]
    report = stream_80b.main([*common, "--resume", "--profile", "0.5"])  # measures what the first run left out
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["rows"][0] == json.loads(json.dumps(first["rows"][0])) and report["disk"] == first["disk"]
    assert report["build"] == first["build"] and report["resumed_from"]["tree"] == first["tree"]
    for key in ("tree", "layers", "checkpoint_gb", "disk_read_gb_s", "speculative_identical", "rows", "moce"):
        assert key in report, key
    assert report["layers"] == 2 and report["checkpoint_gb"] > 0 and report["disk_read_gb_s"] > 0
    assert not report["skipped"]
    measured = {(r["io"], r["record_bytes"] in stream_80b.RECORD_SIZES, r["pattern"]) for r in report["disk"]["rows"]}
    assert measured == {(io, small, p) for io in ("direct", "buffered") for small in (True, False)
                        for p in ("sequential", "random")}
    assert stream_curve.is_built(tmp_path / "ckpt", {**stream_80b.PRESETS["tiny"], "num_hidden_layers": 2})
    assert not stream_curve.is_built(tmp_path / "ckpt", stream_80b.PRESETS["tiny"])

    rows = report["rows"]
    assert [(r["temperature"], r["cache_fraction"], r["mode"]) for r in rows] == [  # every cold row first
        (t, f, m) for t in ("cold", "warm") for f in (0.5,) for m in stream_80b.MODES]
    assert all(("page_cache" in r) == (r["temperature"] == "warm") for r in rows)
    # the second run's own cold rows filled the page cache for its warm ones, the first run's did not
    assert [r["page_cache"].startswith("holds") for r in rows[3:]] == [report["page_cache_dropped"] and m != "serial"
                                                                     for m in stream_80b.MODES]
    for r in rows:
        r["union_per_layer_by_T"] = {int(t): u for t, u in r["union_per_layer_by_T"].items()}  # JSON's keys
        assert len(r["output"]) == 6 and r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1
        assert r["bytes_read_per_token"] > 0 and r["disk_bound_tokens_per_s"] > 0 and r["union_per_layer_by_T"]
        assert set(r["time_split_ms_per_token"]) == {"read_wait", "router_sync", "installs", "compute"}
        assert r["staging"]["slots"] > 0 and r["staging"]["advised_chunks"] == 0  # no CUDA advice on the CPU
        serial = next(s for s in rows if s["cache_fraction"] == r["cache_fraction"] and s["mode"] == "serial"
                      and s["temperature"] == "cold")
        assert r["identical_to_serial"] == (None if r is serial else r["output"] == serial["output"])
    assert any(len(r["union_per_layer_by_T"]) > 1 for r in rows if r["mode"] == "draft3")  # drafts were verified
    assert report["speculative_identical"] is True  # exact on the CPU
    tampered = [dict(r) for r in rows]
    tampered[-1]["identical_to_serial"] = False
    assert stream_80b.identical(tampered) is False and stream_80b.identical(rows[:1]) is None

    profile = report["profile"]  # a warm serial decode's host time by function, the first token apart
    assert profile["tokens"] == 5 and len(profile["functions"]) == stream_80b.PROFILE_FUNCTIONS
    served = next(f for f in profile["functions"] if f["function"].startswith("strata_cli/experts/cache.py")
                  and f["function"].endswith("(serve)"))
    assert 0 < served["own_ms_per_token"] <= served["cumulative_ms_per_token"] and served["calls"] >= 5 * 2
    own = [f["own_ms_per_token"] for f in profile["own_functions"]]
    assert len(own) == stream_80b.PROFILE_FUNCTIONS and own == sorted(own, reverse=True)
    assert own[0] >= max(f["own_ms_per_token"] for f in profile["functions"])

    moce = report["moce"]
    assert moce["approximate"] is True and 0 <= moce["top1_agreement"] <= 1 and moce["moce_tokens_per_s"] > 0


def test_the_read_back_splits_into_installs_and_the_rest():
    """A read-back of 2 ms plus 0.5 ms per record installed at the block before it comes out as
    such; one install count only, or too few samples, is no split."""
    from types import SimpleNamespace

    def block(installed, sync_ms):
        return {"cold_misses": installed // 2, "capacity_misses": 0, "prefetch_hits": installed - installed // 2,
                "router_sync_seconds": sync_ms / 1000}

    def window(*installs):  # the first block's read-back has nothing installed before it: not a sample
        blocks = [block(n, 0.0) for n in installs] + [block(0, 0.0)]
        for before, at in zip(blocks, blocks[1:]):
            at["router_sync_seconds"] = (2 + 0.5 * (before["cold_misses"] + before["prefetch_hits"])) / 1000
        return SimpleNamespace(T=1, experts=SimpleNamespace(layers=tuple(blocks)))

    split = stream_curve.router_sync_split([window(0, 4, 9), window(2, 6), SimpleNamespace(T=1, experts=None)])
    assert split["samples"] == 5 and abs(split["ms_per_installed_record"] - 0.5) < 1e-9
    assert abs(split["ms_without_installs"] - 2.0) < 1e-9
    assert stream_curve.router_sync_split([window(3, 3, 3)]) is None  # one count: no line
    assert stream_curve.router_sync_split([window(1, 5)]) is None  # two samples


def test_rows_are_kept_per_read_ahead_setting():
    old = {"cache_fraction": 0.1, "mode": "serial", "temperature": "cold"}  # a JSON from before the setting
    deep = {**old, "readahead_depth": 8, "readahead_min_prob": 0.0}
    rows = [old, deep]
    assert stream_80b.find(rows, 0.1, "serial", "cold") is old
    assert stream_80b.find(rows, 0.1, "serial", "cold", {"readahead_depth": None, "readahead_min_prob": 0.0}) is old
    assert stream_80b.find(rows, 0.1, "serial", "cold", {"readahead_depth": 8, "readahead_min_prob": 0.0}) is deep
    assert stream_80b.find(rows, 0.1, "serial", "cold", {"readahead_depth": 8, "readahead_min_prob": 0.3}) is None
    # the label the log and the table give a setting, nothing on the default reads
    assert stream_80b.readahead_label(old) == "" and stream_80b.readahead_label(deep) == " D8 C0"
    assert stream_80b.readahead_label({"readahead_depth": None, "readahead_min_prob": 0.3}) == " D- C0.3"


def test_rounds_turn_the_order_of_the_modes_and_keep_each_median(monkeypatch):
    """--rounds 3: each round starts one mode later, every run updates its row, and a row is its
    median run with every round's tokens/s; rounds that decode other tokens spoil the identity."""
    from types import SimpleNamespace

    order, speeds = [], {"serial": [1.0, 3.0, 2.0], "auto": [5.0, 4.0, 6.0], "draft3": [9.0, 7.0, 8.0]}

    def measure(engine, prompt, *, tokens, spec, disk_gbps):
        mode = {spec_: name for name, spec_ in modes.items()}[spec]
        order.append(mode)
        speed = speeds[mode][sum(m == mode for m in order) - 1]
        return {"tokens_per_s": speed, "output": [1, 2], "hit_rate": 0.5, "late_waits": 0, "bytes_read_per_token": 1e6,
                "time_split_ms_per_token": dict.fromkeys(("read_wait", "router_sync", "installs", "compute"), 1.0)}

    modes = {"serial": "s", "draft3": "d", "auto": "a"}
    plan = ["serial", "draft3", "auto", "draft3", "auto", "serial", "auto", "serial", "draft3"]
    monkeypatch.setattr(stream_80b, "fresh_engine", lambda *a, **k: object())
    monkeypatch.setattr(stream_80b, "measure_row", measure)
    monkeypatch.setattr(stream_80b, "release", lambda model: None)
    args = SimpleNamespace(cold_io="buffered", readahead_depth=None, readahead_min_prob=0.0, temperatures=["cold"],
                           fractions=[0.5], modes=list(modes), rounds=3, io_threads=1, tokens=2)
    report = {"rows": [], "skipped": []}
    saves = []
    stream_80b.sweep(None, None, [0], args, modes, E=4, dtype=None, disk_gbps=1.0, dropped=False, warm_rows=set(),
                     deadline=float("inf"), report=report, save=lambda: saves.append(len(report["rows"])),
                     log=lambda message: None)
    assert order == plan and len(saves) == 9 and len(report["rows"]) == 3
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["serial"]["rounds_tokens_per_s"] == [1.0, 3.0, 2.0] and rows["serial"]["tokens_per_s"] == 2.0
    assert rows["auto"]["tokens_per_s"] == 5.0 and rows["draft3"]["tokens_per_s"] == 8.0
    assert all(r["same_tokens_every_round"] for r in rows.values())
    assert rows["auto"]["identical_to_serial"] is True and rows["serial"]["identical_to_serial"] is None
    assert stream_80b.identical(report["rows"]) is True
    rows["serial"]["same_tokens_every_round"] = False
    assert stream_80b.identical(report["rows"]) is False
    assert stream_80b.spread(rows["serial"]) == " (1.00-3.00)" and stream_80b.spread({}) == ""
