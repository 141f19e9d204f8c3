"""Tiny random DeepSeek-V4 checkpoints written by transformers (`DeepseekV4ForCausalLM`), offline.

One sliding, two CSA (rate 4, with the lightning indexer keeping 3 entries per query) and one HCA
layer (rate 8, so HCA windows close in short prompts), a hash-routed first MoE layer, two
hyper-connection streams, a sliding window of 12. Sparse selection starts to matter at
(index_topk + 1) * 4 = 16 positions; the prompts here cross it and many compressor blocks.

transformers initialises sinks, position biases, hyper-connection biases and the routers'
correction bias to zeros (and the hash table to expert 0): those are drawn at random here, so
every one of them changes the output. Indexer heads: 8, so an entry whose ReLU scores are all 0
(a tie top-k would break arbitrarily) is rare; `hf_ties` finds any that remain.
Built once per test session and reused.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

VOCAB = 512  # the tests' shared tokenizer's (hf_checkpoints.tokenizer_dir)
SEED = 3
_built: dict[tuple, object] = {}


def hf_config(**overrides):
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5,
        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, max_position_embeddings=1024,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=20, sliding_window=12,
        o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, swiglu_limit=1.5,
        rope_theta=10000.0, compress_rope_theta=40000.0,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    fields.update(overrides)
    config = DeepseekV4Config(**fields)
    config._attn_implementation = "eager"
    return config


def hf_model(**overrides):
    """The transformers model, with every parameter drawn at random (fixed seed)."""
    key = repr(sorted(overrides.items()))
    if ("model", key) in _built:
        return _built[("model", key)]
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(SEED)
    config = hf_config(**overrides)
    model = DeepseekV4ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=generator))
            elif p.ndim == 1 or "position_bias" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:
                fan_in = p.shape[-1]
                gain = 3.0 if name == "lm_head.weight" else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                picks = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[: config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)])
                b.copy_(picks)
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))
    _built[("model", key)] = model
    return model


def hf_checkpoint(root: Path, *, tokenizer: Path | None = None, **overrides) -> Path:
    """The model saved by `save_pretrained` (safetensors, sharded; DeepSeek's own tensor names),
    with `tokenizer`'s files when given."""
    name = "deepseek_v4" + (f"-{hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]}" if overrides else "")
    out = Path(root) / name
    if not (out / "config.json").exists():
        hf_model(**overrides).save_pretrained(out, max_shard_size="200KB")
        if tokenizer is not None:
            for f in Path(tokenizer).iterdir():
                shutil.copy(f, out / f.name)
    return out


def hf_ties(model, ids: list[int]) -> int:
    """Rows whose indexer top-k boundary is a tie (then transformers' pick is arbitrary)."""
    import torch

    ties = 0
    hooks, captured = [], []

    def keep_scores(module, args, output):
        captured.append((module, output))

    for layer in model.model.layers:
        compressor = getattr(layer.self_attn, "compressor", None)
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.scorer.register_forward_hook(keep_scores))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    for module, scores in captured:
        k = model.config.index_topk
        S = scores.shape[1]
        rate = model.config.compress_rates["compressed_sparse_attention"]
        for t in range(S):
            visible = (t + 1) // rate
            if visible <= k:
                continue
            row = scores[0, t, :visible].sort(descending=True).values
            ties += int(row[k - 1] == row[k])
    return ties
