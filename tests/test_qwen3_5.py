"""Qwen3.5 / 3.6 (issue 33), dense `qwen3_5` and `qwen3_5_moe`, in float32 on the CPU.

- Hugging Face layouts (the multimodal save, the text-only save, the published state dict with
  fused experts and MTP tensors): logits within 1e-4 of transformers' over a 214-token prompt,
  greedy 32-token continuations equal to transformers' `generate`, serial, with 3 suffix drafts
  per window and with `auto`; the three layouts load to bit-identical models.
- MLX layout (mlx-lm's conversion of the published checkpoint, unquantized, 4- and 8-bit): logits and
  greedy tokens against mlx-lm loading the same files.
- Lossless speculation: seeded sampling emits the same tokens with 0, 3 and auto drafts; forced
  rejection at every keep of T = 2..8 at four positions leaves state and next logits equal to
  serial decoding's.
- MTP tensors kept aside (loaded, unused, written back by convert), the vision tower skipped, and
  what strata refuses, in one line each; `strata convert --bits 4` (and `--stream`) loads and
  decodes as mlx-lm's own 4-bit conversion does, streamed bit-identical.

The checkpoints are tiny random models, built once per session (hf_checkpoints.py).
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from state_checks import REJECTION_OFFSETS, max_state_diff, serial_decode
import torch
from hf_checkpoints import (
    QWEN3_5_FAMILIES,
    QWEN3_5_LAYOUTS,
    checkpoint_root,
    prompt_text,
    qwen3_5_checkpoint,
    qwen3_5_hf_model,
    qwen3_5_mlx_checkpoint,
    qwen3_5_mtp_tensors,
    tokenizer_dir,
)
from mlx.utils import tree_flatten

from strata_cli.convert import convert
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model import load_model
from strata_cli.model.layers import RowQuantizedLinear
from strata_cli.model.loader import ModelLoadError
from strata_cli.model.moe import QuantizedSwitchGLU
from strata_cli.options import (
    ConvertOptions,
    EngineOptions,
    GenerateOptions,
    SpecOptions,
    StreamOptions,
)
from strata_cli.runtime import load_checkpoint
from strata_cli.telemetry import DecodeStats
from strata_cli.tokenizer import Tokenizer

pytestmark = pytest.mark.parity

LOGIT_TOLERANCE = 1e-4
MIN_LOGIT_STD = 1.0
NUM_TOKENS = 32
STATE_TOL = 1e-5
SEQ_LEN = 24
SPECS = {"serial": SpecOptions(), "draft3": SpecOptions(max_drafts=3), "auto": SpecOptions(max_drafts=3, auto=True)}
_cache: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return checkpoint_root(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_ids(root):
    ids = Tokenizer(tokenizer_dir(root)).encode(prompt_text())
    assert len(ids) >= 64
    return ids


def loaded(root, family: str, layout: str):
    key = ("model", family, layout)
    if key not in _cache:
        _cache[key] = load_model(qwen3_5_checkpoint(root, family, layout))
    return _cache[key]


def transformers_logits(family: str, layout: str, ids: list[int]) -> np.ndarray:
    key = ("hf logits", family, layout == "text")
    if key not in _cache:
        with torch.no_grad():
            _cache[key] = qwen3_5_hf_model(family, layout)(torch.tensor([ids])).logits[0].numpy()
    return _cache[key]


def transformers_greedy(family: str, layout: str, ids: list[int]) -> list[int]:
    key = ("hf greedy", family, layout == "text")
    if key not in _cache:
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = qwen3_5_hf_model(family, layout).generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NUM_TOKENS, do_sample=False,
            )
        _cache[key] = out[0, len(ids):].tolist()
    return _cache[key]


def strata_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(WindowEngine(model).run(ids, 0).logits)


def decode(model, ids: list[int], spec: SpecOptions, options: GenerateOptions | None = None) -> tuple[list[int], dict]:
    stats = DecodeStats()
    steps = generate(WindowEngine(model), ids, options=options or GenerateOptions(max_tokens=NUM_TOKENS), spec=spec,
                     eos_ids=frozenset(), stats=stats)
    return [t for step in steps for t in step.tokens], stats.summary()


def check_greedy(model, ids: list[int], reference: list[int]) -> None:
    assert len(reference) == NUM_TOKENS
    for name, spec in SPECS.items():
        tokens, summary = decode(model, ids, spec)
        assert tokens == reference, name
        if name == "draft3":
            assert summary["drafts_offered"] > 0  # windows of T > 1 really ran (the prompt ends in a repeat)


@pytest.mark.parametrize("layout", QWEN3_5_LAYOUTS)
@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_logits_match_transformers(root, prompt_ids, family, layout):
    reference = transformers_logits(family, layout, prompt_ids)
    logits = strata_logits(loaded(root, family, layout), prompt_ids)
    assert reference.std() >= MIN_LOGIT_STD
    diff, last = np.abs(logits - reference).max(), np.abs(logits[-1] - reference[-1]).max()
    assert diff <= LOGIT_TOLERANCE, f"{family} {layout}: max abs logit diff {diff:.2e} over {len(prompt_ids)} tokens"
    assert last <= LOGIT_TOLERANCE, f"{family} {layout}: last row {last:.2e}"


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_layouts_load_the_same_model(root, prompt_ids, family):
    """The multimodal save, the text-only save and the published state dict hold one set of
    weights: strata computes bit-identical logits from each."""
    ids = prompt_ids[:40]
    first, *others = [strata_logits(loaded(root, family, layout), ids) for layout in QWEN3_5_LAYOUTS]
    for other in others:
        np.testing.assert_array_equal(other, first)


@pytest.mark.parametrize("layout", QWEN3_5_LAYOUTS)
@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_greedy_matches_transformers_generate(root, prompt_ids, family, layout):
    check_greedy(loaded(root, family, layout), prompt_ids, transformers_greedy(family, layout, prompt_ids))


@pytest.mark.parametrize("bits", [None, 4, 8], ids=["unquantized", "q4", "q8"])
@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_mlx_layout_matches_mlx_lm(root, prompt_ids, family, bits):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    path = qwen3_5_mlx_checkpoint(root, family, bits)
    reference_model, _ = mlx_lm_load(str(path))
    reference = np.array(reference_model(mx.array([prompt_ids]))[0])
    model = load_model(path, dequantize=False)  # the quantized path itself (the CPU default dequantizes)
    layer = model.layers[0]
    assert isinstance(layer.linear_attn.in_proj_qkv, RowQuantizedLinear) == (bits is not None)
    if family == "qwen3_5_moe":
        assert isinstance(layer.mlp.switch_mlp, QuantizedSwitchGLU) == (bits is not None)
        if bits is not None:  # the router at 8 bits, under mlx-lm's own module path in config.json
            assert layer.mlp.switch_mlp.gate_proj.bits == bits and layer.mlp.gate.bits == 8
    assert reference.std() >= MIN_LOGIT_STD
    for candidate in (model, load_model(path)):  # quantized dense layers, and the CPU's dequantized ones
        diff = np.abs(strata_logits(candidate, prompt_ids) - reference).max()
        assert diff <= LOGIT_TOLERANCE, f"{family} {bits}-bit: max abs logit diff {diff:.2e}"
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt_ids), reference_model, max_tokens=NUM_TOKENS)]
    check_greedy(model, prompt_ids, tokens)


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_seeded_sampling_is_identical_across_draft_modes(root, prompt_ids, family):
    model = loaded(root, family, "published")
    offered = 0
    for seed in (3, 11):
        options = GenerateOptions(max_tokens=24, temperature=0.7, seed=seed)
        runs = {name: decode(model, prompt_ids, spec, options) for name, spec in SPECS.items()}
        assert runs["draft3"][0] == runs["serial"][0] and runs["auto"][0] == runs["serial"][0], seed
        offered += runs["draft3"][1]["drafts_offered"]
    assert offered > 0


@pytest.fixture(scope="module", params=QWEN3_5_FAMILIES)
def serial(request, root):
    """Serial T=1 decoding of a fixed sequence: logits and committed state after each token."""
    model = loaded(root, request.param, "published")
    return (model, *serial_decode(model, SEQ_LEN))


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("fold", ["lazy", "eager"])
def test_forced_rejection_matches_serial(serial, fold, partial):
    """tests/test_window_rollback.py's check on Qwen3.5: every row past the rejection leaves no trace."""
    model, seq, serial_logits, serial_states = serial
    vocab = model.config.vocab_size
    engine = WindowEngine(model, EngineOptions(fold=fold, partial=partial))
    checked = 0
    for pos0 in REJECTION_OFFSETS:  # no branch on pos0 (state_checks.py); layer types go by layer, not position
        engine.reset()
        engine.prefill(seq[:pos0])
        start = engine.snapshot()
        for T in range(2, 9):
            for keep in range(1, T + 1):
                engine.restore(start)
                wrong = [(t + 1 + i) % vocab for i, t in enumerate(seq[pos0 + keep : pos0 + T])]
                out = engine.run(seq[pos0 : pos0 + keep] + wrong, pos0)
                for i in range(keep):
                    assert float(mx.abs(out.logits[i] - serial_logits[pos0 + i]).max()) <= STATE_TOL, (pos0, T, keep, i)
                engine.commit(keep)
                assert max_state_diff(engine.state_tensors(), serial_states[pos0 + keep - 1]) <= STATE_TOL
                nxt = pos0 + keep
                out = engine.run([seq[nxt]], nxt)
                assert float(mx.abs(out.logits[0] - serial_logits[nxt]).max()) <= STATE_TOL, (pos0, T, keep)
                engine.commit(1)
                assert max_state_diff(engine.state_tensors(), serial_states[nxt]) <= STATE_TOL, (pos0, T, keep)
                checked += 1
    assert checked == len(REJECTION_OFFSETS) * sum(range(2, 9))


def test_wrong_rows_would_be_detected(serial):
    """The comparison is sharp: committing a row whose input was wrong shows up at once."""
    model, seq, _, serial_states = serial
    engine = WindowEngine(model)
    engine.prefill(seq[:8])
    engine.run(seq[8:10] + [(seq[10] + 1) % model.config.vocab_size], 8)
    engine.commit(3)
    assert max_state_diff(engine.state_tensors(), serial_states[10]) > 1e-2


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_mtp_weights_are_kept_aside(root, family):
    """The published checkpoint's MTP tensors are loaded, transformed like the model's own (1 + w
    norms, stacked experts) and kept on `model.mtp`; checkpoints without them say so."""
    model = loaded(root, family, "published")
    mtp = dict(tree_flatten(model.mtp.parameters()))
    source = {k.removeprefix("mtp."): mx.array(v.numpy()) for k, v in qwen3_5_mtp_tensors(family).items()}
    np.testing.assert_array_equal(mtp["fc.weight"], source["fc.weight"])
    np.testing.assert_allclose(mtp["norm.weight"], source["norm.weight"] + 1.0)
    np.testing.assert_allclose(mtp["layers.0.self_attn.q_norm.weight"], source["layers.0.self_attn.q_norm.weight"] + 1)
    if family == "qwen3_5_moe":
        stacked = mx.stack([source[f"layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(8)])
        np.testing.assert_array_equal(mtp["layers.0.mlp.switch_mlp.down_proj"], stacked)
        assert len(mtp) == len(source) - 3 * 8 + 3
    else:
        assert len(mtp) == len(source)
    assert any(note.startswith("MTP: 1 layer(s)") for note in model.load_notes)
    assert any(note.startswith("vision tower: ") for note in model.load_notes)
    assert "mtp" not in loaded(root, family, "multimodal")  # transformers' save holds none (and says none)
    assert not any("MTP" in note for note in loaded(root, family, "multimodal").load_notes)
    mlx_model = load_model(qwen3_5_mlx_checkpoint(root, family, None))
    assert "mtp" not in mlx_model and "holds none" in mlx_model.load_notes[0]


def _edited(root, tmp_path, layout: str, edit) -> str:
    path = tmp_path / "edited"
    shutil.copytree(qwen3_5_checkpoint(root, "qwen3_5_moe", layout), path)
    config = json.loads((path / "config.json").read_text())
    edit(config.get("text_config", config), path)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_what_is_refused_is_said_in_one_line(root, tmp_path):
    def rope_scaling(text, _):
        text["rope_parameters"].update(rope_type="yarn", factor=4.0)

    assert "rope scaling is not supported" in _edited(root, tmp_path / "a", "multimodal", rope_scaling)

    def no_experts(text, _):
        text["num_experts"] = 0

    assert "qwen3_5_moe needs num_experts" in _edited(root, tmp_path / "b", "multimodal", no_experts)

    def no_hidden(text, _):
        del text["hidden_size"]

    assert "lacks hidden_size" in _edited(root, tmp_path / "c", "text", no_hidden)

    def extra_mtp_tensor(_, path):  # an MTP tensor strata does not know: never dropped in silence
        weights = mx.load(str(path / "model.safetensors"))
        weights["mtp.embed_tokens.weight"] = mx.zeros((4, 4))
        mx.save_safetensors(str(path / "model.safetensors"), weights)

    assert "unexpected tensors mtp.embed_tokens.weight" in _edited(root, tmp_path / "d", "published", extra_mtp_tensor)


@pytest.fixture(scope="module")
def converted(root, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5_convert")
    src = qwen3_5_checkpoint(root, "qwen3_5_moe", "published")
    q4 = convert(src, out / "q4", options=ConvertOptions(bits=4)).path
    streamed = convert(src, out / "q4-stream", options=ConvertOptions(bits=4, stream=True)).path
    return q4, streamed


def test_convert_q4_decodes_as_mlx_lm_q4(root, prompt_ids, converted):
    """`strata convert --bits 4` quantizes as mlx-lm's converter does (routers at 8 bits): the same
    logits and greedy tokens as strata and mlx-lm loading mlx-lm's own 4-bit conversion; mlx-lm
    loads strata's output too; the MTP tensors survive (unquantized)."""
    from strata_cli.bench.peers import MlxLmPeer

    q4, _ = converted
    model = load_model(q4)
    reference = load_model(qwen3_5_mlx_checkpoint(root, "qwen3_5_moe", 4))
    np.testing.assert_allclose(strata_logits(model, prompt_ids), strata_logits(reference, prompt_ids), rtol=0, atol=1e-5)
    assert decode(model, prompt_ids, SpecOptions())[0] == decode(reference, prompt_ids, SpecOptions())[0]
    assert "mtp" in model and model.config.mtp_num_hidden_layers == 1
    peer = MlxLmPeer.load(q4, dtype=mx.float32).model
    ids = prompt_ids[:24]
    np.testing.assert_allclose(strata_logits(model, ids), np.array(peer(mx.array([ids]))[0]), rtol=0, atol=1e-4)


def test_streamed_convert_is_bit_identical(prompt_ids, converted):
    q4, streamed_path = converted
    resident = load_model(q4)
    streamed = load_checkpoint(streamed_path, stream=StreamOptions(resident_experts=3))
    try:
        assert streamed.expert_cache.num_slots == 3  # below top-k · rows: windows served in several passes
        ids = prompt_ids[:60]
        assert mx.array_equal(WindowEngine(streamed).run(ids, 0).logits, WindowEngine(resident).run(ids, 0).logits)
        for spec in (SPECS["serial"], SPECS["draft3"]):
            assert decode(streamed, prompt_ids, spec)[0] == decode(resident, prompt_ids, spec)[0]
    finally:
        streamed.expert_cache.close()


def test_generate_stats_says_what_the_load_kept_aside(root):
    """A published checkpoint's MTP layers and vision tower are never dropped silently: --stats
    prints the load's notes."""
    from click.testing import CliRunner

    from strata_cli.cli import cli

    path = qwen3_5_checkpoint(root, "qwen3_5_moe", "published")
    result = CliRunner().invoke(cli, ["generate", "def f(x):", "-n", "2", "--stats", "--model", str(path)])
    assert result.exit_code == 0, result.output
    assert "note: MTP: 1 layer(s)" in result.stderr and "note: vision tower: " in result.stderr


def test_linears_of_one_input_are_stacked_at_load(root):
    """Loading stacks the four GDN projections, and the MoE's router with the shared gate and the
    shared expert's gate with its up projection (`layers.StackedRows`, checked in
    tests/test_row_invariance.py), so prompts and GPU windows take one matmul each."""
    from strata_cli.model.layers import stacked

    model = loaded(root, "qwen3_5_moe", "multimodal")
    gdn = [layer.linear_attn for layer in model.layers if layer.is_linear]
    assert gdn and all(stacked(mixer, "_input_rows") is not None for mixer in gdn)
    assert all(stacked(layer.mlp, "_router_rows") is not None and stacked(layer.mlp, "_shared_rows") is not None
               for layer in model.layers)
