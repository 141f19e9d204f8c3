"""DeepSeek-V4 on this backend: greedy identity of drafts against serial decoding, forced
rejections at every pos0 % 4, and the window cost by T, on a random-weight model built in MLX
(no checkpoint, no transformers).

    python -m scripts.bench.dsv4_identity --tiny --out /tmp/dsv4.json     # a CPU check, < 1 min
    python -m scripts.bench.dsv4_identity --out dsv4_h200.json            # the GPU figure

Default shape: hidden 1024, 8 layers (sliding, then CSA and HCA alternating), 16 heads of 128
(rotary 64), CSA rate 4 with the indexer keeping 64 entries (sparse selection from 260
positions), HCA rate 128, sliding window 128, 4 hyper-connection streams, 32 experts top-4 (the
first layer hash-routed); a 600-token prompt whose tail repeats its start, 64 greedy tokens.
For each dtype: serial tokens; the same with 3 drafts, `auto` (up to 7) and scripted partly wrong
drafts of 7 (windows of 8 rows crossing compressor blocks), under both rollbacks (`replay`,
`cap`); forced rejections (T = 8, every keep, 4 offsets) compared bit for bit with one-row steps;
the median ms of a forced-acceptance window of T = 1..8.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from strata_cli.bench.runner import git_commit
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model.deepseek_v4 import Config, Model, sparse_selection_length
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.speculative.suffix_drafter import Proposal

FULL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=128, q_lora_rank=256,
            qk_rope_head_dim=64, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4,
            o_groups=4, o_lora_rank=128, index_n_heads=16, index_head_dim=64, index_topk=64, sliding_window=128,
            hc_mult=4, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=32,
            qk_rope_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=12,
            hc_mult=2, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})


def build(shape: dict, seed: int) -> Model:
    n = shape["num_hidden_layers"]
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    config = Config.from_dict(dict(
        model_type="deepseek_v4", vocab_size=512, rms_norm_eps=1e-6, max_position_embeddings=4096,
        layer_types=["sliding_attention"] + [kinds[i % 2] for i in range(n - 1)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1), swiglu_limit=7.0, **shape))
    model = Model(config)
    mx.random.seed(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("tid2eid"):
            keys = mx.random.uniform(shape=(p.shape[0], config.n_routed_experts))
            value = mx.argsort(keys, axis=-1)[:, : p.shape[1]].astype(mx.int32)
        elif name.endswith("scale"):
            value = 1.0 + 0.5 * mx.random.uniform(shape=p.shape)
        elif p.ndim == 1 and name.endswith("norm.weight"):
            value = mx.ones(p.shape)
        elif p.ndim == 1 or "position_bias" in name:
            value = 0.5 * mx.random.normal(p.shape)
        else:
            gain = 3.0 if name == "lm_head.weight" else 1.0
            value = gain * mx.random.normal(p.shape) / p.shape[-1] ** 0.5
        params.append((name, value))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


class WrongDrafts:
    """7 drafts: the serial continuation with its 3rd and 6th tokens wrong."""

    def __init__(self, start: int, reference: list[int]):
        self.start = self.done = start
        self.reference = reference

    def propose(self, max_drafts: int) -> Proposal:
        at = self.done - self.start
        right = (list(self.reference[at : at + max_drafts]) + [0] * max_drafts)[:max_drafts]
        return Proposal(tuple(t if i not in (2, 5) else (t + 1) % 512 for i, t in enumerate(right)), 4, 0)

    def extend(self, tokens) -> None:
        self.done += len(list(tokens))


def tokens(model, prompt, spec, rollback, tokens_out, drafter=None):
    engine = WindowEngine(model, EngineOptions(compressed_rollback=rollback))
    steps = generate(engine, prompt, options=GenerateOptions(max_tokens=tokens_out), spec=spec, eos_ids=frozenset(),
                     drafter=drafter)
    return [t for step in steps for t in step.tokens]


def forced_rejections(model, seq: list[int], offsets: list[int]) -> float:
    """Largest difference of the next row's logits after a T = 8 window kept `keep` rows, against
    one-row steps from the same prefill (0.0 when bit-identical)."""
    worst = 0.0
    for pos0 in offsets:
        serial = WindowEngine(model)
        serial.prefill(seq[:pos0])
        start = serial.snapshot()
        steps = []
        for p in range(pos0, pos0 + 9):
            steps.append(serial.run([seq[p]], p).logits[0])
            serial.commit(1)
        for keep in range(1, 9):
            serial.restore(start)
            wrong = [(t + 1) % 512 for t in seq[pos0 + keep : pos0 + 8]]
            out = serial.run(seq[pos0 : pos0 + keep] + wrong, pos0)
            serial.commit(keep)
            worst = max(worst, float(mx.abs(out.logits[:keep] - mx.stack(steps[:keep])).max()))
            nxt = serial.run([seq[pos0 + keep]], pos0 + keep)
            serial.commit(1)
            worst = max(worst, float(mx.abs(nxt.logits[0] - steps[keep]).max()))
    return worst


def window_costs(model, seq: list[int], context: int, repeats: int) -> dict:
    engine = WindowEngine(model)
    engine.prefill(seq[:context])
    start = engine.snapshot()
    costs = {}
    for T in range(1, 9):
        times = []
        for r in range(repeats + 2):
            engine.restore(start)
            t0 = time.perf_counter()
            engine.run(seq[context : context + T], context)
            engine.commit(T)
            if r >= 2:
                times.append(time.perf_counter() - t0)
        costs[T] = 1000 * statistics.median(times)
    return costs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the test checkpoint's shapes, float32, short")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default bfloat16,float32; float32 with --tiny)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else FULL
    dtypes = (args.dtypes or ("float32" if args.tiny else "bfloat16,float32")).split(",")
    prompt_len, out_len, repeats = (40, 16, 3) if args.tiny else (600, 64, 10)
    rng = random.Random(0)
    head = [rng.randrange(512) for _ in range(prompt_len - prompt_len // 4)]
    prompt = head + head[: prompt_len // 4]
    record = {"device": str(mx.default_device()), "platform": platform.platform(), "tree": git_commit(),
              "shape": shape, "prompt_tokens": len(prompt), "generated": out_len, "runs": []}
    for dtype in dtypes:
        model = build(shape, seed=1)
        model.set_dtype(getattr(mx, dtype))
        selection = sparse_selection_length(model.config)
        serial = tokens(model, prompt, SpecOptions(), "replay", out_len)
        identical = {}
        for rollback in ("replay", "cap"):
            for name, spec in (("3", SpecOptions(max_drafts=3)), ("auto", SpecOptions(max_drafts=7, auto=True))):
                identical[f"{rollback}/{name}"] = tokens(model, prompt, spec, rollback, out_len) == serial
            identical[f"{rollback}/wrong-7"] = tokens(model, prompt, SpecOptions(max_drafts=7), rollback, out_len,
                                                      WrongDrafts(len(prompt) - 1, serial)) == serial
        seq = prompt + serial
        offsets = [selection + k for k in range(4)] if selection + 12 < len(seq) else [len(seq) - 12 - k for k in range(4)]
        run = {"dtype": dtype, "sparse_selection_from": selection, "identical": identical,
               "forced_rejection_max_diff": forced_rejections(model, seq, offsets), "offsets": offsets,
               "window_ms": window_costs(model, seq, len(prompt) - 10, repeats)}
        record["runs"].append(run)
        print(json.dumps(run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
