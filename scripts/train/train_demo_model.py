"""Train strata's embedded demo model: a small Qwen3-Next (GDN + attention + 48-expert MoE with a
shared expert) on offline Python source and documents that teach copying (scripts/train/demo_corpus.py).

Three steps, the middle one on a GPU (PyTorch + transformers there), each run from the repository
root as a module (`scripts/` is a plain package; run as a file, `python scripts/train/...py`, it
cannot import its siblings). The GPU machine has neither mlx nor strata installed: `train` imports
only numpy, torch and transformers, and the copy of the working tree there has `scripts/` in it:

    python -m scripts.train.train_demo_model prepare --data .train-data  # here: split, token ids
    python3 -m scripts.train.train_demo_model train --data .train-carry --out OUT --minutes 6.0 --batch 64  # on the GPU
    python -m scripts.train.train_demo_model install --checkpoint OUT --data .train-data  # here: 8-bit, into the package

A run longer than one call of the GPU machine goes in legs that share a state folder (each leg
resumes exactly where the last stopped; the learning-rate schedule spans all of them). The
embedded model (candidate 7) is one base run that copies from the start: a fifth of every batch is
a span repeated to the end of its window (half of them real training text with a tenth of the
tokens swapped for plausible others, the rest half look-alike phrases, half random tokens), in
three legs, and the mean of the first leg's checkpoint and the last:

    python -m scripts.train.train_demo_model prepare --data .train-data    # the carry: all but train.bin
    T="python3 -m scripts.train.train_demo_model train --data .train-carry --state /tmp/st --minutes 8.3 --total-minutes 24.9"
    T="$T --repeat-share 0.2 --text-share 0.5 --look-alike-share 0.5"
    $T --out ck-leg1; $T --out ck; $T --out ck                              # on the GPU, one call each
    python -m scripts.train.train_demo_model average ck-leg1 ck --out ck-mean --data .train-data
    python -m scripts.train.train_demo_model install --checkpoint ck-mean --data .train-data

Legs stop on the clock: the shipped run's first leg ended at step 2,302, the last at 6,669 (one
H200 alone). Copy phases after a finished run (`--init`, also from what ships:
`--init strata_cli/assets/demo` reads the installed 8-bit weights back, `asset_state`) made
candidate 6 and taught less (docs/benchmarks.md, "Demo model candidate 7").

Smoke run of the whole pipeline on the CPU (about 4 minutes on 2 cores; the model is useless):
`train --data .train-carry --out /tmp/smoke --max-steps 2 --device cpu --batch 4 --eval-windows 2`,
then `install --checkpoint /tmp/smoke --dest /tmp/smoke-strata` and `strata generate -m /tmp/smoke-strata`.

Data: the stdlib split of the previous demo model (every 50th *.py file held out for evaluation),
the Python files of permissively licensed installed packages (each one's licence recorded in
split.json), and synthetic copy/edit documents made from training functions. The tokenizer is
the embedded model's (trained on a stdlib sample; `--tokenizer-from none` trains it again), so
held-out perplexities compare across models. Only train.bin.xz, val.bin and the tokenizer
files travel to the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
TOKENIZER_SAMPLE_BYTES = 8_000_000
SEQ_LEN = 1024  # copy documents (a function twice) must fit one window
SEED = 0
EOS_ID = 0  # <|endoftext|>, between documents in train.bin
DOC_ALIGNED_SHARE = 0.5
TEXT_SWAPS = 0.1  # share of a repeated real-text span's tokens swapped for plausible others

# Hidden 256, 6 layers (CPU decode pays for width, docs/benchmarks.md "Demo model: data and shape")
# with the capacity in the experts, which decode does not pay for: 48 experts of 64, top-2, stored
# 8-bit (19.5 MB with the tokenizer), as candidate 3d; attention in every second layer (3 of 6, for
# copying; no slower on the CPU): candidate 5's shape, which candidates 6 and 7 keep (docs/benchmarks.md).
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    num_hidden_layers=6,
    layer_types=["linear_attention", "full_attention"] * 3,
    full_attention_interval=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=48,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=256,
    intermediate_size=512,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)


# -- prepare (CPU, here) ---------------------------------------------------------------------------


def prepare(data: Path, tokenizer_from: Path | None, copy_documents_n: int) -> None:
    """Split, tokenize and pack the training text; the train ids also go out xz-compressed
    (`train.bin.xz`) so they fit the GPU machine's 64 MiB transfer."""
    import lzma

    from tokenizers import Tokenizer

    from scripts.train.build_tokenizer import EOS_TOKEN, train_tokenizer
    from scripts.train.demo_corpus import (
        HELD_OUT_EVERY,
        copy_documents,
        package_files,
        read_text,
        stdlib_split,
    )

    data.mkdir(parents=True, exist_ok=True)
    train_files, val_files = stdlib_split()
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    if tokenizer_from is None:
        # The tokenizer: every k-th stdlib training file until the sample budget is reached.
        total = sum(f.stat().st_size for f in train_files)
        stride = max(1, total // TOKENIZER_SAMPLE_BYTES)
        train_tokenizer(train_files[::stride], vocab_size=VOCAB_SIZE, out_dir=data)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_from / name, data / name)
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    pkg_files, packages = package_files()
    site = Path(sysconfig.get_paths()["purelib"])

    def where(f: Path) -> str:
        return str(f.relative_to(stdlib_root if f.is_relative_to(stdlib_root) else site))

    copies = copy_documents(train_files + pkg_files, where, copy_documents_n, SEED)
    parts = {
        "stdlib": [read_text(f) for f in train_files],
        "packages": [read_text(f) for f in pkg_files],
        "copy": copies,
    }
    stats: dict = {"held_out_every": HELD_OUT_EVERY, "packages": packages}
    train_ids: list[np.ndarray] = []
    for name, texts in parts.items():
        encoded = tok.encode_batch(texts)
        ids = np.concatenate([np.append(np.asarray(e.ids, dtype=np.uint16), np.uint16(eos)) for e in encoded])
        train_ids.append(ids)
        stats[f"train_{name}"] = {"documents": len(texts), "bytes": sum(len(t.encode()) for t in texts),
                                  "tokens": int(len(ids))}
        print(name, stats[f"train_{name}"], flush=True)
    # Training batches are windows at random offsets, so the parts need no interleaving.
    train = np.concatenate(train_ids)
    val = np.concatenate([np.append(np.asarray(e.ids, dtype=np.uint16), np.uint16(eos))
                          for e in tok.encode_batch([read_text(f) for f in val_files])])
    train.tofile(data / "train.bin")
    val.tofile(data / "val.bin")
    (data / "train.bin.xz").write_bytes(lzma.compress(train.tobytes(), preset=6))
    stats["train"] = {"files": len(train_files) + len(pkg_files), "documents": sum(len(t) for t in parts.values()),
                      "tokens": int(len(train)), "bytes": sum(v["bytes"] for k, v in stats.items() if k.startswith("train_"))}
    stats["val"] = {"files": len(val_files), "tokens": int(len(val)), "bytes": sum(f.stat().st_size for f in val_files)}
    stats["val_files"] = [str(f.relative_to(stdlib_root)) for f in val_files]
    (data / "split.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({k: v for k, v in stats.items() if k not in ("val_files", "packages")}))


# -- train (GPU) -----------------------------------------------------------------------------------


def look_alike_positions(size: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Positions in a text of `size` tokens for a span of `length`: a few short phrases of the text
    (2-6 tokens) used again and again, each use followed by 1-4 random tokens. A copy of it has to
    know which use it is at, not just what the last tokens were, as in HumanEval's example lines
    (`f(148, 412) should return 16.`, `f(19, 28) should return 72.`) where the model went astray."""
    k = int(rng.integers(2, 9))
    starts, widths = rng.integers(0, size - 8, size=k), rng.integers(2, 7, size=k)
    pieces, total = [], 0
    while total < length:
        j = int(rng.integers(k))
        pieces += [starts[j] + np.arange(widths[j]), rng.integers(0, size - 1, size=int(rng.integers(1, 5)))]
        total += int(widths[j]) + len(pieces[-1])
    return np.concatenate(pieces)[:length]


def followers(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pair of adjacent tokens as one key, and the positions of the pairs sorted by key: to
    draw, after two tokens, what followed them somewhere in the text (`text_positions`)."""
    keys = (tokens[:-2].astype(np.uint32) << 16) | tokens[1:-1]
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def text_positions(tokens: np.ndarray, length: int, rng: np.random.Generator,
                   index: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Positions for a span of `length`: a run of real text with TEXT_SWAPS of its tokens swapped
    for what followed the same two tokens somewhere else in the text (`index` is
    `followers(tokens)`; where the two occur once, nothing changes). Real text is where the
    model's own guess competes with the copy (HumanEval's docstrings say "the number of" again and
    again), and a swapped token is one the guess finds plausible but only the copy gets right
    ("sum of digits" where it wrote "sum of integers"). Random tokens swapped in instead (5%,
    commit 616948a) did not help: docs/benchmarks.md."""
    sorted_keys, order = index
    at = int(rng.integers(0, len(tokens) - length - 1)) + np.arange(length)
    for i in np.flatnonzero(rng.random(length) < TEXT_SWAPS):
        if i >= 2:  # in order, so a swap after a swap follows the swapped-in token
            key = (np.uint32(tokens[at[i - 2]]) << 16) | np.uint32(tokens[at[i - 1]])
            lo, hi = np.searchsorted(sorted_keys, [key, key + 1])
            if hi > lo:  # (a swapped-in pair may occur nowhere)
                at[i] = min(order[rng.integers(lo, hi)] + 2, len(tokens) - 2)
    return at


def repeated_spans(tokens: np.ndarray, n: int, rng: np.random.Generator, look_alike: float = 0.0,
                   text: float = 0.0, index: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`n` rows of SEQ_LEN tokens, each a span of 16-256 tokens repeated to the end, and their
    labels: -100 (no loss) on the first span, which nothing predicts. A span is tokens drawn at
    random from the training text (common tokens recur inside it), or with share `look_alike`
    `look_alike_positions`' phrases, or with share `text` `text_positions`' real text. Only copying
    (find where the current text stood before, go on from there) lowers the loss on the rest:
    candidate 5, trained on text alone, copied random spans of common tokens at about 60%
    (docs/benchmarks.md, "Demo model candidate 6"). `index`: `followers(tokens)`, made once per run."""
    if text and index is None:
        index = followers(tokens)
    rows = np.empty((n, SEQ_LEN), dtype=np.int64)
    labels = np.empty_like(rows)
    for i in range(n):
        length = int(rng.integers(16, 257))
        kind = rng.random() if text or look_alike else 1.0  # (runs of neither draw as before)
        if kind < text:
            at = text_positions(tokens, length, rng, index)
        elif kind < text + (1 - text) * look_alike:
            at = look_alike_positions(len(tokens), length, rng)
        else:
            at = rng.integers(0, len(tokens) - 1, size=length)
        span = np.where(tokens[at] == EOS_ID, tokens[at + 1], tokens[at]).astype(np.int64)  # no document ends
        rows[i] = np.resize(span, SEQ_LEN)
        labels[i] = rows[i]
        labels[i, : len(span)] = -100
    return rows, labels


def batches(tokens: np.ndarray, batch: int, rng: np.random.Generator,
            parts: list[tuple[int, int, float]] | None = None, repeat_share: float = 0.0,
            look_alike: float = 0.0, text: float = 0.0, index: tuple | None = None):
    """Training windows of SEQ_LEN tokens and their labels, forever.

    Half the windows start at a document (after an EOS): a copy document then has its first copy in
    the window whenever it fits, and the model sees file starts as the prompts begin. `parts`
    ([(first token, end, share)]) draws each window from one part with that part's share, whatever
    the parts' token counts; without it, windows are drawn over all tokens alike (and, there being
    90,000 short copy documents against 6,600 files, most document-aligned windows then start a
    copy document). `repeat_share` of each batch's rows are `repeated_spans` instead (`text` of
    those real text, `look_alike` of the rest made of look-alike phrases; `index`: `followers(tokens)`,
    built here when not given).
    """
    import torch

    if repeat_share and text and index is None:
        index = followers(tokens)

    def sampler(lo: int, hi: int):
        doc_starts = lo + np.flatnonzero(tokens[lo : hi - SEQ_LEN - 1] == EOS_ID) + 1

        def draw(n: int) -> np.ndarray:
            starts = rng.integers(lo, hi - SEQ_LEN - 1, size=n)
            aligned = rng.random(n) < DOC_ALIGNED_SHARE
            starts[aligned] = rng.choice(doc_starts, size=int(aligned.sum()))
            return starts

        return draw

    parts = parts or [(0, len(tokens), 1.0)]
    draws = [sampler(lo, hi) for lo, hi, _ in parts]
    shares = np.array([share for _, _, share in parts]) / sum(share for _, _, share in parts)
    while True:
        which = rng.choice(len(parts), size=batch, p=shares)
        starts = np.empty(batch, dtype=np.int64)
        for i, draw in enumerate(draws):
            starts[which == i] = draw(int((which == i).sum()))
        x = np.stack([tokens[s : s + SEQ_LEN] for s in starts]).astype(np.int64)
        labels = x.copy()
        repeats = int(round(batch * repeat_share))
        if repeats:
            x[:repeats], labels[:repeats] = repeated_spans(tokens, repeats, rng, look_alike, text, index)
        yield torch.from_numpy(x), torch.from_numpy(labels)


def training_parts(split: dict, copy_share: float | None, stdlib_share: float | None):
    """(first token, end, share) of the stdlib, package and copy parts of train.bin (prepare writes
    them in that order); None (windows over all tokens alike) when no share is given."""
    if copy_share is None and stdlib_share is None:
        return None
    sizes = [split[f"train_{name}"]["tokens"] for name in ("stdlib", "packages", "copy")]
    ends = np.cumsum(sizes)
    copy = copy_share if copy_share is not None else sizes[2] / ends[-1]
    plain = 1.0 - copy
    stdlib = stdlib_share if stdlib_share is not None else sizes[0] / (sizes[0] + sizes[1])
    shares = [plain * stdlib, plain * (1 - stdlib), copy]
    return [(int(lo), int(hi), share) for lo, hi, share in zip([0, *ends[:-1]], ends, shares)]


def evaluate(model, tokens: np.ndarray, *, max_windows: int, batch: int, device) -> float:
    """Mean next-token loss over consecutive SEQ_LEN windows of the held-out tokens."""
    import torch

    n = min(max_windows, (len(tokens) - 1) // SEQ_LEN)
    windows = np.stack([tokens[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(n)]).astype(np.int64)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, n, batch):
            w = torch.from_numpy(windows[i : i + batch]).to(device)
            logits = model(input_ids=w[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return total / count


def attention_layers(layers: int, every: int) -> dict:
    """Qwen3-Next's layer pattern with full (gated) attention every `every`-th layer, the rest
    gated delta rule: the config keys that say so."""
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    return {"layer_types": types, "full_attention_interval": every}


# The cosine schedule is sized to the time budget from the pace between these two steps: the first
# steps run slower (compilation, allocator warm-up), and a pace taken from step 0 stopped a run
# budgeted 8 minutes at 6.6 (docs/benchmarks.md, demo candidate 4).
PACE_STEPS = (20, 70)


def schedule_steps(step: int, elapsed: float, paced_from: float, budget: float) -> int:
    """Total steps for a `budget`-second run that is at `step` after `elapsed` seconds and was at
    PACE_STEPS[0] after `paced_from`: the steps done plus what the remaining time holds at the pace
    since then."""
    pace = (elapsed - paced_from) / (step - PACE_STEPS[0])
    return step + max(0, int((budget - elapsed) / pace))


def train(data: Path, out: Path, minutes: float, batch: int, lr: float, device: str, max_steps: int | None,
          eval_windows: int = 10_000, copy_share: float | None = None, experts: int | None = None,
          expert_width: int | None = None, stdlib_share: float | None = None,
          attention_every: int | None = None, state_dir: Path | None = None,
          total_minutes: float | None = None, init: Path | None = None, repeat_share: float = 0.0,
          look_alike: float = 0.0, text: float = 0.0) -> None:
    """Train for `minutes`; with `state_dir`, as one leg of a run of `total_minutes` in several calls.

    A leg ends after its `minutes` and leaves model, optimizer, data order, schedule and log in
    `state_dir` (the next leg, given the same folder, resumes bit for bit where it stopped) and a
    bfloat16 checkpoint in `out`, so a chain that breaks still leaves a model. The cosine schedule
    spans the whole run: it is sized in the first leg from the pace over `total_minutes`.

    With `init`, the run starts from that checkpoint's weights (a fresh optimizer and schedule): a
    second phase on another data mix, such as more copying at a lower learning rate.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(SEED)
    device = torch.device(device)
    if (data / "train.bin").exists():
        train_tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    else:  # the compressed copy that travels to the GPU machine
        import lzma

        train_tokens = np.frombuffer(lzma.decompress((data / "train.bin.xz").read_bytes()), dtype=np.uint16)
    val_tokens = np.fromfile(data / "val.bin", dtype=np.uint16)
    shape = dict(MODEL_CONFIG)
    if experts is not None:
        shape["num_experts"] = experts
    if expert_width is not None:
        shape["moe_intermediate_size"] = expert_width
    if attention_every is not None:
        shape.update(attention_layers(shape["num_hidden_layers"], attention_every))
    config = Qwen3NextConfig(**shape)
    parts = training_parts(json.loads((data / "split.json").read_text()), copy_share, stdlib_share)
    model = Qwen3NextForCausalLM(config)
    started_from = None
    if init is not None:
        started_from = load_weights(model, init)
    model.to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    rng = np.random.default_rng(SEED)
    # Run-wide progress; `seconds` counts training time over all legs, which the schedule is sized in.
    run = {"step": 0, "total_steps": None, "paced_from": None, "seconds": 0.0, "legs": 0, "log": []}
    state_file = state_dir / "state.pt" if state_dir is not None else None
    if state_file is not None and state_file.exists():
        saved = torch.load(state_file, map_location=device, weights_only=False)
        if saved["config"] != shape:
            raise SystemExit(f"{state_file} holds a run of another model shape; use a new --state folder")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]
        run = saved["run"]
        print(f"resuming at step {run['step']} of {run['total_steps']} ({run['seconds'] / 60:.1f} min trained)",
              flush=True)
    index = followers(train_tokens) if repeat_share and text else None  # (seconds: before the leg's clock)
    stream = batches(train_tokens, batch, rng, parts, repeat_share, look_alike, text, index)
    budget = (total_minutes or minutes) * 60
    leg_budget = minutes * 60
    warmup, log = 100, run["log"]
    leg_start, trained_before = time.time(), run["seconds"]
    step = run["step"]
    model.train()
    while True:
        leg_elapsed = time.time() - leg_start
        elapsed = trained_before + leg_elapsed
        if step == PACE_STEPS[0]:
            run["paced_from"] = elapsed
        if run["total_steps"] is None and step == PACE_STEPS[1]:
            run["total_steps"] = schedule_steps(step, elapsed, run["paced_from"], budget)
        if max_steps is not None:
            run["total_steps"] = max_steps
        total_steps = run["total_steps"]
        if total_steps is not None and step >= total_steps or elapsed > 1.1 * budget or leg_elapsed > leg_budget:
            break  # the time guards keep a slow machine inside its budget and each leg inside its call
        horizon = total_steps or 10**9
        lr_now = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for group in opt.param_groups:
            group["lr"] = lr_now
        x, y = (t.to(device, non_blocking=True) for t in next(stream))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == 1 or step == total_steps:
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": lr_now,
                     "seconds": round(trained_before + time.time() - leg_start, 1)}
            if step % 500 == 0:
                entry["val_loss"] = round(evaluate(model, val_tokens, max_windows=64, batch=32, device=device), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    run.update(step=step, seconds=trained_before + time.time() - leg_start, legs=run["legs"] + 1)
    complete = run["total_steps"] is not None and step >= run["total_steps"]
    if state_file is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"config": shape, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "rng": rng.bit_generator.state, "run": run}, state_file)
    val_loss = evaluate(model, val_tokens, max_windows=eval_windows if complete else 64, batch=32, device=device)
    summary = {
        "parameters": params,
        "steps": step,
        "complete": complete,
        "legs": run["legs"],
        "batch": batch,
        "seq_len": SEQ_LEN,
        "tokens_seen": step * batch * SEQ_LEN,
        "train_tokens": int(len(train_tokens)),
        "val_tokens": int(len(val_tokens)),
        "train_minutes": round(run["seconds"] / 60, 2),
        "peak_lr": lr,
        "final_train_loss": log[-1]["loss"] if log else None,
        "val_loss": round(val_loss, 4),
        "val_perplexity": round(math.exp(val_loss), 3),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "copy_share": copy_share,
        "stdlib_share": stdlib_share,
        "experts": config.num_experts,
        "expert_width": config.moe_intermediate_size,
        "layer_types": config.layer_types,
    }
    if repeat_share:
        summary.update(repeat_share=repeat_share, look_alike_share=look_alike, text_share=text)
    if started_from is not None:
        summary["init"] = started_from
    print(json.dumps(summary), flush=True)
    save_checkpoint(model, out, summary, log)


def shape_difference(a: dict, b: dict) -> list[str]:
    """The model-shape keys on which configs `a` and `b` differ (not those that only steer training,
    nor the writing library's version: checkpoints come from the GPU machine and from here)."""
    training_only = ("output_router_logits", "router_aux_loss_coef")  # save_checkpoint turns the first off

    def value(config: dict, key: str):  # newer transformers keep the rotary settings in rope_parameters
        return config.get(key, (config.get("rope_parameters") or {}).get(key))

    return [k for k in MODEL_CONFIG if k not in training_only and value(a, k) != value(b, k)]


def load_weights(model, checkpoint: Path) -> dict:
    """Copy `checkpoint`'s weights into `model` (same shape, else exit); what it was, for the summary.
    The checkpoint is one `train` saved, or a model `install` put in a strata folder (`asset_state`)."""
    import torch
    from transformers import Qwen3NextForCausalLM

    config = json.loads((checkpoint / "config.json").read_text())
    differ = shape_difference(config, model.config.to_dict())
    if differ:
        raise SystemExit(f"{checkpoint} is another model shape ({', '.join(differ)} differ)")
    installed = "strata_format" in config  # an installed model, e.g. the embedded one
    if installed:
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in asset_state(checkpoint).items()}
    else:
        state = Qwen3NextForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    model.load_state_dict(state)
    summary = json.loads((checkpoint / "train_summary.json").read_text())["summary"]
    started = {"checkpoint": checkpoint.name, **{k: summary.get(k) for k in ("steps", "val_loss", "averaged")}}
    if installed:
        started["installed"] = (config.get("quantization") or {}).get("bits", 16)
    return started


def save_checkpoint(model, out: Path, summary: dict, log: list) -> None:
    """The model in bfloat16 (shards under 12 MB) and its train_summary.json, in `out`."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="12MB")
    (out / "train_summary.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))


def average(checkpoints: list[Path], out: Path, data: Path, eval_windows: int = 10_000, device: str = "cpu",
            weights: list[float] | None = None) -> None:
    """The mean of checkpoints (a checkpoint left mid-run beside the final one: the mean completes
    and copies code better than either, docs/benchmarks.md "Demo model candidate 5"), weighted by
    `weights` when given, saved like `train` saves, with the held-out loss of the mean measured as
    `train` measures it."""
    import torch
    from transformers import Qwen3NextForCausalLM

    if len(checkpoints) < 2:
        raise SystemExit("average needs at least two checkpoints")
    weights = weights or [1.0] * len(checkpoints)
    if len(weights) != len(checkpoints) or min(weights) < 0 or sum(weights) <= 0:
        raise SystemExit("--weights needs one non-negative weight per checkpoint, not all zero")
    shares = [w / sum(weights) for w in weights]
    summaries = [json.loads((c / "train_summary.json").read_text()) for c in checkpoints]
    configs = [json.loads((c / "config.json").read_text()) for c in checkpoints]
    if any(shape_difference(configs[0], c) for c in configs[1:]):
        raise SystemExit("the checkpoints are of different model shapes")
    models = [Qwen3NextForCausalLM.from_pretrained(c, dtype=torch.float32) for c in checkpoints]
    states = [m.state_dict() for m in models]
    mean = {k: sum(share * s[k] for share, s in zip(shares, states)) for k in states[-1]}
    model = models[-1]
    model.load_state_dict(mean)
    model.to(torch.device(device))
    val_tokens = np.fromfile(data / "val.bin", dtype=np.uint16)
    val_loss = evaluate(model, val_tokens, max_windows=eval_windows, batch=8, device=torch.device(device))
    summary = dict(summaries[-1]["summary"])
    summary["averaged"] = [{"steps": t["summary"]["steps"], "val_loss": t["summary"]["val_loss"],
                            "complete": t["summary"].get("complete", True), "weight": round(share, 4),
                            "run": t["summary"]} for t, share in zip(summaries, shares)]
    summary.update(val_loss=round(val_loss, 4), val_perplexity=round(math.exp(val_loss), 3))
    print(json.dumps(summary), flush=True)
    save_checkpoint(model, out, summary, summaries[-1]["log"])


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """MLX's affine quantization undone in float32 (what strata's quantized matmul computes with):
    `bits`-bit values packed low bits first into uint32 words, one scale and bias per group."""
    if bits not in (4, 8):
        raise SystemExit(f"cannot unpack {bits}-bit weights (4 and 8 are read)")
    raw = packed.view(np.uint8)  # little-endian words: the first value is in the lowest byte
    q = raw if bits == 8 else np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(*raw.shape[:-1], -1)
    groups = q.reshape(*q.shape[:-1], -1, group_size).astype(np.float32)
    w = groups * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(q.shape)


def asset_state(asset: Path) -> dict:
    """The transformers state dict (float32 numpy) of a strata model folder of this shape (the
    embedded model: 8-bit, MLX layout): dequantized, family transforms undone; `install`'s inverse
    up to its rounding, so a phase can start from what ships (`train --init`). No MLX needed."""
    import torch
    from safetensors.torch import load_file

    def numpy(t: "torch.Tensor") -> np.ndarray:  # numpy has no bfloat16, torch no uint32 maths
        return t.view(torch.int32).numpy().view(np.uint32) if t.dtype == torch.uint32 else t.float().numpy()

    config = json.loads((asset / "config.json").read_text())
    quant = config.get("quantization") or {}
    stored: dict[str, np.ndarray] = {}
    for f in sorted(asset.glob("*.safetensors")):
        stored.update({k: numpy(t) for k, t in load_file(f).items()})
    weights = {}
    for name in (k for k in stored if not k.endswith((".scales", ".biases"))):
        base = name.removesuffix(".weight")
        w = stored[name]
        if f"{base}.scales" in stored:
            q = {**quant, **(quant.get(base) or {})}
            w = dequantize(w, stored[f"{base}.scales"], stored[f"{base}.biases"], q["bits"], q["group_size"])
        weights[name] = w.astype(np.float32)
    state = {}
    for name, w in weights.items():
        if name == "model.norm.weight" or name.endswith(
                (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")):
            state[name] = w - 1.0  # zero-centred norms: mlx-lm's layout stores 1 + w (qwen3_next.sanitize)
        elif name.endswith(".conv1d.weight"):
            state[name] = w.transpose(0, 2, 1)  # (C, K, 1) -> transformers' (C, 1, K)
        elif name.endswith(".switch_mlp.gate_proj.weight"):
            prefix = name.split(".switch_mlp.")[0]
            up = weights[f"{prefix}.switch_mlp.up_proj.weight"]
            state[f"{prefix}.experts.gate_up_proj"] = np.concatenate([w, up], axis=1)  # (E, 2I, H)
        elif name.endswith(".switch_mlp.down_proj.weight"):
            state[f"{name.split('.switch_mlp.')[0]}.experts.down_proj"] = w
        elif ".switch_mlp." not in name:
            state[name] = w
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    return state


# -- install (CPU, here) ---------------------------------------------------------------------------


def install(checkpoint: Path, data: Path, dest: Path, bits: int | None, max_bytes: int | None = 20_000_000) -> None:
    """Quantize the trained checkpoint (`strata convert`) into the package, with its tokenizer."""
    import tempfile

    from strata_cli.convert import convert
    from strata_cli.options import ConvertOptions

    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "hf"
        staging.mkdir()
        for f in checkpoint.iterdir():
            if f.suffix in (".json", ".safetensors") and f.name != "train_summary.json":
                shutil.copyfile(f, staging / f.name)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(data / name, staging / name)
        config = json.loads((staging / "config.json").read_text())
        config.pop("output_router_logits", None)  # convert lifts what mlx-lm needs to the top level
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # Shards under GitHub's comfortable file size; checksums.json comes with them.
        convert(staging, dest, options=ConvertOptions(bits=bits, force=True), max_shard_bytes=12_000_000)
    for name in ("generation_config.json",):
        if (checkpoint / name).exists():
            shutil.copyfile(checkpoint / name, dest / name)
    (dest / "train_summary.json").write_text((checkpoint / "train_summary.json").read_text())
    size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    print(f"installed {dest}: {size / 1e6:.1f} MB")
    if max_bytes is not None and size > max_bytes:
        raise SystemExit(f"{dest} is {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB budget")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--data", type=Path, default=Path(".train-data"))
    p.add_argument("--tokenizer-from", type=Path, default=Path("strata_cli/assets/demo"),
                   help="reuse this folder's tokenizer (default: the embedded model's, so held-out "
                        "perplexities stay comparable); 'none' trains a new one on the stdlib sample")
    p.add_argument("--copy-documents", type=int, default=90_000, help="copy/edit documents to synthesise (default 90,000)")
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, default=Path(".train-data"))
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--minutes", type=float, default=7.0, help="training time of this call (default 7)")
    t.add_argument("--state", type=Path, default=None,
                   help="train in legs: resume from this folder's state if there is one, and leave the "
                        "state there at the end (for runs longer than one call)")
    t.add_argument("--total-minutes", type=float, default=None,
                   help="with --state: training time of the whole run over all legs, which the learning-rate "
                        "schedule spans (default --minutes)")
    t.add_argument("--init", type=Path, default=None,
                   help="start from this checkpoint's weights (fresh optimizer and schedule), e.g. for a copy phase")
    t.add_argument("--repeat-share", type=float, default=0.0,
                   help="share of each batch that is random spans of training tokens repeated (teaches copying; default 0)")
    t.add_argument("--look-alike-share", type=float, default=0.0,
                   help="share of the repeated spans made of a few phrases used again and again (default 0; "
                        "of those that are not real text)")
    t.add_argument("--text-share", type=float, default=0.0,
                   help=f"share of the repeated spans that are real training text with {TEXT_SWAPS:.0%}% of its "
                        "tokens swapped for what followed the same two tokens elsewhere (default 0)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--device", default="cuda")
    t.add_argument("--max-steps", type=int, default=None, help="fixed step count (smoke tests, or a run's schedule repeated)")
    t.add_argument("--eval-windows", type=int, default=10_000,
                   help="held-out windows scored at the end (default all; a few for a CPU smoke run)")
    t.add_argument("--copy-share", type=float, default=0.3,
                   help="share of training windows taken from the copy documents (default 0.3; "
                        "0 or less: windows drawn over all tokens alike)")
    t.add_argument("--stdlib-share", type=float, default=0.5,
                   help="share of the plain-code windows taken from the stdlib (the held-out files' kind; "
                        "default 0.5)")
    t.add_argument("--experts", type=int, default=None, help=f"routed experts (default {MODEL_CONFIG['num_experts']})")
    t.add_argument("--expert-width", type=int, default=None,
                   help=f"routed expert width (default {MODEL_CONFIG['moe_intermediate_size']})")
    t.add_argument("--attention-every", type=int, default=None,
                   help=f"full attention every N-th layer, the rest gated delta rule (default "
                        f"{MODEL_CONFIG['full_attention_interval']})")
    a = sub.add_parser("average", help="the mean of checkpoints of one run (e.g. a leg's and the last)")
    a.add_argument("checkpoints", type=Path, nargs="+")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--data", type=Path, default=Path(".train-data"), help="the held-out tokens (val.bin) are here")
    a.add_argument("--eval-windows", type=int, default=10_000, help="held-out windows scored (default all)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--weights", type=float, nargs="+", default=None,
                   help="one weight per checkpoint (normalised; default: all alike)")
    i = sub.add_parser("install")
    i.add_argument("--checkpoint", type=Path, required=True)
    i.add_argument("--data", type=Path, default=Path(".train-data"))
    i.add_argument("--dest", type=Path, default=Path("strata_cli/assets/demo"))
    i.add_argument("--bits", type=int, choices=(4, 8, 16), default=8,
                   help="quantize to this many bits (default 8); 16 keeps the trained bfloat16 weights")
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.data, None if str(args.tokenizer_from) == "none" else args.tokenizer_from, args.copy_documents)
    elif args.step == "train":
        train(args.data, args.out, args.minutes, args.batch, args.lr, args.device, args.max_steps, args.eval_windows,
              args.copy_share if args.copy_share > 0 else None, args.experts, args.expert_width,
              args.stdlib_share if args.copy_share > 0 else None, args.attention_every, args.state,
              args.total_minutes, args.init, args.repeat_share,
              args.look_alike_share, args.text_share)
    elif args.step == "average":
        average(args.checkpoints, args.out, args.data, args.eval_windows, args.device, args.weights)
    else:
        install(args.checkpoint, args.data, args.dest, None if args.bits == 16 else args.bits)


if __name__ == "__main__":
    main()
