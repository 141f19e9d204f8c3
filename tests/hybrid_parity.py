"""What tests/test_nemotron_h.py and tests/test_granite_hybrid.py check for each Mamba-2 hybrid,
in float32 on the CPU (the pattern of tests/test_parity.py):

- Hugging Face layout (as saved, and the in-memory fused tensors): every row's logits within
  1e-4 of transformers' over the whole prompt; greedy 32-token continuations equal to
  transformers' `generate`, serially, with 3 suffix drafts per window, with `auto`, and with
  scripted drafts of the reference's own tokens, some of them wrong (so windows keep and
  reject rows at every place: random models seldom repeat their prompt);
- MLX layout (what mlx-lm's converter writes, unquantized and 4-bit): logits and greedy tokens
  against mlx-lm loading the same files;
- seeded sampling: the same tokens with 0, 3 and auto drafts.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import torch

from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.options import GenerateOptions, SpecOptions
from strata_cli.speculative.suffix_drafter import EMPTY_PROPOSAL, Proposal
from strata_cli.telemetry import DecodeStats

LOGIT_TOLERANCE = 1e-4
MIN_LOGIT_STD = 1.0  # the logits are far from flat, so a 1e-4 tolerance means something
NUM_TOKENS = 32
MODES = {"serial": SpecOptions(), "3": SpecOptions(max_drafts=3), "auto": SpecOptions(max_drafts=7, auto=True)}


def strata_logits(model, ids: list[int]) -> np.ndarray:
    """Every row's logits from one window over the whole prompt (the chunked SSD form)."""
    return np.array(WindowEngine(model).run(ids, 0).logits)


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(hf_model, ids: list[int]) -> list[int]:
    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NUM_TOKENS,
                                do_sample=False)
    return out[0, len(ids):].tolist()


class ScriptedDrafter:
    """Drafts the reference continuation, each token replaced by a wrong one with probability
    0.3: windows of every size keep and reject rows at every place."""

    def __init__(self, prompt_ids: list[int], reference: list[int], vocab_size: int):
        self.done, self.reference, self.vocab_size = len(prompt_ids), reference, vocab_size
        self.start = len(prompt_ids)
        self.rng = random.Random(len(prompt_ids))

    def propose(self, max_drafts: int) -> Proposal:
        at = self.done - self.start  # tokens emitted so far: the first draft is the next one
        right = self.reference[at : at + self.rng.randint(1, max_drafts)]
        tokens = tuple(t if self.rng.random() < 0.7 else (t + 1) % self.vocab_size for t in right)
        return Proposal(tokens, match_length=4, position=0) if tokens else EMPTY_PROPOSAL

    def extend(self, tokens) -> None:
        self.done += len(list(tokens))


def strata_tokens(model, ids: list[int], spec: SpecOptions, *, drafter=None, **options) -> tuple[list[int], dict]:
    stats = DecodeStats()
    steps = generate(WindowEngine(model), ids, options=GenerateOptions(max_tokens=NUM_TOKENS, **options),
                     spec=spec, eos_ids=frozenset(), stats=stats, drafter=drafter)
    return [t for step in steps for t in step.tokens], stats.summary()


def check_greedy(model, ids: list[int], reference: list[int]) -> None:
    """Serial, 3-draft, auto and scripted-draft greedy tokens all equal `reference`."""
    assert len(reference) == NUM_TOKENS
    for mode, spec in MODES.items():
        tokens, summary = strata_tokens(model, ids, spec)
        assert tokens == reference, mode
        if mode == "3":
            assert summary["drafts_offered"] > 0  # windows of T > 1 ran (the prompt ends in a repeat)
    drafter = ScriptedDrafter(ids, reference, model.config.vocab_size)
    tokens, summary = strata_tokens(model, ids, SpecOptions(max_drafts=7), drafter=drafter)
    assert tokens == reference, "scripted drafts"
    assert summary["drafts_kept"] > 0 and summary["drafts_kept"] < summary["drafts_offered"]


def check_logits(logits: np.ndarray, reference: np.ndarray, what: str) -> float:
    assert reference.std() >= MIN_LOGIT_STD, f"{what}: logits too flat ({reference.std():.2f})"
    diff = float(np.abs(logits - reference).max())
    assert diff <= LOGIT_TOLERANCE, f"{what}: max abs logit diff {diff:.2e} over {len(logits)} tokens"
    return diff


def mlx_lm_reference(path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """mlx-lm's logits over `ids` and its greedy continuation, loading `path` itself."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(path))
    logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=NUM_TOKENS)]
    return logits, tokens


def check_seeded_sampling(model, ids: list[int]) -> None:
    """A seeded sampled run prints the same tokens with 0, 3 and auto drafts."""
    runs = [strata_tokens(model, ids, spec, temperature=0.8, seed=7)[0] for spec in MODES.values()]
    assert runs[0] == runs[1] == runs[2]
