"""Pipeline stages in one process (distributed.py): the balanced split, what each rank loads, and
stages composed by hand (embed -> stage 0 -> stage 1 -> head) against the whole model, bit for
bit, on the demo model and on a tiny Nemotron-H, whose attention-free MLP/MoE blocks hold no
state (`state_span`). The ranks themselves run in tests/test_pipeline_ranks.py."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from hf_checkpoints import checkpoint_root, hybrid_hf_checkpoint
from mlx.utils import tree_flatten

from strata_cli.distributed import Stage, balanced_split, checkpoint_layer_bytes
from strata_cli.engine.state import Mode
from strata_cli.engine.window import make_state
from strata_cli.options import ConfigError, EngineOptions, PipelineOptions, parse_pipeline_split
from strata_cli.runtime import embedded_model_path, load_checkpoint


def test_balanced_split_minimises_the_largest_share():
    assert balanced_split([1, 1, 1, 1, 1, 1], 2) == [3, 3]
    assert balanced_split([1, 1, 1, 1, 1, 1], 2, first_extra=2) == [2, 4]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_split([1, 2, 3, 4], 4) == [1, 1, 1, 1]
    counts = balanced_split([3, 1, 4, 1, 5, 9, 2, 6], 3, first_extra=4)
    assert sum(counts) == 8 and min(counts) >= 1


def test_a_split_is_checked_once():
    assert parse_pipeline_split("20,28") == (20, 28)
    for bad in ("", "3,0", "a,b", "3,-1"):
        with pytest.raises(ConfigError):
            parse_pipeline_split(bad)
    with pytest.raises(ConfigError):
        PipelineOptions(timeout=0)
    stage = Stage(0, 2, split=(2, 2))
    with pytest.raises(ConfigError, match="gives 4 layers, the model has 6"):
        stage.plan(6)
    with pytest.raises(ConfigError, match="gives 1 ranks"):
        Stage(0, 2, split=(6,)).plan(6)


def test_demo_split_counts_rank_0s_embeddings():
    layers, rest = checkpoint_layer_bytes(embedded_model_path(), 6)
    assert all(b > 0 for b in layers) and rest > 0
    assert Stage(0, 2, path=embedded_model_path()).plan(6) == [range(0, 3), range(3, 6)]


def run_stages(models, stages, whole, ids):
    """Logits of `ids` through the stages composed by hand, and through the whole model, with
    a prompt chunk then a 3-row window, each on fresh per-rank states."""
    options = EngineOptions()
    states = [[make_state(k, p, options) for k, p in stage.kinds] for stage in stages]
    whole_states = [make_state(k, p, options) for k, p in whole.state_kinds]
    out, ref = [], []
    for rows, pos0, mode in ((ids[:-3], 0, Mode.COMMIT_ALL), (ids[-3:], len(ids) - 3, Mode.WINDOW)):
        tokens = mx.array([rows])
        for state in [s for group in states for s in group] + whole_states:
            state.begin(pos0, len(rows), mode)
        h = models[0].embed(tokens)
        for model, stage, group in zip(models, stages, states):
            h = model.run_layers(h, group, stage.layers.start, stage.layers.stop)
        out.append(models[0].head(h))
        ref.append(whole(tokens, whole_states))
        for state in [s for group in states for s in group] + whole_states:
            state.commit(len(rows))
    return out, ref


@pytest.mark.parametrize("family", ["demo", "nemotron_h"])
def test_stages_compose_to_the_whole_model(family, tmp_path_factory):
    if family == "demo":
        path, ids = embedded_model_path(), [5, 9, 23, 7, 300, 41, 8, 77, 12, 3, 99, 4]
    else:
        path, ids = hybrid_hf_checkpoint(checkpoint_root(tmp_path_factory), family), [5, 9, 23, 7, 30, 41, 8, 7, 12, 3]
    whole = load_checkpoint(path)
    ranks = 2 if family == "demo" else 3
    stages = [Stage(r, ranks, path=path) for r in range(ranks)]
    models = [load_checkpoint(path, stage=stage) for stage in stages]
    assert sum(len(s.layers) for s in stages) == len(whole.layers)
    assert sum(len(s.kinds) for s in stages) == len(whole.state_kinds)
    names = [set(dict(tree_flatten(m.parameters()))) for m in models]
    every = set(dict(tree_flatten(whole.parameters())))
    assert set().union(*names) == every  # every tensor is held by some rank...
    assert sum(len(n) for n in names) == len(every)  # ...and by one rank only
    for stage, held in zip(stages[1:], names[1:]):
        assert held and all(".layers." in name for name in held)  # no embeddings or head after rank 0
    out, ref = run_stages(models, stages, whole, ids)
    for o, r in zip(out, ref):
        assert mx.array_equal(o, r).item()


def test_ranks_that_no_backend_joined_are_refused(monkeypatch):
    from strata_cli.distributed import PipelineError, find_group

    assert find_group() is None  # one process: nothing changes
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")  # a launcher's ranks, with no backend to join them
    with pytest.raises(PipelineError, match="started as rank 0 of 2 but no distributed backend joined"):
        find_group()


PEAK_OF_LOAD = """
import json, sys
import mlx.core as mx
from mlx.utils import tree_flatten
from strata_cli.distributed import Stage
from strata_cli.runtime import embedded_model_path, load_checkpoint
path = embedded_model_path()
stage = Stage(1, 2, path=path) if sys.argv[1] == "rank1" else None
before = mx.get_active_memory()
model = load_checkpoint(path, stage=stage)
held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
print(json.dumps({"peak": mx.get_peak_memory() - before, "held": held}))
"""


def test_a_later_rank_never_reads_the_other_ranks_tensors():
    """Tensors load lazily and the dropped ones are never evaluated: rank 1 of 2's peak memory
    while loading is about its own half, not the whole model plus a copy. Each load runs in a
    process of its own, where no other test's arrays come or go while the peak is taken."""
    def load(which):
        out = subprocess.run([sys.executable, "-c", PEAK_OF_LOAD, which], capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout.splitlines()[-1])

    whole, rank1 = load("whole"), load("rank1")
    assert rank1["held"] < 0.5 * whole["held"]
    assert rank1["peak"] < 0.6 * whole["peak"]


def test_generate_refuses_stdin_prompts_under_a_launcher(monkeypatch):
    from click.testing import CliRunner

    from strata_cli.cli import cli

    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    result = CliRunner().invoke(cli, ["generate", "--each-line"], input="def f(x):\n")
    assert result.exit_code != 0 and "pass the prompt as an argument" in result.output


def test_layer_states_travel_as_encoded_with_shared_arrays_once():
    """stage_transfer.py's form: arrays by index (one shared by two snapshots is sent once),
    ints and empty slots as they are, empty arrays made again from their shape."""
    from strata_cli.stage_transfer import decode_states, encode_states

    shared, empty = mx.arange(12, dtype=mx.float32).reshape(1, 2, 3, 2), mx.zeros((1, 0, 4), dtype=mx.bfloat16)
    first = [(shared, shared, 5), (None, empty)]
    second = [(shared, mx.ones((2,)), 7), (None, None)]
    arrays, index = [], {}
    encoded = [encode_states(states, arrays, index) for states in (first, second)]
    assert len(arrays) == 3 and encoded[0][0] == [{"a": 0}, {"a": 0}, {"i": 5}]
    for states, form in zip((first, second), encoded):
        back = decode_states(form, arrays)
        assert len(back) == len(states)
        for layer, saved in zip(back, states):
            assert len(layer) == len(saved)
            for a, b in zip(layer, saved):
                assert a is b  # the very arrays: rank 0 keeps sharing what the ranks shared
    with pytest.raises(TypeError, match="layer 0 slot 0"):
        encode_states([(True,)], [], {})
