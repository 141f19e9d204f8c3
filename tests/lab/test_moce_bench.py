"""The MoCE agreement script's parts (scripts/bench/moce_agreement.py) and its simulated disk
(scripts/bench/slow_disk.py): settings parse or are refused, presets keep their knobs unless a flag says
otherwise, the simulated disk queues reads and never changes what is read, and exact knobs
measure as perfect agreement.

The checkpoint is the small synthetic streamed Qwen3-Next of tests/stream_checkpoints.py, float32
on the CPU.
"""

import threading
import time

import pytest
from stream_checkpoints import NUM_EXPERTS, build_pair

from scripts.bench import moce_agreement as bench
from scripts.bench.slow_disk import SimulatedDisk
from strata_cli.options import ConfigError, MoceOptions

PROMPT = ([5, 17, 33, 2, 71, 9] + [40, 41, 42]) * 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("moce-bench"))


def test_settings_parse_and_bad_ones_are_refused():
    assert bench.parse_setting("1:3") == MoceOptions(protect=1, bonus=3.0)
    assert bench.parse_setting("1:0.5:2") == MoceOptions(protect=1, bonus=0.5, budget=2)
    assert bench.parse_setting("1:0.25:e") == MoceOptions(protect=1, bonus=0.25, exact_prefill=True)
    assert bench.label("1:0.25:e") == "J1 B0.25 EP" and bench.label("1:3:0") == "J1 B3 N0"
    assert bench.parse_setting("1:0.25:e:n") == bench.parse_setting("1:0.25:n:e") == MoceOptions(
        protect=1, bonus=0.25, exact_prefill=True, natural_prefetch=True)
    assert bench.label("1:1:n:e") == "J1 B1 EP NP" and bench.label("1:1:n") == "J1 B1 NP"
    assert bench.parse_setting("1:0.5:e:i") == MoceOptions(protect=1, bonus=0.5, exact_prefill=True,
                                                           count_inflight=True)
    assert bench.label("1:0.5:i:e") == "J1 B0.5 EP IF"
    for text in ("1", "1:x", "1:2:3:4", "1:-1", "0:1:2", "e", "1:2:0:e", "1:2:e:e", "n", "1:2:i:i"):
        with pytest.raises(ConfigError):
            bench.parse_setting(text)


def test_read_options_in_settings():
    assert bench.read_options("1:0.25:e:d1:c0.3") == {"readahead_depth": 1, "readahead_min_prob": 0.3}
    assert bench.parse_setting("1:0.25:c0.3:e:d2") == MoceOptions(protect=1, bonus=0.25, exact_prefill=True)
    assert bench.label("1:0.25:e:d1:c0.3") == "J1 B0.25 EP D1 C0.3" and bench.label("x:d1") == "exact D1"
    assert bench.parse_setting("x:d1") is None and bench.read_options("1:1") == {}
    for text in ("1:1:d1:d2", "x:e", "1:1:c0.1.2"):
        with pytest.raises(ConfigError):
            bench.read_options(text)
            bench.parse_setting(text)
    with pytest.raises(ConfigError, match="must be in"):
        bench.plan_from_args(["--moce", "x:c1.5"])


def test_presets_hold_unless_a_flag_overrides():
    plan, _ = bench.plan_from_args(["--preset", "h200"])
    assert plan == bench.PRESETS["h200"] and plan.budget_seconds <= 180
    plan, _ = bench.plan_from_args(["--preset", "h200", "--tokens", "7", "--moce", "2:1", "--read-ms", "0"])
    assert (plan.tokens, plan.settings, plan.read_ms) == (7, ("2:1",), (0.0,))
    assert plan.budget_seconds == bench.PRESETS["h200"].budget_seconds
    with pytest.raises(ConfigError):
        bench.plan_from_args(["--moce", "one"])
    with pytest.raises(SystemExit):
        bench.plan_from_args(["--repeats", "0"])


class FakeStore:
    def read(self, path, expert, buf):
        return (path, expert, buf)


def test_the_simulated_disk_queues_reads_and_returns_the_real_ones():
    store, disk = FakeStore(), SimulatedDisk(15.0)
    disk.attach(store)
    results = []
    threads = [threading.Thread(target=lambda e=e: results.append(store.read("p", e, None))) for e in range(4)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start >= 4 * 0.015  # one device: four reads queue, not overlap
    assert sorted(results) == [("p", e, None) for e in range(4)] and disk.reads == 4
    with pytest.raises(ValueError):
        SimulatedDisk(-1.0)


def test_simulated_reads_leave_exact_decoding_unchanged(pair):
    streamed = pair[1]
    ids = {}
    for ms in (0.0, 2.0):
        disk = SimulatedDisk(ms)
        engine = bench.open_engine(streamed, 8, None, disk)
        ids[ms], _, summary = bench.decode(engine, PROMPT, 8, drafts=3)
        engine.model.expert_cache.close()
    assert ids[0.0] == ids[2.0]
    experts = summary["experts"]
    stride = experts["bytes_read"] // experts["misses"]
    assert disk.reads >= (experts["bytes_read"] + experts["prefetched_bytes"]) // stride > 0  # prefill reads too


def test_exact_knobs_measure_as_perfect_agreement(pair):
    full, streamed = pair
    plan = bench.Plan(tokens=4, repeats=1, fractions=(0.25,), settings=("4:3", "1:3"), prefetch_fractions=(0.25,))
    rows = bench.measure(streamed, [PROMPT], plan, num_experts=NUM_EXPERTS, read_ms=0.0,
                         deadline=float("inf"), log=lambda m: None, source=full)
    exact, moce = rows
    assert exact["setting"] == "J4 B3" and exact["top1_agreement"] == exact["greedy_agreement"] == 1.0
    assert exact["mean_kl"] < 1e-9 and exact["moce_misses_per_token"] == exact["exact_misses_per_token"]
    for key in ("prefetch_reads_per_token", "wasted_prefetches_per_token", "disk_reads_per_token"):
        assert exact[f"moce_{key}"] == exact[f"exact_{key}"], key  # exact knobs read ahead as exact does
    assert exact["exact_disk_reads_per_token"] >= exact["exact_misses_per_token"]
    assert moce["moce_misses_per_token"] < moce["exact_misses_per_token"]  # a bonus saves reads
    assert 0.0 <= moce["top1_agreement"] <= 1.0 and moce["mean_kl"] >= 0.0
    prefetch = bench.measure_prefetch(streamed, [PROMPT], plan, num_experts=NUM_EXPERTS, read_ms=0.0,
                                      deadline=float("inf"), log=lambda m: None)
    assert [(r["routing"], r["root_prefetch"]) for r in prefetch] == [
        ("exact", False), ("exact", True), ("J4 B3", False), ("J4 B3", True)]
