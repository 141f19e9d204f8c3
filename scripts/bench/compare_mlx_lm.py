"""strata against mlx-lm on one family's checkpoint of a real model's shapes, in one run.

Builds the checkpoint with mlx-lm's own model class (random weights, `--layers` layers of the real
model's shapes), quantizes it with mlx-lm (`quantize_model`, its own predicate: routers at 8 bits)
and saves it with mlx-lm; both engines then load the same files. `--family` picks the model
(several, comma-separated, run one after another in one process):

- `qwen3_next` (default): Qwen3-Next-80B-A3B's layer shapes (scripts/bench/window_cost.py), 6 GDN
  + 2 attention layers at 8;
- `qwen3_5_moe`: Qwen3.5-35B-A3B's text model (QWEN3_5_35B_A3B below, its published config.json's
  text_config), the 3:1 GDN / gated-attention rhythm (6 GDN + 2 attention at 8);
- `nemotron_h`: Nemotron-3-Nano-30B-A3B (NEMOTRON_3_NANO_30B_A3B below, its published
  config.json), the first `--layers` blocks of its pattern (at 8: `MEMEM*EM`, 4 Mamba-2, 3 MoE,
  1 attention: the full pattern's 23:23:6 mix, rounded).
- `gpt_oss`: GPT-OSS-20B (GPT_OSS_20B below, its config.json), sliding and full attention layers
  alternating (`build_gpt_oss_checkpoint`: bfloat16, experts MXFP4 as published, the dense layers
  affine `--bits` on top when nonzero, routers 8-bit by mlx-lm's predicate).

Measured side by side (medians, warm-up apart):

- serial decode tok/s: a `--context`-token random prompt, `--tokens` greedy tokens, EOS off, the
  sides alternating run by run;
- window cost T = 1..8: strata's forced-acceptance window (run + commit of T rows) against
  mlx-lm's forward of T tokens on its cache; T8/T1 of each; where the model has Mamba-2 layers
  and their window kernels are on, strata's windows again with them off (`strata_ms_mamba2_kernels_off`:
  whether the kernels are what grows with T), and on a GPU strata's windows with `RowSplit` "never"
  (`strata_ms_row_split_never`, timing only: MLX's own matmul and attention calls instead of the
  row-invariant kernels and per-row splits);
- prefill of `--prefill-tokens` (4,096) random tokens from empty state, last logits evaluated:
  strata's `WindowEngine.prefill` against mlx-lm's chunked prefill (scripts/bench/prefill_bench.py),
  alternating; on a GPU also strata with its routed experts gathered pick by pick (the side
  `strata experts=gather`: what the padded expert batches, model/moe.py, gain);
- identity: greedy `--suffix-draft 3` and `auto` against serial on this model (a prompt of a
  repeated motif, so drafts are proposed), in float32 and bfloat16; for `qwen3_next` also the
  demo model's selftest (strata_cli/bench/selftest.py).

Each family's record carries the issue's targets (serial >= 1.3x, T8/T1 <= 1.4, prefill >= 5x,
identity) and the seconds each phase took.

    python -m scripts.bench.compare_mlx_lm --out compare.json                                # the 80B-A3B H200 run
    python -m scripts.bench.compare_mlx_lm --family qwen3_5_moe,nemotron_h --out compare_hybrids.json  # H200
    python -m scripts.bench.compare_mlx_lm --family gpt_oss --out compare_gpt_oss.json                  # H200
    python -m scripts.bench.compare_mlx_lm --tiny --family nemotron_h   # tiny dims, CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import argmax_rows, attention_window, gdn_window, mamba2_window, pooled, rows_mma
from metal_shaders import rows_matvec as kernels

from scripts.bench.window_cost import QWEN3_NEXT_80B_A3B
from strata_cli.bench.peers import MlxLmPeer, require_mlx_lm
from strata_cli.bench.runner import git_commit
from strata_cli.bench.selftest import selftest, window_costs
from strata_cli.decode import generate
from strata_cli.engine.window import WindowEngine
from strata_cli.model import mamba2
from strata_cli.model.layers import RowSplit
from strata_cli.options import EngineOptions, GenerateOptions, SpecOptions
from strata_cli.runtime import load_checkpoint

TINY = dict(hidden_size=64, vocab_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            intermediate_size=128, max_position_embeddings=4096)
FAMILIES = ("qwen3_next", "qwen3_5_moe", "nemotron_h", "gpt_oss")
TINY_LAYERS = {"qwen3_next": 4, "qwen3_5_moe": 4, "nemotron_h": 6, "gpt_oss": 4}  # each with an attention layer
# Qwen3.5-35B-A3B's text model, as its published config.json's text_config gives it (mlx-lm's
# qwen3_5.TextModelArgs fields): 40 layers of 3 GDN + 1 gated attention, 256 experts top-8 of
# 512 plus a shared expert of 512, GDN heads 16 (q, k) / 32 (v) of 128, attention 16 / 2 heads of
# 256, interleaved mRoPE on a quarter of each head, a 248,320-row vocabulary.
QWEN3_5_35B_A3B = dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, vocab_size=248320, rms_norm_eps=1e-6,
    max_position_embeddings=262144, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
    tie_word_embeddings=False, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})
# Nemotron-3-Nano-30B-A3B, as its published config.json gives it (mlx-lm's nemotron_h.ModelArgs
# fields): 52 blocks (23 Mamba-2, 23 MoE, 6 attention), hidden 2,688; Mamba-2 64 heads of 64,
# state 128 in 8 groups; attention 32 / 2 heads of 128; 128 relu² experts top-6 of 1,856 plus a
# shared expert of 3,712, sigmoid routing in one group, scaled by 2.5; a 131,072-row vocabulary.
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_3_NANO_30B_A3B = dict(
    model_type="nemotron_h", vocab_size=131072, hidden_size=2688, intermediate_size=1856,
    max_position_embeddings=262144, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    attention_bias=False, mamba_num_heads=64, mamba_head_dim=64, mamba_proj_bias=False, ssm_state_size=128,
    conv_kernel=4, n_groups=8, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
    n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=6, n_group=1, topk_group=1,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, norm_topk_prob=True,
    routed_scaling_factor=2.5, time_step_min=0.001, time_step_max=0.1, time_step_limit=[0.0, float("inf")],
    tie_word_embeddings=False)


def build_checkpoint(path: Path, *, layers: int, tiny: bool, bits: int, seed: int,
                     shape: dict | None = None) -> Path:
    """An mlx-lm Qwen3-Next with random weights, quantized and saved by mlx-lm; `shape`
    overrides config entries (scripts/bench/step_ops.py: small dims, the 80B's layer pattern)."""
    from mlx_lm.models import qwen3_next
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = {**QWEN3_NEXT_80B_A3B, **(TINY if tiny else {}), **(shape or {}), "num_hidden_layers": layers,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    config = {k: v for k, v in config.items() if k in qwen3_next.ModelArgs.__dataclass_fields__}
    mx.random.seed(seed)
    model = qwen3_next.Model(qwen3_next.ModelArgs(**config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


# GPT-OSS-20B's shapes (its config.json); `--layers` of its 24 layers, sliding and full alternating
GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
                   num_attention_heads=64, num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4,
                   sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
                   tie_word_embeddings=False,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096, "truncate": False})
GPT_OSS_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, sliding_window=8, max_position_embeddings=4096)


def family_config(family: str, *, layers: int, tiny: bool) -> dict:
    """The config.json mlx-lm builds `family` from: the real model's shapes (or the family's tiny
    test dims: scripts/bench/family_speed.py's, GPT_OSS_TINY for gpt_oss) at `layers` layers."""
    from scripts.bench.family_shapes import TINY as TINY_FAMILIES

    if family == "qwen3_5_moe":
        text = {**QWEN3_5_35B_A3B, **(TINY_FAMILIES[family]["text_config"] if tiny else {}), "num_hidden_layers": layers}
        return {"model_type": family, "text_config": text}
    if family == "nemotron_h":
        config = {**NEMOTRON_3_NANO_30B_A3B, **(TINY_FAMILIES[family] if tiny else {})}
        config["hybrid_override_pattern"] = NEMOTRON_3_NANO_PATTERN[:layers]
        return config
    if family == "gpt_oss":
        kinds = ["sliding_attention", "full_attention"] * layers
        return {**GPT_OSS_20B, **(GPT_OSS_TINY if tiny else {}), "num_hidden_layers": layers,
                "layer_types": kinds[:layers]}
    raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")


def build_gpt_oss_checkpoint(path: Path, *, layers: int, tiny: bool, bits: int, seed: int,
                             shape: dict | None = None) -> Path:
    """An mlx-lm GPT-OSS with random weights in bfloat16, its experts MXFP4 (MLX's mxfp4 mode, as
    mlx-lm loads the published checkpoints), the dense layers affine `bits`-bit when nonzero;
    saved by mlx-lm with a tiny tokenizer (mlx-lm's load wants one). `shape` overrides config
    entries (scripts/bench/step_ops.py: small dims, the 20B's op structure)."""
    import mlx.nn as nn
    from mlx_lm.models import gpt_oss
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = {**family_config("gpt_oss", layers=layers, tiny=tiny), **(shape or {})}
    mx.random.seed(seed)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: ".experts." in p and hasattr(m, "to_quantized"))
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    mx.eval(model.parameters())
    if bits:  # per-layer entries for the dense layers: the block already names the experts' mode
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    config["quantization_config"] = config["quantization"]
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    tiny_tokenizer(path, vocab_size=config["vocab_size"])
    save_config(config, path / "config.json")
    return path


def build_mlx_lm_checkpoint(path: Path, config: dict, *, bits: int, seed: int, dtype: mx.Dtype | None = None,
                            tokenizer: bool = False) -> Path:
    """`config` as mlx-lm's own model class, random weights (in `dtype` when given), quantized and
    saved by mlx-lm; `tokenizer`: a small tokenizer.json beside it (mlx-lm's load of some families
    wants one; the prompts are random ids, so it only has to load)."""
    import importlib

    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = json.loads(json.dumps(config))
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    # mlx-lm's Nemotron-H router starts at zero: every expert ties, and the picks among ties are
    # each engine's own; random router rows (nn.Linear's scale) make the routing a real one
    zero_routers = [(name, w) for name, w in tree_flatten(model.parameters())
                    if name.endswith("gate.weight") and not mx.any(w).item()]
    if zero_routers:
        scale = 1 / (zero_routers[0][1].shape[-1] ** 0.5)
        model.load_weights([(name, mx.random.uniform(-scale, scale, w.shape, dtype=w.dtype))
                            for name, w in zero_routers], strict=False)
        mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    if tokenizer:
        tiny_tokenizer(path, vocab_size=config.get("text_config", config)["vocab_size"])
    save_config(config, path / "config.json")
    return path


def tiny_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of at most `vocab_size` entries trained on a few stdlib
    modules (as the tests build theirs)."""
    import argparse as _argparse
    import difflib
    import inspect
    import textwrap

    from scripts.train.build_tokenizer import train_tokenizer

    files = [Path(m.__file__) for m in (textwrap, inspect, json, _argparse, difflib)]
    train_tokenizer(files, vocab_size=min(vocab_size, 512), out_dir=path)


def _median_time(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_decode(engine, prompt, tokens, spec) -> tuple[list[int], float]:
    """Tokens and decode seconds (prefill excluded: it runs before the clock starts)."""
    engine.reset()
    engine.prefill(prompt[:-1])
    start = time.perf_counter()
    out = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens), spec=spec,
                                  eos_ids=(), prefilled=len(prompt) - 1) for t in step.tokens]
    return out, time.perf_counter() - start


def mlx_lm_window_costs(model, context: list[int], repeats: int, warmup: int, *,
                        vocab: int | None = None) -> dict[str, float]:
    _, make_prompt_cache = require_mlx_lm()
    vocab = vocab or model.args.vocab_size
    costs = {}
    for T in range(1, 9):
        cache = make_prompt_cache(model)
        model(mx.array([context]), cache=cache)
        mx.eval([c.state for c in cache])
        rng = np.random.default_rng(T)

        def forward():
            tokens = mx.array([rng.integers(0, vocab, T).tolist()])
            mx.eval(model(tokens, cache=cache))

        costs[str(T)] = 1000 * _median_time(forward, repeats, warmup)
    return costs


def alternating_window_costs(engine, peer_model, prompt: list[int], repeats: int, rounds: int,
                             vocab: int | None) -> dict:
    """Window ms by T of strata and mlx-lm over `rounds` rounds, the two taking turns at going
    first, each T's median over the rounds (a noisy machine's burst then moves one round, not one
    side or one T); every round's figures are kept beside."""
    runs = {"strata_ms": [], "mlx_lm_ms": []}
    measure = {"strata_ms": lambda: window_costs(engine, len(prompt), repeats),
               "mlx_lm_ms": lambda: mlx_lm_window_costs(peer_model, prompt, repeats, 3, vocab=vocab)}
    for r in range(rounds):
        for side in (("strata_ms", "mlx_lm_ms") if r % 2 == 0 else ("mlx_lm_ms", "strata_ms")):
            runs[side].append(measure[side]())
    out = {side: {T: statistics.median(run[T] for run in rounds_of) for T in rounds_of[0]}
           for side, rounds_of in runs.items()}
    out.update({f"{side}_rounds": rounds_of for side, rounds_of in runs.items()})
    return out


def identity(path: Path, dtype: str, prompt: list[int], tokens: int) -> dict:
    model = load_checkpoint(path, dtype=dtype)
    engine = WindowEngine(model, EngineOptions())
    serial, _ = timed_decode(engine, prompt, tokens, SpecOptions())
    row = {"dtype": dtype}
    for label, spec in (("3", SpecOptions(max_drafts=3)), ("auto", SpecOptions(max_drafts=7, auto=True))):
        out, _ = timed_decode(engine, prompt, tokens, spec)
        first = next((i for i, (a, b) in enumerate(zip(serial, out)) if a != b), None)
        row[label] = {"identical": out == serial, "first_difference": first}
    return row


def family_layers(args, family: str) -> int:
    return TINY_LAYERS[family] if args.tiny else args.layers


def prepare_checkpoint(args, family: str) -> Path:
    layers = family_layers(args, family)
    name = "tiny" if args.tiny else f"q{args.bits}-{layers}L"
    path = args.dir / (name if family == "qwen3_next" else f"{family}-{name}")
    if not (path / "config.json").is_file():
        print(f"building {path} with mlx-lm", flush=True)
        if family in ("qwen3_next", "gpt_oss"):
            build = build_checkpoint if family == "qwen3_next" else build_gpt_oss_checkpoint
            build(path, layers=layers, tiny=args.tiny, bits=args.bits, seed=args.seed)
        else:
            build_mlx_lm_checkpoint(path, family_config(family, layers=layers, tiny=args.tiny), bits=args.bits,
                                    seed=args.seed, dtype=mx.bfloat16, tokenizer=family == "nemotron_h")
    return path


def targets(result: dict) -> dict:
    """The issue's H200 targets against this run's figures (True where met)."""
    strata = result["window_cost"]["strata_ms"]
    out = {"serial_ratio_at_least_1.3": result["serial"]["ratio"] >= 1.3,
           "window_T8_over_T1_at_most_1.4": strata["8"] / strata["1"] <= 1.4,
           "identity": all(row[mode]["identical"] for row in result["identity"] for mode in ("3", "auto"))}
    if "prefill" in result:
        out["prefill_ratio_at_least_5"] = result["prefill"]["ratio"] >= 5.0
    return out


def run_family(args, family: str) -> dict:
    from scripts.bench.prefill_bench import measure as measure_prefill

    phases = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name], clock = now - clock, now

    path = prepare_checkpoint(args, family)
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, vocab, args.context).tolist()
    compute = "float32" if mx.default_device() == mx.cpu else "bfloat16"

    model = load_checkpoint(path, dtype=compute)
    engine = WindowEngine(model)
    peer = MlxLmPeer.load(path, dtype=getattr(mx, compute))
    lap("build_and_load")
    strata_s, peer_s = [], []
    for i in range(args.warmup + args.repeats):
        _, s = timed_decode(engine, prompt, args.tokens, SpecOptions())
        p = peer.run("mlx-lm", prompt, args.tokens).seconds
        if i >= args.warmup:
            strata_s.append(s)
            peer_s.append(p)
    serial = {"strata_tok_s": args.tokens / statistics.median(strata_s),
              "mlx_lm_tok_s": args.tokens / statistics.median(peer_s), "strata_runs_s": strata_s,
              "mlx_lm_runs_s": peer_s}
    serial["ratio"] = serial["strata_tok_s"] / serial["mlx_lm_tok_s"]
    print(f"{family} serial decode: strata {serial['strata_tok_s']:.1f} tok/s, mlx-lm {serial['mlx_lm_tok_s']:.1f} "
          f"tok/s ({serial['ratio']:.2f}x)", flush=True)
    lap("serial")
    windows = alternating_window_costs(engine, peer.model, prompt, args.window_repeats, args.window_rounds, vocab)
    windows["strata_T8_over_T1"] = windows["strata_ms"]["8"] / windows["strata_ms"]["1"]
    windows["mlx_lm_T8_over_T1"] = windows["mlx_lm_ms"]["8"] / windows["mlx_lm_ms"]["1"]
    if mamba2.WINDOW_KERNELS and any(kind == "mamba2" for kind, _ in model.state_kinds) and mamba2_window.usable():
        # which part of a window grows with T: the same windows with the Mamba-2 layers on MLX ops
        mamba2.WINDOW_KERNELS = False
        try:
            windows["strata_ms_mamba2_kernels_off"] = window_costs(engine, len(prompt), args.window_repeats)
        finally:
            mamba2.WINDOW_KERNELS = True
    if mx.default_device() != mx.cpu:
        # and with every matmul, attention and recurrence on MLX's own calls (timing only: rows
        # are then not row-invariant): what strata's row-invariant kernels and splits cost at each T
        split = RowSplit.mode
        RowSplit.mode = "never"
        try:
            windows["strata_ms_row_split_never"] = window_costs(engine, len(prompt), args.window_repeats)
        finally:
            RowSplit.mode = split
    for T in map(str, range(1, 9)):
        print(f"T={T}: strata {windows['strata_ms'][T]:.2f} ms, mlx-lm {windows['mlx_lm_ms'][T]:.2f} ms", flush=True)
    print(f"T8/T1: strata {windows['strata_T8_over_T1']:.2f}, mlx-lm {windows['mlx_lm_T8_over_T1']:.2f}", flush=True)
    lap("window_cost")
    result = {"family": family, "model": str(path), "layers": family_layers(args, family), "bits": args.bits,
              "tiny": args.tiny,
              "dtype": compute, "context": args.context, "tokens": args.tokens, "repeats": args.repeats,
              "serial": serial, "window_cost": windows}
    if args.prefill_tokens and args.prefill_repeats > 0:
        ids = np.random.default_rng(args.seed + 1).integers(0, vocab, args.prefill_tokens).tolist()
        # on a GPU also strata with its routed experts gathered pick by pick (the padded batches' gain)
        compare = [("experts", "gather")] if mx.default_device() != mx.cpu else []
        result["prefill"] = measure_prefill(engine, peer.model, ids, chunk=None, repeats=args.prefill_repeats,
                                            warmup=1, compare=compare)
        sides = result["prefill"]["sides"]
        print(f"prefill of {len(ids)} tokens: strata {sides['strata']['tokens_per_s']:.0f} tok/s, mlx-lm "
              f"{sides['mlx-lm']['tokens_per_s']:.0f} tok/s ({result['prefill']['ratio']:.2f}x)", flush=True)
        lap("prefill")
    del model, engine, peer

    motif = rng.integers(0, vocab, 24).tolist()
    repeated = (motif * (args.context // 24 + 1))[: args.context]
    result["identity"] = [identity(path, dtype, repeated, args.identity_tokens) for dtype in args.identity_dtypes]
    for row in result["identity"]:
        print(f"identity {row['dtype']}: 3 drafts {row['3']}, auto {row['auto']}", flush=True)
    lap("identity")
    if family == "qwen3_next" and args.demo_selftest:
        result["identity_demo"] = selftest(max_tokens=args.tokens, with_window_costs=False)
        lap("demo_selftest")
    result["targets"] = targets(result)
    result["phase_seconds"] = phases
    print(f"{family} targets: {result['targets']} (phases, s: "
          f"{', '.join(f'{k} {v:.0f}' for k, v in phases.items())})", flush=True)
    return result


def run(args, *, after_each=None) -> dict:
    """Every family of `args.families` in turn; `after_each(result so far)` after each one (the
    JSON is written there, so a run cut short keeps the families it finished)."""
    families = {}
    for family in args.families:
        families[family] = run_family(args, family)
        result = _record(families)
        if after_each is not None:
            after_each(result)
    return result


def _record(families: dict) -> dict:
    common = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
              "commit": git_commit(), "kernels": kernels.status(), "glu_kernels": kernels.glu_status(),
              "mapped_kernels": kernels.mapped_status(),
              "tensor_cores": {**rows_mma.status(), "forms": sorted(rows_mma.forms_on())},
              "gdn_kernels": gdn_window.status(),
              "mamba2_kernels": {**mamba2_window.status(), "switched_on": mamba2.WINDOW_KERNELS},
              "attention_kernel": attention_window.status(), "sink_attention_kernel": attention_window.sinks_status(),
              "pool_copies": pooled.status(), "argmax_kernels": argmax_rows.status()}
    if list(families) == ["qwen3_next"]:  # the record this script always wrote for the 80B shape
        only = families["qwen3_next"]
        return {**common, **{k: v for k, v in only.items() if k != "identity"}, "identity_80b_shape": only["identity"]}
    return {**common, "families": families}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_next",
                        help=f"comma-separated, run in order: {', '.join(FAMILIES)} (default qwen3_next)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a quick CPU check of the script")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4, choices=[0, 4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--window-repeats", type=int, default=20)
    parser.add_argument("--window-rounds", type=int, default=1,
                        help="rounds of the window costs, strata and mlx-lm taking turns at going first; "
                             "each T's median over the rounds (3 on a noisy machine)")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="prefill length timed against mlx-lm (default 4,096, none for qwen3_next alone; "
                             "0: skip)")
    parser.add_argument("--prefill-repeats", type=int, default=2, help="timed prefills a side (0: skip the prefill)")
    parser.add_argument("--identity-tokens", type=int, default=None, help="tokens per identity decode (--tokens)")
    parser.add_argument("--identity-dtypes", default="float32,bfloat16")
    parser.add_argument("--mamba2-kernels", choices=["on", "off"], default="on",
                        help="Mamba-2 decode windows through metal_shaders/mamba2_window.py where they pass their "
                             "probe (on, the default) or as MLX ops (off): model/mamba2.py's WINDOW_KERNELS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-demo-selftest", dest="demo_selftest", action="store_false",
                        help="skip `strata selftest` on the demo model (qwen3_next; minutes on a GPU whose "
                             "kernel cache lacks its float32 kernels)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-compare")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.families = [f.strip() for f in args.family.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        parser.error(f"--family: unknown {unknown} (known: {', '.join(FAMILIES)})")
    if args.window_rounds < 1:
        parser.error("--window-rounds must be at least 1")
    if args.prefill_tokens is None:
        args.prefill_tokens = 0 if args.families == ["qwen3_next"] else 4096
    if args.tiny:
        args.context, args.tokens, args.window_repeats = 64, 16, 3
        args.prefill_tokens = min(args.prefill_tokens, 256)
    args.identity_tokens = args.identity_tokens or args.tokens
    args.identity_dtypes = [d.strip() for d in args.identity_dtypes.split(",") if d.strip()]
    mamba2.WINDOW_KERNELS = args.mamba2_kernels == "on"

    def write(result: dict) -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.out}", flush=True)

    return run(args, after_each=write)


if __name__ == "__main__":
    main()
