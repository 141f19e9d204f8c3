"""Host ints a window's kernels read (token ids, per-step sizes) and the kept shape arrays: on CUDA
they reach the GPU through MLX's pool and device memory (pooled.device_ints, probe.dims), never with
other values, another dtype or another shape than `mx.array` gives."""

import mlx.core as mx
import numpy as np
import pytest

from metal_shaders import pooled, probe
from state_checks import one_window
from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions


def turn_uploads_on(monkeypatch):
    """The CUDA path on this machine's CPU: pieces joined by concatenate, dims copied by an op."""
    monkeypatch.setattr(probe, "_upload", {"enabled": True, "device": mx.default_device(), "on": True})
    monkeypatch.setattr(probe, "_dims_cache", {})
    monkeypatch.setattr(probe, "_constants", {})
    monkeypatch.setattr(pooled, "_step_dims", {})


@pytest.fixture
def uploading(monkeypatch):
    turn_uploads_on(monkeypatch)


def test_uploads_are_asked_for_by_the_environment(monkeypatch):
    monkeypatch.delenv("STRATA_HOST_UPLOAD", raising=False)
    assert probe.upload_asked()  # on unless turned off (faster on the H100 at ba1cd33)
    monkeypatch.setenv("STRATA_HOST_UPLOAD", "1")
    assert probe.upload_asked()
    monkeypatch.setenv("STRATA_HOST_UPLOAD", "0")
    assert not probe.upload_asked()


def test_off_cuda_host_ints_are_plain_arrays():
    assert not probe.uploads()
    ids = pooled.device_ints([5, 6, 7])
    assert ids.dtype == mx.int32 and ids.tolist() == [5, 6, 7]
    assert pooled.device_ints([5, 6, 7], row=True).tolist() == [[5, 6, 7]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 17, 40])
def test_uploaded_ints_keep_values_dtype_and_shape(uploading, n):
    values = [int(v) for v in np.random.default_rng(n).integers(0, 151_936, n)]
    ids = pooled.device_ints(values)
    assert ids.dtype == mx.int32 and ids.shape == (n,) and ids.tolist() == values
    ids = pooled.device_ints(values, row=True)  # a window's ids, (1, T) as the model takes them
    assert ids.dtype == mx.int32 and ids.shape == (1, n) and ids.tolist() == [values]


def test_uploaded_ints_come_in_pool_sized_pieces(uploading, monkeypatch):
    made = []
    real = mx.array
    monkeypatch.setattr(mx, "array", lambda values, *a, **k: made.append(len(values)) or real(values, *a, **k))
    pooled.device_ints(range(7))
    assert made == [2, 2, 2, 1]  # each an 8-byte pooled buffer at most
    made.clear()
    pooled.device_ints(range(probe.MAX_UPLOAD_INTS + 1))  # a prompt's ids: one array
    assert made == [probe.MAX_UPLOAD_INTS + 1]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_ints_the_host_reads_come_back_in_pool_sized_copies(uploading, n):
    """A window's greedy tokens: each piece fits MLX's 8-byte pool, their values the argmax's in order."""
    values = mx.array(np.random.default_rng(n).integers(0, 151_936, n).astype(np.uint32))
    pieces = pooled.host_pieces(values)
    assert all(p.dtype == mx.uint32 and p.nbytes <= 8 for p in pieces)
    assert [v for p in pieces for v in p.tolist()] == values.tolist()
    assert (len(pieces) == 1 and pieces[0] is values) == (n <= probe.POOL_INTS)  # few enough: no op more


def test_host_lists_read_ints_and_floats_back_with_their_values(uploading):
    ids = mx.array([5, 151_935, 0, 7, 9], dtype=mx.uint32)
    probs = mx.array([0.25, -0.0, 1e-30, float("inf")], dtype=mx.float32)  # * 1 keeps a negative zero's sign
    assert pooled.host_lists(ids, probs) == [ids.tolist(), probs.tolist()]
    assert str(pooled.host_lists(probs)[0][1]) == "-0.0"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chooser_picks_the_same_tokens_with_uploads_on(monkeypatch, temperature):
    """Sampled draws and the drafts' probabilities (and greedy argmaxes) read back through the pool."""
    from strata_cli.options import GenerateOptions
    from strata_cli.sampling import TokenChooser

    logits = mx.random.normal((5, 64), key=mx.random.key(3))
    inputs = [4, 17, 2, 60, 33]

    def choose():
        return TokenChooser(GenerateOptions(temperature=temperature, seed=7), prompt_length=2).choose(logits, 6, inputs)

    plain = choose()
    turn_uploads_on(monkeypatch)
    assert choose() == plain


def test_off_cuda_the_host_reads_the_array_itself():
    values = mx.arange(8)
    pieces = pooled.host_pieces(values)
    assert len(pieces) == 1 and pieces[0] is values


def test_dims_and_step_dims_keep_their_values_when_uploaded(uploading):
    kept = probe.dims(8, 2048, 512)
    assert kept.tolist() == [8, 2048, 512] and probe.dims(8, 2048, 512) is kept
    assert pooled.step_dims(1, 16, 2, 8, 517).tolist() == [1, 16, 2, 8, 517]
    assert pooled.step_dims(1, 16, 2, 8, 518).tolist() == [1, 16, 2, 8, 518]
    offset = pooled.step_dims(517, kind="offset")  # one value: padded past the pool, the sizes kept apart
    assert offset.tolist() == [517, 0, 0] and offset.nbytes > 8
    assert pooled.step_dims(517, kind="offset") is offset and pooled.step_dims(1, 16, 2, 8, 518).tolist()[-1] == 518


def test_kept_inputs_that_would_fit_the_pool_are_padded_past_it(uploading):
    """MLX keeps arrays of up to 8 bytes in its mapped pool, read over the bus at every launch:
    a kept input is padded with zeros past it (the bodies index their values)."""
    kept = probe.dims(8, 2048)
    assert kept.dtype == mx.int32 and kept.tolist() == [8, 2048, 0] and kept.nbytes > 8
    assert probe.dims(8, 2048) is kept
    eps = probe.constant(1e-6)
    assert eps.dtype == mx.float32 and eps.nbytes > 8 and eps.tolist()[1:] == [0.0, 0.0]
    assert eps[0].item() == np.float32(1e-6) and probe.constant(1e-6) is eps
    assert probe.dims(1, 2, 3, 4).tolist() == [1, 2, 3, 4]  # past the pool already


def test_off_cuda_kept_inputs_are_plain_arrays(monkeypatch):
    monkeypatch.setattr(probe, "_dims_cache", {})
    monkeypatch.setattr(probe, "_constants", {})
    assert probe.dims(8, 2048).tolist() == [8, 2048]
    assert probe.constant(0.5).tolist() == [0.5]


def test_dims_left_as_made_where_they_cannot_be_evaluated(uploading, monkeypatch):
    def refuse(*arrays):
        raise ValueError("an eval inside a trace")

    monkeypatch.setattr(mx, "eval", refuse)
    assert probe.dims(3, 4, 5).tolist() == [3, 4, 5]


def test_a_window_gives_the_same_logits_with_its_ids_uploaded(tiny_model, monkeypatch):
    plain_logits, plain_tokens = one_window(tiny_model)
    turn_uploads_on(monkeypatch)
    uploaded_logits, uploaded_tokens = one_window(tiny_model)
    assert uploaded_tokens == plain_tokens and np.array_equal(uploaded_logits, plain_logits)


def test_sampled_speculation_draws_the_same_tokens_with_uploads_on(monkeypatch):
    """A seeded sampled run with drafts (the window's ids, the draws and the drafts' probabilities
    through the pool) gives the tokens it gives with plain arrays."""
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.decode import DecodeStats, generate
    from strata_cli.options import GenerateOptions, SpecOptions

    model = random_model(tiny_qwen3_next_config(vocab_size=16), seed=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6]
    options = GenerateOptions(max_tokens=24, temperature=0.3, top_p=0.95, seed=1)

    def run():
        stats = DecodeStats()
        tokens = [t for s in generate(WindowEngine(model, EngineOptions()), prompt, options=options,
                                      spec=SpecOptions(max_drafts=3, min_match=3), eos_ids=(), stats=stats)
                  for t in s.tokens]
        return tokens, stats.summary()["drafts_offered"]

    plain, offered = run()
    turn_uploads_on(monkeypatch)
    assert run() == (plain, offered) and offered > 0

