"""Serial decode speed of strata against mlx-lm on one family's small random checkpoint.

Builds the checkpoint with mlx-lm's own model class (random weights, the shapes of the family's
tiny test checkpoint in tests/hf_checkpoints.py), optionally quantized by mlx-lm, saved by mlx-lm;
both engines load the same files and decode the same random prompt greedily, EOS off, prefill
outside the clock. Runs alternate (strata, mlx-lm, strata, ...) after a warm-up pair; the figure
is the ratio of the medians.

    python -m scripts.bench.family_speed --family qwen3_5_moe
    python -m scripts.bench.family_speed --family qwen3_5 --bits 4 --tokens 256
    python -m scripts.bench.family_speed --family qwen3_5_moe --model ~/models/Qwen3.5-35B-A3B-4bit
    python -m scripts.bench.family_speed --family nemotron_h --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family granitemoehybrid --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family glm4_moe --repeats 9 --tokens 256
    python -m scripts.bench.family_speed --family gpt_oss --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family deepseek_v3 --repeats 7 --tokens 128
    python -m scripts.bench.family_speed --family kimi_linear --repeats 7 --tokens 128

Families: the TINY table below (add a family with its mlx-lm model_type and a tiny config).
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

from scripts.bench.compare_mlx_lm import timed_decode
from strata_cli.bench.peers import MlxLmPeer
from strata_cli.bench.runner import git_commit
from strata_cli.engine.window import WindowEngine
from strata_cli.options import SpecOptions
from strata_cli.runtime import load_checkpoint

_QWEN3_5_TEXT = dict(vocab_size=512, hidden_size=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                     full_attention_interval=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [3, 3, 2], "mrope_interleaved": True})
# family -> the multimodal config.json mlx-lm reads (its text_config: tests/hf_checkpoints.py's shapes)
TINY = {
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text",
                                                          "intermediate_size": 128}},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}},
    # the Mamba-2 hybrids: tests/hf_checkpoints.py's hybrid_hf_config shapes, in mlx-lm's spelling
    # (time_step_limit as numbers, Granite's legacy layer names); vocabulary 512 as above
    "nemotron_h": {"model_type": "nemotron_h", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                   "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
                   "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": "ME*M-E", "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "moe_intermediate_size": 64,
                   "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                   "time_step_min": 0.001, "time_step_limit": [0.001, float("inf")], "tie_word_embeddings": False},
    "granitemoehybrid": {"model_type": "granitemoehybrid", "vocab_size": 512, "hidden_size": 64,
                         "intermediate_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 4096,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
                         "embedding_multiplier": 4.0, "attention_multiplier": 0.0625, "logits_scaling": 2.0,
                         "residual_multiplier": 0.5, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                         "rms_norm_eps": 1e-6, "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 64, "mamba_n_heads": 4, "mamba_d_head": 32,
                         "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "position_embedding_type": "nope", "tie_word_embeddings": True,
                         "time_step_limit": [0.0, float("inf")]},
    # GLM-4.x MoE: tests/hf_checkpoints.py's glm_hf_config shapes (a dense layer, two MoE layers of
    # 8 experts top-2 in 2 groups plus a shared expert, q/k norm, q/k/v biases, half-rotary heads of 32)
    "glm4_moe": {"model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "moe_intermediate_size": 64,
                 "num_experts_per_tok": 2, "n_shared_experts": 1, "n_routed_experts": 8,
                 "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
                 "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
                 "num_nextn_predict_layers": 0},
    # tests/gpt_oss_checkpoints.py's shapes: sliding window 8 and full layers alternating, sinks,
    # YaRN (truncated: mlx-lm's reading), 4 biased experts top-2; vocabulary 512 as above
    "gpt_oss": {"model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 8,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 128, "truncate": True}},
    # tests/deepseek_checkpoints.py's shapes: 3 layers (1 dense), MLA with a q LoRA, 8 experts in 2
    # groups top-2 plus a shared expert
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32,
                    "v_head_dim": 32, "qk_nope_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                    "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
                    "tie_word_embeddings": False},
    # tests/deepseek_checkpoints.py's Kimi-Linear shapes (KDA, MLA, KDA, KDA; the first MLP dense)
    # in the published spelling mlx-lm reads
    "kimi_linear": {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "head_dim": 32,
                    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "model_max_length": 4096,
                    "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "num_heads": 2,
                                           "head_dim": 32, "short_conv_kernel_size": 4},
                    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
                    "moe_intermediate_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                    "qk_rope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 1, "num_expert_group": 2, "topk_group": 1,
                    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "tie_word_embeddings": False},
}


def build_checkpoint(path: Path, family: str, *, bits: int, seed: int) -> Path:
    """The family's tiny config as mlx-lm's model class, random weights, saved (and quantized) by mlx-lm."""
    import importlib

    from mlx_lm.utils import quantize_model, save_config, save_model

    config = json.loads(json.dumps(TINY[family]))
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    # mlx-lm's Nemotron-H router starts at zero: every expert ties, and the picks among ties are
    # each engine's own; random router rows (nn.Linear's scale) make the routing a real one
    from mlx.utils import tree_flatten

    zero_routers = [(name, w) for name, w in tree_flatten(model.parameters())
                    if name.endswith("gate.weight") and not mx.any(w).item()]
    if zero_routers:
        scale = 1 / (zero_routers[0][1].shape[-1] ** 0.5)
        model.load_weights([(name, mx.random.uniform(-scale, scale, w.shape)) for name, w in zero_routers],
                           strict=False)
        mx.eval(model.parameters())
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    if not config["model_type"].startswith("qwen3_5"):  # mlx-lm's load wants a tokenizer for the others
        _tiny_tokenizer(path, vocab_size=config.get("text_config", config)["vocab_size"])
    save_config(config, path / "config.json")
    return path


def _tiny_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of `vocab_size` trained on a few stdlib modules (as the tests
    build theirs); the prompt is random ids, so it only has to load."""
    import argparse as _argparse
    import difflib
    import inspect
    import textwrap

    from scripts.train.build_tokenizer import train_tokenizer

    files = [Path(m.__file__) for m in (textwrap, inspect, json, _argparse, difflib)]
    train_tokenizer(files, vocab_size=vocab_size, out_dir=path)


def vocab_size(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def run(args) -> dict:
    path = args.model
    if path is None:
        path = args.dir / f"{args.family}-{f'q{args.bits}' if args.bits else 'float32'}"
        if not (path / "config.json").is_file():
            print(f"building {path} with mlx-lm", flush=True)
            build_checkpoint(path, args.family, bits=args.bits, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, vocab_size(path), args.context).tolist()
    compute = "float32" if mx.default_device() == mx.cpu else "bfloat16"
    engine = WindowEngine(load_checkpoint(path, dtype=compute))
    peer = MlxLmPeer.load(path, dtype=getattr(mx, compute))
    strata_s, peer_s, strata_cpu, peer_cpu, same = [], [], [], [], True
    for i in range(args.warmup + args.repeats):
        cpu = time.process_time()
        tokens, seconds = timed_decode(engine, prompt, args.tokens, SpecOptions())
        cpu, strata_cpu_s = time.process_time(), time.process_time() - cpu
        result = peer.run("mlx-lm", prompt, args.tokens)
        peer_cpu_s = time.process_time() - cpu
        same &= tokens == result.token_ids[0]
        if i >= args.warmup:
            strata_s.append(seconds)
            peer_s.append(result.seconds)
            strata_cpu.append(strata_cpu_s)
            peer_cpu.append(peer_cpu_s)
    out = {"family": args.family, "model": str(path), "bits": args.bits, "device": str(mx.default_device()),
           "dtype": compute, "mlx": mx.__version__, "machine": f"{platform.node()} ({platform.machine()})",
           "commit": git_commit(), "context": args.context, "tokens": args.tokens, "repeats": args.repeats,
           "strata_tok_s": args.tokens / statistics.median(strata_s),
           "mlx_lm_tok_s": args.tokens / statistics.median(peer_s),
           "strata_runs_s": strata_s, "mlx_lm_runs_s": peer_s, "same_tokens": same,
           # process CPU seconds per run, prompt included for both: on a shared machine the work
           # each engine did, where wall time also counts the time other processes held the cores
           "strata_cpu_s": strata_cpu, "mlx_lm_cpu_s": peer_cpu,
           "cpu_ratio": statistics.median(peer_cpu) / statistics.median(strata_cpu)}
    out["ratio"] = out["strata_tok_s"] / out["mlx_lm_tok_s"]
    print(f"{args.family} serial decode ({compute}, {out['device']}): strata {out['strata_tok_s']:.1f} tok/s, "
          f"mlx-lm {out['mlx_lm_tok_s']:.1f} tok/s ({out['ratio']:.2f}x; CPU time {out['cpu_ratio']:.2f}x); "
          f"same tokens: {same}", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(TINY))
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint both engines read (default: build the tiny one)")
    parser.add_argument("--bits", type=int, default=0, choices=[0, 4, 8], help="quantize the built checkpoint (0: float32)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-family-speed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
