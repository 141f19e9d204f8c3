"""A tiny random Nemotron-H model for `strata selftest`: drafts through Mamba-2 layers on this backend.

Built in the package (no checkpoint, no transformers): the config of tests/hf_checkpoints.py's
`hybrid_hf_config("nemotron_h")` (blocks "ME*M-E": Mamba-2, MoE, attention, Mamba-2, MLP, MoE;
groups of B/C heads, group routing), its parameters drawn with `mx.random` from one fixed key at
tests/hf_checkpoints.py's scales, so logits are far from flat and top-k routing is decisive:
matrices std 1/sqrt(fan_in), residual-branch outputs 0.2 of that, the router 3/sqrt(hidden),
lm_head 2/sqrt(hidden); A = -U(1, 8), dt_bias the inverse softplus of a log-uniform dt in
[0.01, 0.1], D and the norms near 1, small conv and routing biases.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten

from ..engine.window import WindowEngine
from ..model.nemotron_h import Model, NemotronHConfig
from ..options import MAX_SUFFIX_DRAFT, EngineOptions
from ..runtime import should_warm_shapes

NAME = "mamba2-hybrid"
SEED = 33
VOCAB = 512
CONFIG = {
    "model_type": "nemotron_h", "vocab_size": VOCAB, "hidden_size": 64, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2, "hybrid_override_pattern": "ME*M-E",
    "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "intermediate_size": 128, "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
# Residual branches at 0.2/sqrt(fan_in) (tests/hf_checkpoints.py: 0.5): every block still moves
# the logits, and the greedy output copies the prompt's repeat often enough that drafts are
# kept, partly kept and rejected in both modes (see `prompts`).
RESIDUAL_GAIN, ROUTER_GAIN, HEAD_GAIN, DT_GAIN = 0.2, 3.0, 2.0, 0.3


def _value(name: str, shape: tuple[int, ...], key: mx.array, hidden: int, heads: int) -> mx.array:
    def normal() -> mx.array:
        return mx.random.normal(shape, key=key)

    def uniform() -> mx.array:
        return mx.random.uniform(shape=shape, key=key)

    if name.endswith("A_log"):
        return mx.log(uniform() * 7 + 1)
    if name.endswith("dt_bias"):
        dt = mx.exp(uniform() * math.log(10) + math.log(0.01))
        return dt + mx.log(-mx.expm1(-dt))  # softplus⁻¹
    if name.endswith(("norm.weight", "norm_f.weight", ".D")):
        return normal() * 0.1 + 1.0
    if name.endswith(("conv1d.bias", "e_score_correction_bias")):
        return normal() * 0.1
    if "embeddings" in name:
        return normal()
    if name.startswith("lm_head"):
        return normal() * HEAD_GAIN / math.sqrt(hidden)
    if name.endswith("mixer.gate.weight"):
        return normal() * ROUTER_GAIN / math.sqrt(hidden)
    if name.endswith("conv1d.weight"):  # (C, K): fan-in K
        return normal() / math.sqrt(shape[-1])
    gain = RESIDUAL_GAIN if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "fc2.weight")) else 1.0
    value = normal() * gain / math.sqrt(shape[-1])
    if name.endswith("in_proj.weight"):  # the dt rows come last
        value = mx.concatenate([value[:-heads], value[-heads:] * DT_GAIN])
    return value


def build_model(dtype: mx.Dtype = mx.float32, *, seed: int = SEED) -> Model:
    """The tiny Nemotron-H, its parameters drawn from `mx.random.key(seed)` in float32 and cast
    to `dtype` (the router's weights too: it computes in float32 whatever they are stored in)."""
    config = NemotronHConfig.from_dict(CONFIG)
    model = Model(config)
    params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = [(name, _value(name, tuple(p.shape), keys[i], config.hidden_size, config.mamba_num_heads)
                .astype(dtype)) for i, (name, p) in enumerate(params)]
    model.load_weights(weights)
    mx.eval(model.parameters())
    model.eval()
    return model


def build_engine(dtype: mx.Dtype = mx.float32, options: EngineOptions | None = None) -> WindowEngine:
    """The model in a WindowEngine; on GPU backends every window shape runs once first, as
    runtime.open_model does for a checkpoint."""
    engine = WindowEngine(build_model(dtype), options)
    if should_warm_shapes(engine.options):
        engine.warm_up(MAX_SUFFIX_DRAFT + 1)
    return engine


def prompts(continue_serially, count: int = 3, *, seed: int = SEED) -> list[list[int]]:
    """Fixed prompts of random token ids that invite copying: A (16 random ids), the model's
    own greedy continuation of A (32 tokens, from `continue_serially(ids, n)`), then A again,
    so the suffix drafter proposes what the model said after A the first time (the demo's
    "code to copy" prompt, for a model that knows no code)."""
    out = []
    for n in range(count):
        head = mx.random.randint(0, VOCAB, (16,), key=mx.random.key(seed + 1 + n)).tolist()
        out.append(head + continue_serially(head, 32) + head)
    return out
