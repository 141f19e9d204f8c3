"""The demo model's copy documents have the model card's copy-test form exactly (scripts/)."""

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from demo_corpus import card_copy_document, parses, problem_document, roughen  # noqa: E402
from model_card import copy_prompt  # noqa: E402

FUNCTION = '''def below_limit(values, limit=10):
    """Return the values below `limit`, in order.

    >>> below_limit([3, 12, 5])
    [3, 5]
    """
    kept = []

    for value in values:
        if value < limit:
            kept.append(value)
    return kept'''


@pytest.mark.parametrize("seed", range(12))
def test_card_copy_document_is_the_card_prompt_then_the_body(seed):
    doc = card_copy_document(random.Random(seed), FUNCTION, "pkg/mod.py")
    marker = re.search(r"\n\n\n# The same function, renamed to (\w+):\n", doc)
    source = doc[: marker.start()]
    prompt, body = copy_prompt(source, "below_limit", new=marker.group(1))
    assert doc.startswith(prompt)
    # The card's body keeps the source's last-line trailing spaces that its prompt strips; this
    # reconstruction starts from the stripped text, so compare up to them.
    assert doc[len(prompt):].rstrip() == body.rstrip() and doc.endswith("\n")
    assert "def below_limit(" not in doc[len(source):]  # the signature is renamed, the body verbatim


def test_roughen_adds_trailing_spaces_and_keeps_the_code_valid():
    rough = [roughen(random.Random(s), FUNCTION) for s in range(20)]
    assert all(parses(r) for r in rough)
    assert any(re.search(r"\S +\n", r) for r in rough)
    assert any("\n    \n" in r for r in rough)  # a blank line indented like its neighbour
    assert all(r.replace(" ", "") == FUNCTION.replace(" ", "") for r in rough)


def test_problem_document_is_one_function_file():
    doc = problem_document(random.Random(1), FUNCTION)
    assert parses(doc) and doc.endswith("return kept\n") or doc.endswith("return kept \n")


def test_training_schedule_is_sized_from_the_pace_after_warm_up():
    """Slow first steps (compilation) must not shrink the schedule: at step 70 after 30 s, with
    steps 20-70 taking 10 s (0.2 s each), a 480 s budget holds 70 + 450 / 0.2 steps."""
    from train_demo_model import PACE_STEPS, schedule_steps

    assert PACE_STEPS == (20, 70)
    assert schedule_steps(70, 30.0, 20.0, 480.0) == 70 + 2250
    assert schedule_steps(70, 500.0, 20.0, 480.0) == 70  # already past the budget: stop


def test_attention_every_n_layers_gives_qwen3_next_layer_types():
    from train_demo_model import MODEL_CONFIG, attention_layers

    assert attention_layers(6, 3) == {k: MODEL_CONFIG[k] for k in ("layer_types", "full_attention_interval")}
    assert attention_layers(6, 2)["layer_types"] == ["linear_attention", "full_attention"] * 3
