"""Faults in the expert files: a clear error naming the file and the expert, never wrong output or a
hang; through the library (typed exceptions) and the CLI (one line, exit status 1)."""

import errno
import os
import shutil
from concurrent.futures import Future

import mlx.core as mx
import pytest
from click.testing import CliRunner
from stream_checkpoints import build_pair

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.experts import store as expert_store
from strata_cli.experts.store import ExpertReadError, ExpertStore
from strata_cli.model import ModelLoadError
from strata_cli.options import (
    ConvertOptions,
    GenerateOptions,
    SpecOptions,
    StreamOptions,
)
from strata_cli.runtime import embedded_model_path, load_checkpoint


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("faults"))[1]


@pytest.fixture
def copy(streamed, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(streamed, dst)
    return dst


def layer_file(path, layer: int):
    return path / "experts" / f"layer_{layer:03d}.bin"


def flip_a_byte_of_expert_5_of_layer_1(model, path) -> None:
    """One bit of the middle byte of layer 1's expert 5 record, flipped on disk."""
    block = model.expert_cache.store.blocks["model.layers.1.mlp.switch_mlp"]
    offset, length, _ = block.records[5]
    with open(layer_file(path, 1), "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x40]))


def decode(model, tokens=range(1, 20)):
    steps = generate(WindowEngine(model), list(tokens), options=GenerateOptions(max_tokens=8),
                     spec=SpecOptions(max_drafts=3), eos_ids=())
    return [t for step in steps for t in step.tokens]


def test_truncated_file_is_refused_at_load(copy):
    f = layer_file(copy, 2)
    os.truncate(f, f.stat().st_size // 2 + 100)
    with pytest.raises(ModelLoadError, match=r"layer_002\.bin: truncated .* expert 16 of model\.layers\.2\.mlp\.switch_mlp"):
        load_checkpoint(copy)


def test_truncated_after_load_is_a_short_read(copy):
    model = load_checkpoint(copy, stream=StreamOptions(resident_experts=4))
    for layer in range(4):
        os.truncate(layer_file(copy, layer), 0)
    with pytest.raises(ExpertReadError, match=r"layer_000\.bin: short read of expert \d+ of model\.layers\.0\.mlp"):
        decode(model)
    model.expert_cache.close()


def test_corrupted_record_fails_its_checksum(copy):
    model = load_checkpoint(copy, stream=StreamOptions(resident_experts=4, prefetch="off"))
    flip_a_byte_of_expert_5_of_layer_1(model, copy)
    model.expert_cache.begin_window()
    x = mx.zeros((1, model.config.hidden_size))
    with pytest.raises(ExpertReadError, match=r"layer_001\.bin: checksum mismatch in expert 5 of model\.layers\.1"):
        model.layers[1].mlp.switch_mlp(x, mx.array([[5, 6]], dtype=mx.uint32))
    model.expert_cache.close()


def test_failed_prefetch_nobody_used_still_raises(streamed):
    """A prefetch that failed for an expert no row selected is reported at the next block."""
    model = load_checkpoint(streamed, stream=StreamOptions(resident_experts=4))
    cache = model.expert_cache
    failed = Future()
    failed.set_exception(ExpertReadError("layer_001.bin: short read of expert 9 of model.layers.1.mlp.switch_mlp"))
    cache.begin_window()
    cache._blocks[1].inflight[9] = failed  # as if block 0's prediction had asked for expert 9
    x = mx.zeros((1, model.config.hidden_size))
    model.layers[1].mlp.switch_mlp(x, mx.array([[1, 2]], dtype=mx.uint32))  # 9 unused: dropped
    with pytest.raises(ExpertReadError, match="expert 9"):
        model.layers[2].mlp.switch_mlp(x, mx.array([[1, 2]], dtype=mx.uint32))
    cache.close()


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EFAULT])  # a file system; an unpinnable buffer
def test_direct_io_refused_at_read_falls_back_to_the_page_cache(streamed, monkeypatch, refusal):
    store = ExpertStore(streamed, io="auto")
    path = "model.layers.0.mlp.switch_mlp"
    if not store._direct[path]:
        pytest.skip("this file system refuses O_DIRECT at open; the fallback at open is what ran")
    real = os.preadv
    calls = []

    def preadv(fd, buffers, offset):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(refusal, os.strerror(refusal))
        return real(fd, buffers, offset)

    monkeypatch.setattr(expert_store.os, "preadv", preadv)
    buf = store.pools[store.blocks[path].stride].take()
    store.read(path, 3, buf)
    assert store.io_mode == "mixed" and not store._direct[path] and len(calls) == 2
    store.close()


def test_direct_io_demanded_but_refused_is_a_clear_error(streamed, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    with pytest.raises(expert_store.ExpertStoreError, match="O_DIRECT is not available"):
        ExpertStore(streamed, io="direct")


@pytest.fixture(scope="module")
def demo_streamed(tmp_path_factory):
    dst = tmp_path_factory.mktemp("demo") / "demo-stream"
    convert(embedded_model_path(), dst, options=ConvertOptions(stream=True))
    return dst


def test_cli_reports_a_truncated_expert_file_in_one_line(demo_streamed, tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_RAISE_ERRORS", raising=False)
    model = tmp_path / "model"
    shutil.copytree(demo_streamed, model)
    os.truncate(layer_file(model, 3), 5000)
    result = CliRunner().invoke(cli, ["generate", "hello", "--model", str(model), "-n", "4"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "layer_003.bin: truncated" in lines[0], result.output


def test_cli_stats_and_json_report_expert_telemetry(demo_streamed):
    import json

    args = ["generate", "def f(x):", "--model", str(demo_streamed), "-n", "6", "--resident-experts", "3"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    experts = json.loads(result.output)["stats"]["experts"]
    for key in ("hits", "cold_misses", "capacity_misses", "bytes_read", "prefetched_bytes", "prefetch_coverage",
                "wasted_prefetches", "cancelled_prefetches", "late_wait_ms", "late_wait_share", "union_experts_per_layer",
                "cold_experts_beyond_root", "bytes_read_per_token", "model_bytes_read"):
        assert key in experts
    assert experts["model_bytes_read"] > 0 and len(experts["per_layer"]) == 6
    result = CliRunner().invoke(cli, [*args, "--stats"])
    assert result.exit_code == 0
    assert "experts per MoE layer" in result.output and "c>root" in result.output
    result = CliRunner().invoke(cli, ["generate", "x", "-n", "2", "--resident-experts", "3"])  # the demo is not streamed
    assert result.exit_code == 1 and "streamed checkpoint" in result.output


def test_a_corrupted_record_stops_a_preload_naming_it(copy):
    model = load_checkpoint(copy, stream=StreamOptions(resident_experts=8))
    flip_a_byte_of_expert_5_of_layer_1(model, copy)
    with pytest.raises(ExpertReadError, match=r"layer_001\.bin: checksum mismatch in expert 5 of model\.layers\.1"):
        model.expert_cache.preload()
    assert model.expert_cache.resident("model.layers.0.mlp.switch_mlp") == list(range(8))  # the blocks before it
    model.expert_cache.close()
