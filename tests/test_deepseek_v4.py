"""DeepSeek-V4 (`deepseek_v4`) against transformers on a tiny random checkpoint
(tests/dsv4_checkpoints.py: sliding, CSA and HCA layers, sparse selection from 16 positions), and
its compressed-attention state rolled back exactly (engine/compressed_state.py).

- parity: every row's logits within 1e-4 of transformers' over a prompt that crosses many
  compressor blocks and the sparse-selection length; greedy continuations equal to transformers'
  `generate` serially, with 3 drafts, `auto` (up to 7) and scripted drafts (T up to 8, rows kept
  and rejected everywhere); seeded sampling the same with 0, 3 and auto drafts;
- forced rejection (tests/state_checks.py) at every pos0 % 4 and % 8 (the HCA rate), below and
  above the sparse-selection length, in window and partial modes: logits, the sliding-window keys,
  both compressor tails and their entries, the next row;
- the capped ring (`compressed_rollback="cap"`): exact for capped windows, and a window that
  crosses a block boundary breaks it (the defect the cap contains);
- snapshots: checkpoints and session files restore every part of the state; forged ones refused.
"""

import io
import random

import mlx.core as mx
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from dsv4_checkpoints import hf_checkpoint, hf_model, hf_ties
from hf_checkpoints import checkpoint_root, tokenizer_dir
from hybrid_parity import NUM_TOKENS, check_greedy, check_logits, check_seeded_sampling, hf_greedy, strata_logits, strata_tokens
from state_checks import check_forced_rejections, max_state_diff, serial_decode

from strata_cli.cli import cli
from strata_cli.convert import convert
from strata_cli.decode import generate, plan_windows
from strata_cli.engine.window import SnapshotError, WindowEngine
from strata_cli.model import load_model
from strata_cli.model.config import ConfigError
from strata_cli.model.layers import RowSplit
from strata_cli.model.moe import QuantizedSwitchGLU
from strata_cli.model.compressed_attention import top_k_mask
from strata_cli.model.deepseek_v4 import Config, sparse_selection_length
from strata_cli.options import (ConvertOptions, EngineOptions, GenerateOptions, MoceOptions, ServeOptions, SpecOptions,
                                StreamOptions)
from strata_cli.runtime import load_checkpoint
from strata_cli.speculative.suffix_drafter import Proposal
from strata_cli.telemetry import DecodeStats
from strata_cli.serve.checkpoints import Checkpoint
from strata_cli.serve.protocol import FrameWriter
from strata_cli.serve.server import Server
from strata_cli.serve.session import SessionError, load_session, save_session

pytestmark = pytest.mark.parity
TOL = 1e-5  # window rows and commits against serial decoding (bitwise equal on the CPU so far)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = checkpoint_root(tmp_path_factory)
    return hf_checkpoint(root, tokenizer=tokenizer_dir(root))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def prompt_ids():
    """Random ids whose tail repeats their start, so the suffix drafter proposes."""
    rng = random.Random(5)
    head = [rng.randrange(hf_model().config.vocab_size) for _ in range(48)]
    return head + head[:14]


@pytest.fixture(scope="module")
def serial(model):
    return serial_decode(model, 34)


def test_selection_matters_in_these_prompts(model, prompt_ids):
    assert sparse_selection_length(model.config) == 16 < len(prompt_ids)
    assert hf_ties(hf_model(), prompt_ids) == 0  # transformers' top-k picks are not arbitrary here


def test_logits_match_transformers(model, prompt_ids):
    with torch.no_grad():
        reference = hf_model()(torch.tensor([prompt_ids])).logits[0].float().numpy()
    check_logits(strata_logits(model, prompt_ids), reference, "deepseek_v4")


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(hf_model(), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


def test_serial_steps_equal_one_window(model, serial):
    seq, logits, _ = serial
    whole = WindowEngine(model).run(seq, 0).logits
    assert float(mx.abs(whole - mx.stack(logits)).max()) <= 1e-4


@pytest.mark.parametrize("pos0", range(16, 24))  # every pos0 % 4 and % 8, sparse selection on
def test_forced_rejection_above_selection_length(model, serial, pos0):
    assert check_forced_rejections(model, EngineOptions(), serial, pos0, TOL) == 35


@pytest.mark.parametrize("pos0", [6, 11])  # fewer closed entries than the indexer keeps
def test_forced_rejection_below_selection_length(model, serial, pos0):
    assert check_forced_rejections(model, EngineOptions(), serial, pos0, TOL) == 35


@pytest.mark.parametrize("pos0", [23])
def test_forced_rejection_partial_mode(model, serial, pos0):
    assert check_forced_rejections(model, EngineOptions(partial=True), serial, pos0, TOL) == 35


def capped_rejections(model, serial, pos0: int, *, capped: bool) -> float:
    """The largest state or next-logit difference from serial over every keep of the windows
    T <= 4 - pos0 % 4 (capped) or T = 5..8 (crossing a block), in the ring mode."""
    seq, serial_logits, serial_states = serial
    engine = WindowEngine(model, EngineOptions(compressed_rollback="cap"))
    engine.prefill(seq[:pos0])
    start = engine.snapshot()
    sizes = range(1, 4 - pos0 % 4 + 1) if capped else range(5, 9)
    worst = 0.0
    for T in sizes:
        for keep in range(1, T + 1):
            engine.restore(start)
            wrong = [(t + 1) % model.config.vocab_size for t in seq[pos0 + keep : pos0 + T]]
            engine.run(seq[pos0 : pos0 + keep] + wrong, pos0)
            engine.commit(keep)
            worst = max(worst, max_state_diff(engine.state_tensors(), serial_states[pos0 + keep - 1]))
            for p in range(pos0 + keep, pos0 + 9):  # on serially past the next block boundary
                out = engine.run([seq[p]], p)
                engine.commit(1)
                worst = max(worst, float(mx.abs(out.logits[0] - serial_logits[p]).max()))
            worst = max(worst, max_state_diff(engine.state_tensors(), serial_states[pos0 + 8]))
    return worst


@pytest.mark.parametrize("pos0", [16, 17, 18, 19])
def test_ring_is_exact_under_the_block_cap(model, serial, pos0):
    assert capped_rejections(model, serial, pos0, capped=True) <= TOL


def test_ring_breaks_when_a_window_crosses_a_block(model, serial):
    assert capped_rejections(model, serial, 17, capped=False) > 1e-2


def test_replay_allows_eight_row_windows_and_the_ring_asks_for_the_cap(model):
    replay = WindowEngine(model)
    assert not replay.needs_block_cap and replay.block == 4
    planner = plan_windows(replay, [1, 2, 3], SpecOptions(max_drafts=7), None, None)
    assert not planner.block_cap
    ring = WindowEngine(model, EngineOptions(compressed_rollback="cap"))
    planner = plan_windows(ring, [1, 2, 3], SpecOptions(max_drafts=7), None, None)
    assert planner.block_cap and planner.block == 4


def test_snapshot_restores_every_part(model, serial):
    seq, logits, states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:21])
    saved = engine.snapshot()
    engine.run(seq[21:29], 21)
    engine.commit(8)
    engine.restore(saved)
    assert max_state_diff(engine.state_tensors(), states[20]) <= TOL
    out = engine.run([seq[21]], 21)
    assert float(mx.abs(out.logits[0] - logits[21]).max()) <= TOL
    engine.commit(1)
    engine.check_snapshot(engine.snapshot())
    engine.check_snapshot(saved)


def test_session_file_round_trip(model, serial, tmp_path):
    seq, logits, states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:23])
    layout = [type(s).__name__ for s in engine.states]
    file = tmp_path / "session.safetensors"
    save_session(file, [Checkpoint(tuple(seq[:23]), engine.snapshot())], identity="m", dtype="float32", layout=layout)
    (checkpoint,) = load_session(file, identity="m", dtype="float32", layout=layout, max_context=engine.max_context,
                                 vocab_size=model.config.vocab_size, check=engine.check_snapshot)
    fresh = WindowEngine(model)
    fresh.restore(checkpoint.snapshot)
    assert max_state_diff(fresh.state_tensors(), engine.state_tensors()) == 0.0  # every part, bit for bit
    assert max_state_diff(fresh.state_tensors(), states[22]) <= TOL
    out = fresh.run([seq[23]], 23)
    assert float(mx.abs(out.logits[0] - logits[23]).max()) <= TOL


def forged(snapshot, layer: int, slot: int, value):
    states = [list(s) for s in snapshot.states]
    states[layer][slot] = value
    return type(snapshot)(snapshot.length, tuple(tuple(s) for s in states))


@pytest.mark.parametrize("case", ["count", "raw rows", "entries", "indexer length"])
def test_forged_snapshots_are_refused(model, serial, case):
    seq = serial[0]
    engine = WindowEngine(model)
    engine.prefill(seq[:22])
    snap = engine.snapshot()
    csa = 1  # layer 1 is CSA: window (3 slots), compressor (5), indexer (5)
    kv = snap.states[csa][3]
    if case == "count":
        bad = forged(snap, csa, 6, 4)  # 22 positions close 5 entries
    elif case == "raw rows":
        bad = forged(snap, csa, 3, kv[:, 1:])
    elif case == "entries":
        bad = forged(snap, csa, 5, snap.states[csa][5][:, :2])
    else:
        bad = forged(snap, csa, 12, 21)
    with pytest.raises(SnapshotError, match="layer 1"):
        engine.check_snapshot(bad)


def test_forged_session_is_refused(model, serial, tmp_path):
    seq = serial[0]
    engine = WindowEngine(model)
    engine.prefill(seq[:22])
    layout = [type(s).__name__ for s in engine.states]
    bad = forged(engine.snapshot(), 3, 6, 3)
    file = tmp_path / "forged.safetensors"
    save_session(file, [Checkpoint(tuple(seq[:22]), bad)], identity="m", dtype="float32", layout=layout)
    with pytest.raises(SessionError, match="entry count"):
        load_session(file, identity="m", dtype="float32", layout=layout, max_context=engine.max_context,
                     vocab_size=model.config.vocab_size, check=engine.check_snapshot)


def test_top_k_ties_go_to_the_lower_index():
    scores = mx.array([[0.0, 2.0, 0.0, 1.0, 0.0]])
    assert top_k_mask(scores, 3).tolist() == [[True, True, False, True, False]]
    assert top_k_mask(scores, 4).tolist() == [[True, True, True, True, False]]


def test_config_refuses_what_it_does_not_run():
    base = hf_model().config.to_dict()
    with pytest.raises(ConfigError, match="rope scaling 'linear'"):
        Config.from_dict({**base, "rope_parameters": {"main": {"rope_type": "default"},
                                                      "compress": {"rope_type": "linear", "factor": 16}}})
    with pytest.raises(ConfigError, match="sliding-window layers"):
        Config.from_dict({**base, "rope_parameters": {"main": {"rope_type": "yarn"}, "compress": {}}})
    with pytest.raises(ConfigError, match="layer_types"):
        Config.from_dict({**base, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    legacy = {k: v for k, v in base.items() if k not in ("layer_types", "compress_rates", "partial_rotary_factor")}
    legacy.update(compress_ratios=[0, 4, 128, 4], qk_rope_head_dim=16)
    config = Config.from_dict(legacy)
    assert config.layer_types[1] == "compressed_sparse_attention" and config.qk_rope_head_dim == 16
    assert np.isclose(config.compress_rates["heavily_compressed_attention"], 128)


def test_convert_is_the_source_model(checkpoint, model, prompt_ids, tmp_path):
    result = CliRunner().invoke(cli, ["convert", str(checkpoint), str(tmp_path / "plain")])
    assert result.exit_code == 0, result.output
    converted = strata_logits(load_model(tmp_path / "plain"), prompt_ids)
    assert np.array_equal(converted, strata_logits(model, prompt_ids))


def test_q4_convert_quantizes_the_experts_and_decodes_identically_with_drafts(checkpoint, prompt_ids, tmp_path):
    out = tmp_path / "q4"
    result = CliRunner().invoke(cli, ["convert", str(checkpoint), str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    q4 = load_model(out, dequantize=False)
    assert isinstance(q4.layers[1].mlp.switch_mlp, QuantizedSwitchGLU)
    reference, _ = strata_tokens(q4, prompt_ids, SpecOptions())
    check_greedy(q4, prompt_ids, reference)


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "q4"])
def test_streamed_experts_are_the_resident_ones_bit_for_bit(checkpoint, prompt_ids, tmp_path, bits):
    options = dict(bits=bits, group_size=32) if bits else {}
    resident = load_model(convert(checkpoint, tmp_path / "r", options=ConvertOptions(**options)).path)
    path = convert(checkpoint, tmp_path / "s", options=ConvertOptions(stream=True, **options)).path
    streamed = load_checkpoint(path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        ids = prompt_ids[:40]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in (SpecOptions(), SpecOptions(max_drafts=3)):
            assert strata_tokens(streamed, prompt_ids, spec)[0] == strata_tokens(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()
    if bits is None:
        approximate = load_checkpoint(path, moce=MoceOptions(protect=1))
        try:
            with pytest.raises(ConfigError, match="not supported for deepseek_v4"):
                WindowEngine(approximate).run(prompt_ids[:4], 0)
        finally:
            approximate.expert_cache.close()


def test_cli_output_is_the_same_with_either_rollback_and_any_drafts(checkpoint):
    prompt = "def f(x):\n    return x\n\ndef f(x):"
    outputs = set()
    for rollback in ("replay", "cap"):
        for drafts in ("0", "3", "auto"):
            result = CliRunner().invoke(cli, ["generate", "--model", str(checkpoint), "--max-tokens", "24",
                                              "--suffix-draft", drafts, "--compressed-rollback", rollback, prompt])
            assert result.exit_code == 0, result.output
            outputs.add(result.output)
    assert len(outputs) == 1


YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def test_yarn_compressed_rotary_matches_transformers(tmp_path_factory, prompt_ids):
    """V4-Flash's compressed layers use YaRN (the sliding ones plain rotary)."""
    path = hf_checkpoint(checkpoint_root(tmp_path_factory), rope_parameters=YARN)
    config = load_model(path).config
    assert config.compress_rope["factor"] == 16.0 and config.compress_rope["attention_factor"] == 1.0
    with torch.no_grad():
        reference = hf_model(rope_parameters=YARN)(torch.tensor([prompt_ids])).logits[0].float().numpy()
    check_logits(strata_logits(load_model(path), prompt_ids), reference, "deepseek_v4 yarn")
    plain = strata_logits(load_model(hf_checkpoint(checkpoint_root(tmp_path_factory))), prompt_ids)
    assert np.abs(plain - reference).max() > 1e-2  # YaRN changes the output: the test can fail


class FullDrafter:
    """Always 7 drafts: the reference continuation with its 3rd and 6th tokens wrong."""

    def __init__(self, prompt_ids, reference, vocab_size):
        self.start = self.done = len(prompt_ids)
        self.reference, self.vocab_size = reference, vocab_size

    def propose(self, max_drafts):
        at = self.done - self.start
        right = list(self.reference[at : at + max_drafts]) + [0] * max_drafts
        tokens = tuple(t if i not in (2, 5) else (t + 1) % self.vocab_size for i, t in enumerate(right[:max_drafts]))
        return Proposal(tokens, match_length=4, position=0)

    def extend(self, tokens):
        self.done += len(list(tokens))


@pytest.mark.parametrize("rollback", ["replay", "cap"])
def test_eight_row_windows_run_uncapped_only_with_replay(model, prompt_ids, rollback):
    """Greedy output equals serial with windows of 8 rows crossing compressor blocks (replay);
    the ring's cap keeps every window within its block."""
    reference, _ = strata_tokens(model, prompt_ids, SpecOptions())
    stats = DecodeStats()
    engine = WindowEngine(model, EngineOptions(compressed_rollback=rollback))
    steps = generate(engine, prompt_ids, options=GenerateOptions(max_tokens=NUM_TOKENS), spec=SpecOptions(max_drafts=7),
                     eos_ids=frozenset(), stats=stats, drafter=FullDrafter(prompt_ids, reference, model.config.vocab_size))
    assert [t for step in steps for t in step.tokens] == reference
    sizes = [int(t) for t in stats.summary()["window_T_histogram"]]
    if rollback == "replay":
        assert max(sizes) == 8
    else:
        assert max(sizes) <= 4


def test_mtp_tensors_are_left_out_with_a_note(model):
    weights = {"mtp.0.attn.wq_a.weight": mx.zeros((2, 2)), "model.norm.weight": mx.ones((64,))}
    fresh = type(model)(model.config)
    assert set(fresh.sanitize(weights)) == {"model.norm.weight"}
    assert fresh.load_notes == ["MTP: 1 tensors (mtp.*) left out: strata does not run DeepSeek-V4's MTP layers"]
    assert model.load_notes == []


def test_split_rows_compute_what_whole_windows_do(model, serial, monkeypatch):
    """GPU backends run a decode window's attention, indexer scores, pooling and stream mixing
    one row at a time (`RowSplit`); "always" runs that path here: same rows, same rollback."""
    seq, logits, _ = serial
    monkeypatch.setattr(RowSplit, "mode", "always")
    engine = WindowEngine(model)
    engine.prefill(seq[:17])
    out = engine.run(seq[17:25], 17)
    assert float(mx.abs(out.logits - mx.stack(logits[17:25])).max()) <= TOL
    engine.commit(8)
    assert check_forced_rejections(model, EngineOptions(), serial, 19, TOL) == 35


@pytest.mark.parametrize("rollback", ["replay", "cap"])
def test_prefix_checkpoints_are_serial_and_reuse_gives_the_cold_output(model, rollback):
    """serve's prefix checkpoints (taken after windows that kept and rejected drafts) hold every
    part of the compressed-attention state: restored, each equals serially prefilling its tokens,
    and a request that reuses one answers what a cold server does."""
    from test_serve_server import LetterTokenizer, ask, prompts

    def server(**options):
        out = io.BytesIO()
        return Server(WindowEngine(model, EngineOptions(compressed_rollback=rollback)), LetterTokenizer(), chat=None,
                      options=ServeOptions(**{"checkpoint_every": 8, **options}),
                      defaults=GenerateOptions(max_tokens=12), spec=SpecOptions(max_drafts=7, min_match=3),
                      frames=FrameWriter(out), cancelled=lambda: False), out

    (warm, warm_out), (cold, cold_out) = server(), server(prefix_cache_entries=0)
    reused = 0
    for i, prompt in enumerate(prompts(3, seed=2) * 2):
        a = ask(warm, warm_out, id=i, prompt=prompt, suffix_draft=7)
        b = ask(cold, cold_out, id=i, prompt=prompt, suffix_draft=7)
        assert a["token_ids"] == b["token_ids"], i
        reused += a["usage"]["cached_tokens"]
    assert reused > 0 and len(warm.checkpoints()) > 3
    for c in warm.checkpoints():
        restored, serial = WindowEngine(model), WindowEngine(model)
        restored.restore(c.snapshot)
        serial.prefill(list(c.tokens))
        assert max_state_diff(restored.state_tensors(), serial.state_tensors()) <= 1e-4, c.length


def test_sliding_keys_are_one_buffer(model):
    """The layer reads its keys as values: the positional KV keeps one buffer, not two."""
    rng = random.Random(9)
    ids = [rng.randrange(model.config.vocab_size) for _ in range(300)]  # past one KV_STEP of 256 cells
    engine = WindowEngine(model)
    engine.prefill(ids[:-4])
    engine.run(ids[-4:], len(ids) - 4)
    engine.commit(2)
    assert all(state.window.values is state.window.keys for state in engine.states)
    assert engine.states[0].window.keys.shape[2] == 512


def test_capped_rings_are_never_padded(model, monkeypatch):
    """A padded row (GPU row buckets) would write a capped ring past the compressor block: capped
    engines do not pad on a GPU, and asking for both is refused in one line."""
    monkeypatch.setattr("strata_cli.engine.window.on_gpu", lambda: True)
    assert WindowEngine(model, EngineOptions(compressed_rollback="replay")).pads_windows
    assert not WindowEngine(model, EngineOptions(compressed_rollback="cap")).pads_windows
    with pytest.raises(ConfigError, match="cannot be padded"):
        WindowEngine(model, EngineOptions(compressed_rollback="cap", pad_windows=True))
