"""A streamed checkpoint (`strata convert --stream`) across two ranks: each rank opens and
streams its own layers' experts only, through its own cache, and the output equals one
process's — and the resident checkpoint's, bit for bit — serial and with drafts."""

import pytest
from click.testing import CliRunner
from test_pipeline_ranks import generate_record

from strata_cli.cli import cli
from strata_cli.experts.store import ExpertStore, layer_of, read_index


@pytest.fixture(scope="module")
def streamed_demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline-streamed") / "demo"
    result = CliRunner().invoke(cli, ["convert", "demo", str(path), "--stream"])
    assert result.exit_code == 0, result.output
    return str(path)


def test_a_store_opens_only_the_blocks_a_stage_holds(streamed_demo):
    _, blocks = read_index(streamed_demo)
    assert {layer_of(b.path) for b in blocks} == set(range(6))
    with ExpertStore(streamed_demo, holds=lambda path: layer_of(path) >= 3) as store:
        assert {layer_of(p) for p in store.blocks} == {3, 4, 5}


def test_each_stage_streams_its_own_layers_experts(streamed_demo):
    from pathlib import Path

    from strata_cli.distributed import Stage
    from strata_cli.runtime import load_checkpoint

    for rank in (0, 1):
        stage = Stage(rank, 2, split=(2, 4), path=Path(streamed_demo))
        model = load_checkpoint(streamed_demo, stage=stage)
        cache = model.expert_cache
        assert {layer_of(p) for p in cache.store.blocks} == set(stage.layers)
        assert {layer_of(p) for p in cache.paths} == set(stage.layers)
        cache.close()


def test_streamed_experts_on_two_ranks_equal_one_resident_process(streamed_demo):
    resident = generate_record([], 1)["token_ids"]
    # Four resident experts of 48 per block: both ranks read experts from disk all along.
    streamed = ["--model", streamed_demo, "--resident-experts", "4"]
    serial = generate_record([*streamed, "--suffix-draft", "0"], 2)
    drafts = generate_record([*streamed, "--suffix-draft", "3"], 2)
    assert serial["token_ids"] == resident and drafts["token_ids"] == resident
    assert drafts["stats"]["drafts_kept"] > 0
    # The split counts the streamed experts' bytes; rank 0 reports its own layers' reads.
    held = drafts["stats"]["pipeline"]["layers"][0]
    assert {layer["layer"] for layer in drafts["stats"]["experts"]["per_layer"]} == set(range(*held))
    assert drafts["stats"]["experts"]["misses"] > 0
