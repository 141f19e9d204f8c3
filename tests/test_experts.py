"""The expert cache: record layout, slots and LRU eviction, passes, prefetch accounting, budgets."""

import mlx.core as mx
import numpy as np
import pytest
from stream_checkpoints import NUM_EXPERTS, TOP_K, build_pair

from strata_cli.engine.window import WindowEngine
from strata_cli.experts.cache import ExpertCache, write_slots
from strata_cli.experts.store import ExpertLayoutWriter, ExpertStore, read_index
from strata_cli.model import load_model
from strata_cli.options import ConfigError, StreamOptions
from strata_cli.runtime import load_checkpoint

BLOCK = "model.layers.{}.mlp.switch_mlp"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("experts"))


def serve(model, layer: int, inds: list[list[int]], seed: int = 0):
    """Run one MoE block's experts on random rows with the given picks, as its own window."""
    cache = model.expert_cache
    cache.begin_window()
    x = mx.random.normal((len(inds), model.config.hidden_size), key=mx.random.key(seed))
    out = model.layers[layer].mlp.switch_mlp(x, mx.array(inds, dtype=mx.uint32))
    mx.eval(out)
    return out, x, cache.end_window()


def test_layout_round_trip_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    E = 5
    tensors = {
        "gate_proj.weight": mx.array(rng.integers(0, 2**32, (E, 8, 4), dtype=np.uint32)),
        "gate_proj.scales": mx.array(rng.normal(size=(E, 8, 1)).astype(np.float16)),
        "up_proj": mx.array(rng.normal(size=(E, 7, 3)).astype(np.float32)).astype(mx.bfloat16),
        "down_proj": mx.array(rng.normal(size=(E, 3, 7)).astype(np.float32)),
    }
    writer = ExpertLayoutWriter(tmp_path, num_experts=E)
    writer.add_block("model.layers.2.mlp.switch_mlp", tensors, quantization={"gate_proj": {"group_size": 32, "bits": 4, "mode": "affine"}})
    writer.finish()
    index, [block] = read_index(tmp_path)
    assert block.layer == 2 and block.stride % 4096 == 0 and block.record_bytes <= block.stride
    assert [o for o, _, _ in block.records] == [e * block.stride for e in range(E)]
    assert all(t.offset % 64 == 0 for t in block.tensors)
    assert (tmp_path / "experts" / "layer_002.bin").stat().st_size == E * block.stride
    for io in ("auto", "buffered"):
        with ExpertStore(tmp_path, io=io) as store:
            pool = store.pools[block.stride]
            for e in range(E):
                buf = pool.take()
                arrays = store.to_arrays(block.path, store.read(block.path, e, buf), {})
                pool.give(buf)
                for name, value in tensors.items():
                    assert arrays[name].dtype == value.dtype
                    assert mx.array_equal(arrays[name].view(mx.uint8), value[e].view(mx.uint8)).item(), (io, e, name)


def test_lru_eviction_hits_and_miss_kinds(checkpoints):
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=3, prefetch="off"))
    cache, path = model.expert_cache, BLOCK.format(0)
    steps = [  # picks, then (hits, cold, capacity), then resident experts, least recently used first
        ([[0, 1]], (0, 2, 0), [0, 1]),
        ([[2]], (0, 1, 0), [0, 1, 2]),
        ([[0, 3]], (1, 1, 0), [2, 0, 3]),  # 1 was the least recently used
        ([[1]], (0, 0, 1), [0, 3, 1]),  # 1 comes back: a capacity miss; 2 goes
        ([[3], [1]], (2, 0, 0), [0, 1, 3]),  # a window touches its union in id order
    ]
    for picks, (hits, cold, capacity), resident in steps:
        _, _, stats = serve(model, 0, picks)
        assert (stats.hits, stats.cold_misses, stats.capacity_misses) == (hits, cold, capacity), picks
        assert stats.misses == cold + capacity
        assert stats.bytes_read == (cold + capacity) * cache.store.blocks[path].stride
        assert cache.resident(path) == resident
        assert stats.union_experts[0] == len({e for row in picks for e in row})
    cache.close()


def test_union_larger_than_slots_is_served_in_passes(checkpoints):
    full = load_model(checkpoints[0])
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=3, prefetch="off"))
    picks = [[0, 5, 9, 13], [5, 17, 22, 30]]  # 7 distinct experts, 3 slots: 3 passes
    out, x, stats = serve(model, 1, picks)
    want = full.layers[1].mlp.switch_mlp(x, mx.array(picks, dtype=mx.uint32))
    assert stats.passes == 3 and stats.union_experts[1] == 7
    assert mx.array_equal(out, want).item()
    assert len(model.expert_cache.resident(BLOCK.format(1))) == 3
    model.expert_cache.close()


def _address(a: mx.array) -> int:
    view = np.array(a, copy=False)
    return view.__array_interface__["data"][0]


@pytest.mark.parametrize("slots", [[4], [2, 3, 4], [6, 1, 3], [5, 0]])
def test_write_slots_writes_each_slot_and_keeps_the_buffer(slots):
    rng = np.random.default_rng(len(slots))
    start = rng.normal(size=(8, 3, 5)).astype(np.float32)
    values = [rng.normal(size=(3, 5)).astype(np.float32) for _ in slots]
    want = start.copy()
    want[slots] = np.stack(values)
    bank = mx.array(start) + 0  # an evaluated array that owns its buffer
    mx.eval(bank)
    kept = bank
    out = write_slots(bank, [mx.array(v)[None] for v in values], slots)
    mx.eval(out)
    assert np.array_equal(np.array(out), want)
    assert np.array_equal(np.array(kept), start)  # the caller's array is not rewritten
    # with no other reference, the writes land in the bank's own buffer (MLX donates it)
    address = _address(out)
    again = write_slots(out, [mx.array(v)[None] * 2 for v in values], slots)
    del out
    mx.eval(again)
    assert _address(again) == address
    want[slots] = np.stack(values) * 2
    assert np.array_equal(np.array(again), want)


def test_a_reused_staging_slot_installs_its_new_record_through_the_views_it_keeps(checkpoints):
    """Every expert of a block read one after another through one slot: the staging area hands
    its slots out again after 16 reads, and the tensor views a slot keeps (made once, so an
    install builds only its writes) must show the bytes the reader wrote last, never the first
    record's."""
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=1, prefetch="off"))
    cache, path = model.expert_cache, BLOCK.format(0)
    with ExpertStore(checkpoints[1]) as store:
        block = store.blocks[path]
        pool = store.pools[block.stride]
        for e in range(NUM_EXPERTS):
            serve(model, 0, [[e]])
            buf = pool.take()
            want = store.to_arrays(path, store.read(path, e, buf), {})
            pool.give(buf)
            for name, bank in cache._blocks[0].banks.items():
                assert mx.array_equal(bank[0].view(mx.uint8), want[name].view(mx.uint8)).item(), (e, name)
    area = next(iter(cache._staging.values()))
    assert area.size < NUM_EXPERTS  # slots were reused
    kept = [slot.tensors for slot in area._slots]
    assert all(len(views) == 1 for views in kept)  # one layout: one set of views a slot


def test_passes_with_scattered_slots_serve_the_resident_outputs(checkpoints):
    full = load_model(checkpoints[0])
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=4, prefetch="off"))
    cache = model.expert_cache
    path = BLOCK.format(1)
    # slots 0-3 filled in a run; then 1 and 3 are the least recently used: two records into
    # slots with a gap; then three new experts evict three scattered slots
    for seed, picks in enumerate([[[0, 1], [2, 3]], [[0, 2]], [[7, 8]], [[0, 9], [10, 11]]]):
        out, x, _ = serve(model, 1, picks, seed=seed)
        want = full.layers[1].mlp.switch_mlp(x, mx.array(picks, dtype=mx.uint32))
        assert mx.array_equal(out, want).item(), picks
    assert sorted(cache.resident(path)) == [0, 9, 10, 11]
    cache.close()


@pytest.mark.parametrize("prefetch, root_only, depth", [("router", False, None), ("history", False, None),
                                                        ("router", True, None), ("off", False, None),
                                                        ("router", False, 1)])
def test_prefetch_accounting(checkpoints, prefetch, root_only, depth):
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=8, prefetch=prefetch,
                                                                 root_prefetch=root_only, readahead_depth=depth))
    cache, engine = model.expert_cache, WindowEngine(model)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.vocab_size, 60).tolist()
    engine.prefill(tokens[:8])
    assert cache.last_window.prefetched_bytes == 0  # prompt chunks read on demand only
    stride = cache.store.blocks[BLOCK.format(1)].stride
    pos, prefetched = 8, 0
    for T in [1, 4, 2, 4, 1, 3, 4, 4, 2, 1, 4, 4]:
        engine.run(tokens[pos : pos + T], pos)
        engine.commit(1)
        pos += 1
        stats = engine.last_window_experts()
        for row, union in zip(stats.layers, stats.union_experts):
            assert row["hits"] + row["cold_misses"] + row["capacity_misses"] + row["prefetch_hits"] == union
        # every prefetch of a window is used by its next block, counted as wasted there, or
        # cancelled before it was read (and then not counted as prefetched)
        assert stats.prefetched_bytes == (stats.prefetch_hits + stats.wasted_prefetches) * stride
        assert stats.layers[0]["prefetched_bytes"] == 0  # nothing predicts the first block
        if root_only:
            assert all(row["prefetched_bytes"] <= TOP_K * stride for row in stats.layers)
        prefetched += stats.prefetched_bytes
    assert (prefetched > 0) == (prefetch != "off")
    cache.close()


def test_blocks_out_of_layer_order_are_refused(checkpoints):
    """Router prefetch reads for the block after each one in the cache's order: blocks listed
    otherwise (named_modules gives the last layer first) would read ahead for the wrong layer."""
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=4))
    cache = model.expert_cache
    modules = dict(model.named_modules())
    blocks = [(path, modules[path.rsplit(".", 1)[0]]) for path in reversed(cache.paths)]
    with pytest.raises(ValueError, match="layer order"):
        ExpertCache(cache.store, blocks, num_slots=4, dtype=mx.float32, options=cache.options)
    cache.close()


def test_budget_options(checkpoints):
    # float32 experts: 3 matrices of 16 x 32 floats = 6144 bytes, in each of 4 MoE blocks
    per_slot = 3 * 16 * 32 * 4 * 4
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(cache_gb=5.5 * per_slot / 1e9))
    assert model.expert_cache.num_slots == 5
    model.expert_cache.close()
    model = load_checkpoint(checkpoints[1], stream=StreamOptions(resident_experts=1000))
    assert model.expert_cache.num_slots == NUM_EXPERTS
    model.expert_cache.close()
    with pytest.raises(ConfigError, match="holds no expert") as refused:
        load_checkpoint(checkpoints[1], stream=StreamOptions(cache_gb=1e-9))
    # the slot's size in a unit that shows it, and a budget that works
    assert "takes 24.6 kB; pass at least --expert-cache 0.001 or --resident-experts 1" in str(refused.value)
    with pytest.raises(ConfigError, match="not both"):
        StreamOptions(cache_gb=1.0, resident_experts=4)
    with pytest.raises(ConfigError, match="root-only prefetch"):
        StreamOptions(prefetch="off", root_prefetch=True)
    with pytest.raises(ConfigError, match="streamed checkpoint"):
        load_checkpoint(checkpoints[0], stream=StreamOptions(resident_experts=4))
    load_checkpoint(checkpoints[0], stream=StreamOptions())  # defaults are no request


def test_version_1_index_without_record_kinds_still_reads(tmp_path):
    """Indexes written before record kinds (version 1, no `kind`) load as SwiGLU records; a
    version 1 index naming another kind, or a version 2 block without one, is refused."""
    import json

    from strata_cli.experts.store import ExpertStoreError

    E, rng = 3, np.random.default_rng(1)
    tensors = {name: mx.array(rng.normal(size=(E, 4, 4)).astype(np.float32)) for name in ("gate_proj", "up_proj", "down_proj")}
    writer = ExpertLayoutWriter(tmp_path, num_experts=E)
    writer.add_block("model.layers.1.mlp.switch_mlp", tensors)
    path = writer.finish()
    index = json.loads(path.read_text())
    assert index["version"] == 2 and index["blocks"][0]["kind"] == "glu"
    del index["blocks"][0]["kind"]
    with pytest.raises(ExpertStoreError, match="malformed"):
        path.write_text(json.dumps(index))
        read_index(tmp_path)
    path.write_text(json.dumps({**index, "version": 1}))
    _, [block] = read_index(tmp_path)
    assert block.kind == "glu" and block.projections == ("gate_proj", "up_proj", "down_proj")
    index["blocks"][0]["kind"] = "relu2"
    path.write_text(json.dumps({**index, "version": 1}))
    with pytest.raises(ExpertStoreError, match="not a record kind of version 1"):
        read_index(tmp_path)


def test_glu_records_may_carry_bias_rows_under_module_names(tmp_path):
    """A "glu" record holds its plain projections bare (SwitchGLU) or as `<proj>.weight` (biased
    experts' modules), with `<proj>.bias` rows or without; both spellings of one projection, or a
    bias of a projection the kind lacks, are refused."""
    from strata_cli.experts.store import ExpertStoreError

    E, rng = 3, np.random.default_rng(2)

    def layout(names):
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        writer = ExpertLayoutWriter(directory, num_experts=E)
        writer.add_block("model.layers.1.mlp.experts",
                         {n: mx.array(rng.normal(size=(E, 4) if n.endswith(".bias") else (E, 4, 4)).astype(np.float32))
                          for n in names})
        writer.finish()
        return read_index(directory)[1][0]

    projections = ("gate_proj", "up_proj", "down_proj")
    biased = layout([f"{p}.{part}" for p in projections for part in ("weight", "bias")])
    assert [biased.plain_name(p) for p in projections] == [f"{p}.weight" for p in projections]
    assert layout(list(projections)).plain_name("gate_proj") == "gate_proj"
    with pytest.raises(ExpertStoreError, match="up_proj.weight is not one"):
        layout([*projections, "up_proj.weight"])
    with pytest.raises(ExpertStoreError, match="fc1.bias is not one"):
        layout([*projections, "fc1.bias"])
