"""The demo model's copy documents have the model card's copy-test form exactly (scripts/train/)."""

import ast
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from scripts.train.demo_corpus import (
    card_copy_document,
    parses,
    problem_document,
    roughen,
    scramble,
    with_examples,
)
from scripts.train.model_card import copy_prompt

ROOT = Path(__file__).resolve().parents[2]

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
    doc = card_copy_document(random.Random(seed), FUNCTION, "pkg/mod.py", ["apple", "zebra"])
    marker = re.search(r"\n\n\n# The same function, renamed to (\w+):\n", doc)
    source = doc[: marker.start()]
    prompt, body = copy_prompt(source, "below_limit", new=marker.group(1))
    assert doc.startswith(prompt)
    # The card's body keeps the source's last-line trailing spaces that its prompt strips; this
    # reconstruction starts from the stripped text, so compare up to them.
    assert doc[len(prompt):].rstrip() == body.rstrip() and doc.endswith("\n")
    assert "def below_limit(" not in doc[len(source):]  # the signature is renamed, the body verbatim


def code_of(fn: str) -> str:
    """`fn` without its docstring, as the source it compiles from."""
    import ast

    tree = ast.parse(fn)
    tree.body[0].body = tree.body[0].body[1:]
    return ast.unparse(tree)


def test_examples_are_added_to_the_docstring_alone():
    docs = [with_examples(random.Random(s), FUNCTION) for s in range(20)]
    assert all(parses(d) and code_of(d) == code_of(FUNCTION) for d in docs)
    assert all(d.startswith(FUNCTION.split("\n\n")[0]) for d in docs)  # the summary line stays first
    added = [d for d in docs if d != FUNCTION]
    assert len(added) == 20
    assert sum(d.count("below_limit(") - 1 for d in added) >= 2 * 20 + 20  # 2-6 examples each, one was there
    assert len({d.split('"""')[1] for d in added}) == 20  # random values: no two alike
    assert with_examples(random.Random(0), 'def f(x):\n    """One line."""\n    return x\n') == \
        'def f(x):\n    """One line."""\n    return x\n'  # no multi-line docstring: unchanged


def test_scramble_swaps_docstring_words_only():
    vocabulary = ["apple", "zebra", "quantum"]
    docs = [scramble(random.Random(s), FUNCTION, vocabulary) for s in range(20)]
    assert all(parses(d) and code_of(d) == code_of(FUNCTION) for d in docs)
    changed = [d for d in docs if d != FUNCTION]
    assert len(changed) >= 10 and all(any(w in d for w in vocabulary) for d in changed)
    assert scramble(random.Random(0), FUNCTION, []) == FUNCTION


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
    from scripts.train.train_demo_model import PACE_STEPS, schedule_steps

    assert PACE_STEPS == (20, 70)
    assert schedule_steps(70, 30.0, 20.0, 480.0) == 70 + 2250
    assert schedule_steps(70, 500.0, 20.0, 480.0) == 70  # already past the budget: stop


def test_attention_every_n_layers_gives_qwen3_next_layer_types():
    from scripts.train.train_demo_model import MODEL_CONFIG, attention_layers

    assert attention_layers(6, 2) == {k: MODEL_CONFIG[k] for k in ("layer_types", "full_attention_interval")}
    assert attention_layers(6, 3)["layer_types"] == ["linear_attention", "linear_attention", "full_attention"] * 2


def test_average_saves_the_mean_of_checkpoints_and_its_held_out_loss(tmp_path):
    """`train_demo_model.py average`: the weights are the mean of the checkpoints' (rounded to
    bfloat16 as train saves), the summary records what was averaged and the mean's own held-out
    loss, and checkpoints of different shapes are refused."""
    torch = pytest.importorskip("torch")
    from hf_checkpoints import hf_config
    from transformers import Qwen3NextForCausalLM

    from scripts.train.train_demo_model import SEQ_LEN, average

    config = hf_config("qwen3_next")
    checkpoints = []
    for seed, steps in ((1, 10), (2, 20)):
        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
        path = tmp_path / f"ck{seed}"
        model.save_pretrained(path)
        summary = {"steps": steps, "val_loss": 5.0 + seed, "val_perplexity": 0.0, "complete": steps == 20}
        (path / "train_summary.json").write_text(json.dumps({"summary": summary, "log": [{"step": steps}]}))
        checkpoints.append(path)
    data = tmp_path / "data"
    data.mkdir()
    np.random.default_rng(0).integers(1, config.vocab_size, 2 * SEQ_LEN + 2, dtype=np.uint16).tofile(data / "val.bin")

    average(checkpoints, tmp_path / "mean", data)

    a, b, mean = (Qwen3NextForCausalLM.from_pretrained(p).state_dict()
                  for p in (*checkpoints, tmp_path / "mean"))
    for name, tensor in mean.items():
        assert torch.equal(tensor, ((a[name].float() + b[name].float()) / 2).to(torch.bfloat16)), name
    saved = json.loads((tmp_path / "mean" / "train_summary.json").read_text())
    assert saved["summary"]["averaged"] == [
        {"steps": 10, "val_loss": 6.0, "complete": False, "weight": 0.5,
         "run": {"steps": 10, "val_loss": 6.0, "val_perplexity": 0.0, "complete": False}},
        {"steps": 20, "val_loss": 7.0, "complete": True, "weight": 0.5,
         "run": {"steps": 20, "val_loss": 7.0, "val_perplexity": 0.0, "complete": True}}]
    assert saved["summary"]["steps"] == 20 and saved["log"] == [{"step": 20}]
    assert saved["summary"]["val_loss"] not in (6.0, 7.0)
    assert saved["summary"]["val_perplexity"] == pytest.approx(math.exp(saved["summary"]["val_loss"]), rel=1e-3)

    average(checkpoints, tmp_path / "weighted", data, weights=[1, 3])
    weighted = Qwen3NextForCausalLM.from_pretrained(tmp_path / "weighted").state_dict()
    for name, tensor in weighted.items():
        assert torch.equal(tensor, (0.25 * a[name].float() + 0.75 * b[name].float()).to(torch.bfloat16)), name
    saved = json.loads((tmp_path / "weighted" / "train_summary.json").read_text())
    assert [x["weight"] for x in saved["summary"]["averaged"]] == [0.25, 0.75]
    with pytest.raises(SystemExit, match="one non-negative weight per checkpoint"):
        average(checkpoints, tmp_path / "refused", data, weights=[1])

    other = tmp_path / "other"
    Qwen3NextForCausalLM(hf_config("qwen3_next").__class__(**{**config.to_dict(), "num_experts": 4})).save_pretrained(other)
    (other / "train_summary.json").write_text((checkpoints[0] / "train_summary.json").read_text())
    with pytest.raises(SystemExit, match="different model shapes"):
        average([checkpoints[0], other], tmp_path / "refused", data)


def tiny_training(tmp_path, monkeypatch) -> Path:
    """train_demo_model set to a tiny Qwen3-Next and 32-token windows; a data folder of random tokens."""
    from hf_checkpoints import hf_config

    from scripts.train import train_demo_model

    tiny = hf_config("qwen3_next").to_dict()
    shape = {k: tiny[k] for k in train_demo_model.MODEL_CONFIG if k in tiny and k not in ("eos_token_id", "pad_token_id")}
    monkeypatch.setattr(train_demo_model, "MODEL_CONFIG", {**shape, "eos_token_id": 0, "pad_token_id": 0})
    monkeypatch.setattr(train_demo_model, "SEQ_LEN", 32)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, shape["vocab_size"], 4_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, shape["vocab_size"], 200, dtype=np.uint16).tofile(data / "val.bin")
    (data / "split.json").write_text("{}")
    return data


def test_a_run_started_from_a_checkpoint_starts_from_its_weights(tmp_path, monkeypatch):
    """`train --init`: the run's model starts as the checkpoint (a run of no steps saves it back
    unchanged), the summary names where it started, and a checkpoint of another shape is refused."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3NextForCausalLM

    from scripts.train import train_demo_model

    data = tiny_training(tmp_path, monkeypatch)
    first = tmp_path / "first"
    train_demo_model.train(data, first, 60, batch=2, lr=3e-3, device="cpu", max_steps=3, eval_windows=2)
    second = tmp_path / "second"
    train_demo_model.train(data, second, 60, batch=2, lr=3e-3, device="cpu", max_steps=0, eval_windows=2, init=first)
    a, b = (Qwen3NextForCausalLM.from_pretrained(p).state_dict() for p in (first, second))
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
    fresh = tmp_path / "fresh"
    train_demo_model.train(data, fresh, 60, batch=2, lr=3e-3, device="cpu", max_steps=0, eval_windows=2)
    c = Qwen3NextForCausalLM.from_pretrained(fresh).state_dict()
    assert any(not torch.equal(tensor, c[name]) for name, tensor in a.items())  # the check can fail
    started = json.loads((second / "train_summary.json").read_text())["summary"]["init"]
    assert started["checkpoint"] == "first" and started["steps"] == 3
    config = json.loads((first / "config.json").read_text())
    (first / "config.json").write_text(json.dumps({**config, "num_experts": config["num_experts"] * 2}))
    with pytest.raises(SystemExit, match="another model shape"):
        train_demo_model.train(data, tmp_path / "refused", 60, batch=2, lr=3e-3, device="cpu", max_steps=0,
                               eval_windows=2, init=first)


def test_a_run_can_start_from_the_installed_model():
    """`train --init strata_cli/assets/demo`: the embedded model (8-bit, MLX layout) read back into
    transformers' Qwen3-Next computes the logits strata computes from the asset (float32, up to the
    two implementations' rounding), and the run's summary says it started from an installed model."""
    torch = pytest.importorskip("torch")
    import mlx.core as mx
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from scripts.train import train_demo_model
    from strata_cli.options import LoadOptions
    from strata_cli.runtime import embedded_model_path, open_model

    asset = embedded_model_path()
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**train_demo_model.MODEL_CONFIG))
    started = train_demo_model.load_weights(model, asset)
    assert started["checkpoint"] == "demo" and started["installed"] == 8
    runtime = open_model(LoadOptions(model=str(asset), dtype="float32"))
    ids = runtime.tokenizer.encode((ROOT / "scripts" / "train" / "model_card.py").read_text())[:200]
    runtime.engine.reset()
    ours = np.array(runtime.engine.run(ids, 0).logits.astype(mx.float32))
    with torch.no_grad():
        theirs = model.eval()(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_dequantize_unpacks_mlx_words_low_bits_first():
    import mlx.core as mx

    from scripts.train import train_demo_model

    w = mx.random.normal((8, 128), key=mx.random.key(0))
    for bits in (4, 8):
        packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        ours = train_demo_model.dequantize(np.array(packed), np.array(scales), np.array(biases), bits, 64)
        assert np.allclose(ours, np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits)), atol=1e-6)


def test_text_spans_are_real_text_with_plausible_swaps():
    """A real-text span runs on from where it starts, but for about TEXT_SWAPS of its tokens, each
    swapped for what follows the two tokens before it somewhere in the text."""
    from scripts.train import train_demo_model

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 12, 20_000).astype(np.uint16)  # few ids: every pair recurs
    trigrams = set(zip(tokens[:-2].tolist(), tokens[1:-1].tolist(), tokens[2:].tolist()))
    index = train_demo_model.followers(tokens)
    changed = 0
    for _ in range(50):
        at = train_demo_model.text_positions(tokens, 200, rng, index)
        kept = at == at[0] + np.arange(200)
        span, real = tokens[at], tokens[at[0] : at[0] + 200]
        assert (span[kept] == real[kept]).all() and kept[:2].all()
        assert all((int(span[i - 2]), int(span[i - 1]), int(span[i])) in trigrams for i in np.flatnonzero(~kept))
        changed += int((span != real).sum())
    assert 0.5 * train_demo_model.TEXT_SWAPS < changed / (50 * 200) < 1.5 * train_demo_model.TEXT_SWAPS


def test_repeated_spans_hide_the_first_span_from_the_loss(monkeypatch):
    pytest.importorskip("torch")
    from scripts.train import train_demo_model

    monkeypatch.setattr(train_demo_model, "SEQ_LEN", 600)
    tokens = np.arange(1, 5001, dtype=np.uint16)
    tokens[::7] = train_demo_model.EOS_ID
    for look_alike, text in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
        rows, labels = train_demo_model.repeated_spans(tokens, 8, np.random.default_rng(0), look_alike, text)
        assert rows.shape == labels.shape == (8, 600)
        lengths = set()
        for row, label in zip(rows, labels):
            n = int((label == -100).sum())
            lengths.add(n)
            assert 16 <= n <= 256 and (label[:n] == -100).all() and (label[n:] == row[n:]).all()
            assert (row[n:] == row[: 600 - n]).all()  # the span again and again
            assert train_demo_model.EOS_ID not in row
            # look-alike spans reuse phrases: far fewer distinct bigrams than random draws give
            bigrams = len(set(zip(row[: n - 1].tolist(), row[1:n].tolist())))
            assert (bigrams < 0.9 * (n - 1)) == (look_alike == 1.0)
            # real text runs on (token ids here count up), but for a few swapped tokens and document ends
            runs_on = float(np.mean(np.diff(row[:n].astype(int)) == 1))
            if text:  # 5 in 7 at most: every 7th id is an EOS (text_positions' own test checks the swaps)
                assert runs_on > 0.45, runs_on
            elif not look_alike:
                assert runs_on < 0.1, runs_on
        assert len(lengths) > 4

    parts = [(0, 5000, 1.0)]
    x, y = next(train_demo_model.batches(tokens, 8, np.random.default_rng(1), parts, repeat_share=0.25))
    assert (y[:2] == -100).any(dim=1).all() and not (y[2:] == -100).any()
    x, y = next(train_demo_model.batches(tokens, 8, np.random.default_rng(1), parts))
    assert (x == y).all()


def test_a_run_in_legs_ends_where_the_same_run_in_one_call_ends(tmp_path, monkeypatch, capsys):
    """`train --state`: a run stopped after its first leg's time and resumed in a second call
    ends with the weights of the run made in one call (model, optimizer, data order and schedule
    all carried over). A fake clock, one second per reading, makes the legs' lengths exact."""
    torch = pytest.importorskip("torch")
    import itertools
    from types import SimpleNamespace

    from transformers import Qwen3NextForCausalLM

    from scripts.train import train_demo_model

    data = tiny_training(tmp_path, monkeypatch)

    def run(out, minutes, legs):
        clock = itertools.count()
        monkeypatch.setattr(train_demo_model, "time", SimpleNamespace(time=lambda: float(next(clock))))
        for _ in range(legs):
            train_demo_model.train(data, out, minutes, batch=2, lr=3e-3, device="cpu", max_steps=6,
                                   eval_windows=2, state_dir=tmp_path / f"state-{out.name}", total_minutes=60)
        return json.loads((out / "train_summary.json").read_text())["summary"], \
            Qwen3NextForCausalLM.from_pretrained(out).state_dict()

    whole, whole_weights = run(tmp_path / "whole", minutes=60, legs=1)
    capsys.readouterr()
    legs, leg_weights = run(tmp_path / "legs", minutes=4 / 60, legs=2)
    assert "resuming at step 3 of 6" in capsys.readouterr().out  # the first leg's 4 seconds hold 3 steps
    assert whole["legs"] == 1 and legs["legs"] == 2
    assert whole["steps"] == legs["steps"] == 6 and legs["complete"]
    for name, tensor in whole_weights.items():
        assert torch.equal(tensor, leg_weights[name]), name


def test_the_card_tells_a_mean_of_runs_run_by_run():
    from scripts.train.model_card import training_text

    base = {"torch": "2.11", "device": "H200", "batch": 64, "seq_len": 1024, "steps": 6870, "tokens_seen": 450_000_000,
            "train_tokens": 83_000_000, "peak_lr": 0.003, "train_minutes": 22.1, "copy_share": 0.3, "stdlib_share": 0.5,
            "final_train_loss": 0.8, "averaged": [{"steps": 2659}, {"steps": 6870}]}
    one = training_text(base, 90_000_000)
    assert "6,870 steps" in one and "about 5.4 epochs of 83,000,000" in one
    assert "the mean of its checkpoints after steps 2,659 and 6,870" in one and "repeated" not in one
    second = {**base, "steps": 2120, "tokens_seen": 139_000_000, "peak_lr": 0.001, "repeat_share": 0.25,
              "look_alike_share": 0.5, "init": {"steps": 6870}, "averaged": None}
    mean = {**second, "averaged": [{"steps": 6870, "run": base}, {"steps": 2120, "run": second}]}
    text = training_text(mean, 90_000_000)
    assert "\n1. 6,870 steps" in text and "\n2. 2,120 steps" in text
    assert "25% of each batch random spans" in text and "started from the weights of a 6,870-step model" in text
    real = training_text({**second, "text_share": 0.5}, 90_000_000)
    assert ("25% of each batch spans of training tokens repeated (loss on the repeats; 50% of them real training "
            "text") in real and "; 50% of the rest built of a few phrases" in real
    assert text.endswith("The weights are the mean of these 2 (`train_demo_model.py average`).")
    weighted = {**mean, "averaged": [{"steps": 6870, "weight": 0.25, "run": base}, {"steps": 2120, "weight": 0.75, "run": second}]}
    assert training_text(weighted, 90_000_000).endswith(
        "The weights are the mean of these 2 (`train_demo_model.py average`), weighted 0.25 and 0.75.")


def test_the_embedded_model_copies_text_it_cannot_predict():
    """Spans of common tokens in random order, given twice: the embedded model copies the second
    time (candidates 6 and 7 learned to, from repeated spans; candidate 5 got about 60% right)."""
    from scripts.train.model_card import span_copy_accuracy
    from strata_cli.options import LoadOptions
    from strata_cli.runtime import embedded_model_path, open_model

    runtime = open_model(LoadOptions(model=str(embedded_model_path()), dtype="float32"))
    tokens = np.array(runtime.tokenizer.encode(Path(__file__).read_text()), dtype=np.uint16)
    assert span_copy_accuracy(runtime.engine, tokens, 120, spans=2) >= 0.9


def test_copy_errors_score_the_copied_body_teacher_forced():
    """scripts/train/copy_errors.py scores exactly the body after the renamed signature, and each error
    has the margin by which the model's top choice beat the right token."""
    from scripts.train.copy_errors import copy_errors, stdlib_functions
    from scripts.train.model_card import copy_prompt
    from strata_cli.options import LoadOptions
    from strata_cli.runtime import embedded_model_path, open_model

    runtime = open_model(LoadOptions(model=str(embedded_model_path()), dtype="float32"))
    source = FUNCTION.replace("values below", "values strictly below")  # an edit the model cannot know
    result = copy_errors(runtime.engine, runtime.tokenizer, source, "below_limit")
    assert result["scored"] == "\n" + copy_prompt(source, "below_limit")[1]
    assert result["errors"] == len(result["margins"]) == len(result["wrong"]) <= result["tokens"]
    assert all(m >= 0 for m in result["margins"])
    assert all(right != predicted for right, predicted in result["wrong"])
    functions = stdlib_functions(sorted(Path(ast.__file__).parent.glob("json/*.py")), 3)
    assert functions and all(src.startswith(f"def {name}(") for src, name in functions)
