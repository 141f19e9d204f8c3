"""Expert reads: demand reads ahead of read-ahead (experts/reads.py), queued read-aheads cancelled
or promoted, and router prefetch gated by its predicted probability (experts/cache.py). Outputs
never depend on either: tests/test_stream_exact.py decodes with both, token for token.
"""

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from stream_checkpoints import TOP_K, build_pair

from scripts.bench.moce_agreement import decode, open_engine
from scripts.bench.slow_disk import SimulatedDisk
from strata_cli.experts.reads import ReadQueue
from strata_cli.options import ConfigError, MoceOptions, StreamOptions
from strata_cli.runtime import load_checkpoint

BLOCK = "model.layers.{}.mlp.switch_mlp"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("reads"))


class Disk:
    """One device: reads hold it in turn; the first read can be held back until released."""

    def __init__(self):
        self.device = threading.Lock()
        self.gate = threading.Event()
        self.done: list[str] = []
        self.started: list[str] = []

    def read(self, name: str, *, gated: bool = False):
        def run():
            self.started.append(name)
            if gated:
                self.gate.wait(5)
            with self.device:
                time.sleep(0.005)
            self.done.append(name)
            return name

        return run


def wait_started(disk: Disk, name: str) -> None:
    deadline = time.monotonic() + 5
    while name not in disk.started:
        assert time.monotonic() < deadline, f"{name} never started"
        time.sleep(0.001)


@pytest.mark.parametrize("depth", [1, 2])
def test_demand_read_issued_after_readaheads_completes_first(depth):
    disk, reads = Disk(), ReadQueue(4, readahead_depth=depth)
    ahead = [reads.submit(disk.read("a0", gated=True), demand=False)]
    wait_started(disk, "a0")
    ahead += [reads.submit(disk.read(f"a{n}"), demand=False) for n in (1, 2, 3)]
    demand = reads.submit(disk.read("d"), demand=True)
    assert demand.result(5) == "d"
    disk.gate.set()
    for f in ahead:
        f.result(5)
    # read-aheads that were queued (beyond the depth) start only after the demand read
    assert disk.done[0] == "d" if depth == 1 else disk.done.index("d") <= 1, disk.done
    assert all(disk.started.index(f"a{n}") > disk.started.index("d") for n in range(depth, 4)), disk.started
    reads.shutdown()


def test_without_lanes_reads_run_in_submission_order():
    disk, reads = Disk(), ReadQueue(1)
    first = reads.submit(disk.read("a0", gated=True), demand=False)
    wait_started(disk, "a0")
    rest = [reads.submit(disk.read("a1"), demand=False), reads.submit(disk.read("d"), demand=True)]
    disk.gate.set()
    for f in [first, *rest]:
        f.result(5)
    assert disk.done == ["a0", "a1", "d"]
    reads.shutdown()


def test_no_readahead_starts_while_a_demand_read_runs():
    disk, reads = Disk(), ReadQueue(4, readahead_depth=2)
    demand = reads.submit(disk.read("d", gated=True), demand=True)
    wait_started(disk, "d")
    ahead = reads.submit(disk.read("a"), demand=False)
    time.sleep(0.05)
    assert disk.started == ["d"]  # three idle threads, and still it waits
    disk.gate.set()
    assert (demand.result(5), ahead.result(5)) == ("d", "a")
    reads.shutdown()


def test_queued_readahead_is_cancelled_or_promoted():
    disk, reads = Disk(), ReadQueue(1, readahead_depth=1)
    running = reads.submit(disk.read("d0", gated=True), demand=True)
    wait_started(disk, "d0")
    a, b = (reads.submit(disk.read(name), demand=False) for name in ("a", "b"))
    later = reads.submit(disk.read("d1"), demand=True)
    assert reads.promote(b) and a.cancel()
    assert not reads.promote(running)  # started: nothing to move
    disk.gate.set()
    for f in (running, b, later):
        f.result(5)
    assert disk.done == ["d0", "d1", "b"] and a.cancelled()  # b joined the demand lane's end
    reads.shutdown()


def test_shutdown_cancels_queued_reads():
    disk, reads = Disk(), ReadQueue(1, readahead_depth=1)
    running = reads.submit(disk.read("d", gated=True))
    wait_started(disk, "d")
    queued = reads.submit(disk.read("a"), demand=False)
    disk.gate.set()
    reads.shutdown()
    assert running.result(5) == "d" and queued.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        reads.submit(disk.read("x"))


@pytest.mark.parametrize("min_prob", [0.0, None, 0.999])
def test_router_prefetch_reads_only_confident_picks(checkpoints, min_prob):
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=8))
    x = mx.random.normal((1, model.config.hidden_size), key=mx.random.key(4))
    probs = np.array(mx.softmax(model.layers[1].mlp.gate(x).astype(mx.float32), axis=-1))[0]
    top = np.argsort(-probs, kind="stable")[:TOP_K]
    if min_prob is None:  # between the predicted picks: some pass, some do not
        min_prob = float(np.median(probs[top]))
    model.expert_cache.close()
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=8, readahead_min_prob=min_prob))
    cache = model.expert_cache
    cache.begin_window()
    mx.eval(model.layers[0].mlp.switch_mlp(x, mx.array([[0, 1, 2, 3]], dtype=mx.uint32)))
    read_ahead = set(np.nonzero(cache.inflight_mask(BLOCK.format(1)))[0].tolist())
    assert read_ahead == {int(e) for e in top if probs[e] >= min_prob}
    assert 0 < len(read_ahead) < TOP_K or min_prob in (0.0, 0.999)
    cache.close()


def test_read_options_are_checked():
    with pytest.raises(ConfigError, match="--expert-readahead-depth must be at least 1"):
        StreamOptions(readahead_depth=0)
    with pytest.raises(ConfigError, match="needs prefetch on"):
        StreamOptions(prefetch="off", readahead_depth=1)
    with pytest.raises(ConfigError, match=r"in \[0, 1\)"):
        StreamOptions(readahead_min_prob=1.0)
    with pytest.raises(ConfigError, match="--expert-prefetch router"):
        StreamOptions(prefetch="history", readahead_min_prob=0.2)
    StreamOptions(prefetch="history", readahead_depth=2)


def test_moce_tokens_unchanged_by_read_options(checkpoints):
    """MoCE routes on residency; the read options change when reads happen, not what becomes
    resident once prefill has filled the slots (exact prefill), so its tokens do not move."""
    moce = MoceOptions(protect=1, bonus=0.5, exact_prefill=True)
    prompt = list(range(3, 60, 2))
    disk = SimulatedDisk(1.0)
    plain = open_engine(checkpoints[1], 8, moce, disk)
    ordered = open_engine(checkpoints[1], 8, moce, disk, reads={"readahead_depth": 1, "readahead_min_prob": 0.05})
    want, got = decode(plain, prompt, 16)[0], decode(ordered, prompt, 16)[0]
    assert got == want
    for engine in (plain, ordered):
        engine.model.expert_cache.close()


def test_a_block_cancels_its_queued_readaheads_it_did_not_pick_and_promotes_the_one_it_did(checkpoints):
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=8, readahead_depth=1,
                                                                 io_threads=1))
    cache = model.expert_cache
    SimulatedDisk(100).attach(cache.store)  # slow enough that one read-ahead is at the disk, three queued
    order, slow_read = [], cache.store.read

    def logged_read(path, expert, buf):
        order.append((path, expert))
        return slow_read(path, expert, buf)

    cache.store.read = logged_read
    x = mx.random.normal((1, model.config.hidden_size), key=mx.random.key(4))
    probs = np.array(mx.softmax(model.layers[1].mlp.gate(x).astype(mx.float32), axis=-1))[0]
    guesses = sorted(np.argsort(-probs, kind="stable")[:TOP_K].tolist())  # read ahead lowest id first
    others = [e for e in range(32) if e not in guesses][-(TOP_K - 1):]
    assert guesses[-1] < others[0]  # so that only promotion puts its read before theirs
    cache.begin_window()
    mx.eval(model.layers[0].mlp.switch_mlp(x, mx.array([[0, 1, 2, 3]], dtype=mx.uint32)))
    mx.eval(model.layers[1].mlp.switch_mlp(x, mx.array([[guesses[-1], *others]], dtype=mx.uint32)))
    row = cache.end_window().layers[1]
    stride = cache.store.blocks[BLOCK.format(1)].stride
    assert (row["prefetch_hits"], row["cancelled_prefetches"], row["wasted_prefetches"]) == (1, 2, 1), row
    assert row["prefetched_bytes"] == 2 * stride  # the cancelled two were never read
    assert row["cold_misses"] == TOP_K - 1
    # the read-ahead at the disk finishes, then the promoted one goes before the block's demand reads
    assert [e for path, e in order if path == BLOCK.format(1)] == [guesses[0], guesses[-1], *others]
    cache.close()
