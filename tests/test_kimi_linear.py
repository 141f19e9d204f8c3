"""Kimi-Linear (`kimi_linear`): KDA layers (model/kda.py) with NoPE MLA layers and DeepSeek's MoE,
against transformers and mlx-lm on a tiny random checkpoint (tests/deepseek_checkpoints.py), what
tests/hybrid_parity.py checks for every family, plus the KDA state:

- the chunked KDA scan within 1e-4 of the step recurrence at lengths 1, 63, 64, 65 and 1000, from
  zero and from a restored state, with fast-forgetting channels (a chunk's decay far past exp(-88));
- forced rejection at every keep of T = 2..8 at pos0 = 8 and 11, lazy and eager fold, partial on
  and off: KDA state, conv history, latent KV and next logits equal serial decoding;
- sessions round-trip it.
"""

import mlx.core as mx
import numpy as np
import pytest
from deepseek_checkpoints import (
    kimi_linear_checkpoint,
    kimi_linear_fused_checkpoint,
    kimi_linear_hf_model,
    kimi_linear_mlx_checkpoint,
)
from hf_checkpoints import checkpoint_root, prompt_text, tokenizer_dir
from hybrid_parity import (
    check_greedy,
    check_logits,
    check_seeded_sampling,
    hf_greedy,
    hf_logits,
    mlx_lm_reference,
    strata_logits,
)
from state_checks import REJECTION_OFFSETS, check_checkpoint_round_trip, check_forced_rejections, serial_decode

from strata_cli.engine.state import GDNState, LatentKVState
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.model.gdn import l2_normalize
from strata_cli.model.kda import chunked_kda_scan, kda_step_scan
from strata_cli.model.kimi_linear import Config
from strata_cli.model.layer_state import GDNRows
from strata_cli.model.layers import RowSplit
from strata_cli.model.mla import MultiLinear, QuantizedMultiLinear
from strata_cli.options import EngineOptions
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity
TOL = 1e-5
SCAN_TOL = 1e-4
SEQ_LEN = 40


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    return Tokenizer(tokenizer_dir(root)).encode(prompt_text())


@pytest.fixture(scope="module")
def model(root):
    return load_model(kimi_linear_checkpoint(root))


def test_logits_match_transformers(model, prompt_ids):
    check_logits(strata_logits(model, prompt_ids), hf_logits(kimi_linear_hf_model(), prompt_ids), "published layout")


def test_fused_layout_matches_transformers(root, prompt_ids):
    logits = strata_logits(load_model(kimi_linear_fused_checkpoint(root)), prompt_ids)
    check_logits(logits, hf_logits(kimi_linear_hf_model(), prompt_ids), "in-memory layout")


def test_greedy_matches_transformers_generate(model, prompt_ids):
    check_greedy(model, prompt_ids, hf_greedy(kimi_linear_hf_model(), prompt_ids))


def test_seeded_sampling_is_the_same_with_drafts(model, prompt_ids):
    check_seeded_sampling(model, prompt_ids)


@pytest.mark.parametrize("bits", [None, 4], ids=["unquantized", "q4"])
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, bits):
    path = kimi_linear_mlx_checkpoint(root, bits)
    reference, tokens = mlx_lm_reference(path, prompt_ids)
    model = load_model(path, dequantize=False)
    assert isinstance(model.layers[1].self_attn.embed_q, QuantizedMultiLinear if bits else MultiLinear)
    check_logits(strata_logits(model, prompt_ids), reference, f"mlx layout {bits}-bit")
    check_greedy(model, prompt_ids, tokens)


def test_config_reads_the_published_spelling(root):
    import json

    params = json.loads((kimi_linear_checkpoint(root) / "config.json").read_text())
    ours = Config.from_dict(params)
    published = {k: v for k, v in params.items() if k not in ("layer_types", "mlp_layer_types", "linear_num_heads",
                                                                 "linear_head_dim", "linear_conv_kernel_dim")}
    published["linear_attn_config"] = {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "num_heads": 2,
                                       "head_dim": 32, "short_conv_kernel_size": 4}
    published["first_k_dense_replace"] = 1
    assert Config.from_dict(published) == ours
    assert ours.n_routed_experts == 8 and ours.num_experts_per_tok == 2 and ours.max_position_embeddings == 512
    from strata_cli.model.config import ConfigError

    with pytest.raises(ConfigError, match="outside 1..4"):
        Config.from_dict({**published, "linear_attn_config": {**published["linear_attn_config"], "kda_layers": [1, 5]}})
    with pytest.raises(ConfigError, match="only sigmoid"):
        Config.from_dict({**params, "moe_router_activation_func": "softmax"})


# -- the KDA scans ---------------------------------------------------------------------------------


def random_rows(T: int, *, seed: int, H: int = 2, D: int = 16) -> GDNRows:
    """Decays exp(g) with g down to -4.5 per row: some channels forget within a few rows."""
    keys = mx.random.split(mx.random.key(seed), 5)
    q = l2_normalize(mx.random.normal((1, T, H, D), key=keys[0])) * D**-0.5
    k = l2_normalize(mx.random.normal((1, T, H, D), key=keys[1]))
    v = mx.random.normal((1, T, H, D), key=keys[2])
    g = -mx.exp(mx.random.uniform(-5, 1.5, (1, T, H, D), key=keys[3]))
    beta = mx.sigmoid(mx.random.normal((1, T, H), key=keys[4]))
    return GDNRows(q, k, v, g, beta)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("start", ["zero", "restored"])
def test_chunked_scan_matches_the_step_recurrence(T, start):
    rows = random_rows(T, seed=T)
    S0 = mx.zeros((1, 2, 16, 16))
    if start == "restored":  # the state after a 40-row prefix, as a restored checkpoint holds it
        _, S0 = kda_step_scan(random_rows(40, seed=99), S0)
    for chunk in (32, 64):
        y_step, S_step = kda_step_scan(rows, S0)
        y_chunk, S_chunk = chunked_kda_scan(rows, S0, chunk=chunk)
        assert float(mx.abs(y_chunk - y_step).max()) <= SCAN_TOL, (T, chunk)
        assert float(mx.abs(S_chunk - S_step).max()) <= SCAN_TOL, (T, chunk)
        assert bool(mx.all(mx.isfinite(S_chunk)))


def test_prefill_after_a_restored_prefix_matches_serial(model, serial):
    """A prompt chunk (the chunked scan) run from a restored snapshot: serial logits."""
    seq, serial_logits, _ = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:10])
    snap = engine.snapshot()
    engine.prefill(seq[10:12])
    engine.restore(snap)
    out = engine.run(seq[10:SEQ_LEN], 10)  # 30 rows: the chunked form
    assert float(mx.abs(out.logits - mx.stack(serial_logits[10:SEQ_LEN])).max()) <= SCAN_TOL


# -- the state -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serial(model):
    return serial_decode(model, SEQ_LEN)


def test_the_model_has_both_state_kinds(model):
    engine = WindowEngine(model)
    assert [type(s) for s in engine.states] == [GDNState, LatentKVState, GDNState, GDNState]
    engine.prefill([1, 2, 3])
    kda = engine.state_tensors()[0]
    assert kda["recurrent"].shape == (1, 2, 32, 32) and kda["recurrent"].dtype == mx.float32
    assert kda["conv_history"].shape == (1, 3, 3 * 2 * 32)  # K-1 raw inputs of q, k and v


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("fold", ["lazy", "eager"])
@pytest.mark.parametrize("pos0", REJECTION_OFFSETS, ids=lambda p: f"pos0={p}")
def test_forced_rejection_matches_serial(model, serial, fold, partial, pos0):
    options = EngineOptions(fold=fold, partial=partial)
    assert check_forced_rejections(model, options, serial, pos0, TOL) == sum(range(2, 9))


@pytest.mark.parametrize("pos0", REJECTION_OFFSETS, ids=lambda p: f"pos0={p}")
def test_forced_rejection_with_rows_split(model, serial, pos0, monkeypatch):
    """Every window row's projections and attention alone, as on a GPU (`RowSplit` "always")."""
    monkeypatch.setattr(RowSplit, "mode", "always")
    assert check_forced_rejections(model, EngineOptions(), serial, pos0, TOL) == sum(range(2, 9))


def test_prefix_checkpoint_and_session_round_trip(model, serial, tmp_path):
    check_checkpoint_round_trip(model, serial[0], tmp_path / "s.session", identity="kimi-tiny", rejected=1)


# -- convert and streaming -------------------------------------------------------------------------


def test_convert_and_streamed_convert(root, prompt_ids, tmp_path):
    """`strata convert` of the published layout gives its logits bit for bit; `--bits 4 --stream`
    at 3 resident experts per layer is bit-identical to the resident 4-bit conversion."""
    from hybrid_parity import strata_tokens

    from strata_cli.convert import convert
    from strata_cli.options import ConvertOptions, SpecOptions, StreamOptions
    from strata_cli.runtime import load_checkpoint

    src = kimi_linear_checkpoint(root)
    plain = convert(src, tmp_path / "plain", options=ConvertOptions()).path
    np.testing.assert_array_equal(strata_logits(load_model(plain), prompt_ids), strata_logits(load_model(src), prompt_ids))
    q4 = convert(src, tmp_path / "q4", options=ConvertOptions(bits=4, group_size=32)).path
    streamed_path = convert(src, tmp_path / "q4-stream", options=ConvertOptions(bits=4, group_size=32, stream=True)).path
    resident = load_model(q4)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        spec = SpecOptions(max_drafts=3)
        assert strata_tokens(streamed, prompt_ids, spec)[0] == strata_tokens(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()
