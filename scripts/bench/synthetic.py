"""Random-weight models for tests and benchmarks: no checkpoint, same code path."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from strata_cli.model import qwen3_next
from strata_cli.model.layers import stack_rows


def tiny_qwen3_next_config(**overrides) -> qwen3_next.Config:
    """A few-kilobyte hybrid config: 3 GDN layers, 1 attention layer, 8 experts, top-2."""
    params = dict(
        model_type="qwen3_next",
        hidden_size=32,
        num_hidden_layers=4,
        vocab_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        intermediate_size=64,
    )
    params.update(overrides)
    return qwen3_next.Config.from_dict(params)


def random_model(config, *, seed: int = 0, dtype: mx.Dtype = mx.float32):
    """A model whose weights are drawn so activations stay O(1) and logits are far from flat.

    Matrices get std 1/sqrt(fan_in) (the router twice that, so routing is decisive), norms stay
    near 1, and the GDN decay parameters follow the reference initialisation.
    """
    model = qwen3_next.Model(config)
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = {name: _draw(name, value, keys[i]).astype(dtype) for i, (name, value) in enumerate(flat)}
    model.update(tree_unflatten(list(params.items())))
    stack_rows(model)  # as loading does
    mx.eval(model.parameters())
    model.eval()
    return model


def randomized(module, seed: int, scale: float = 0.1):
    """`module` with every parameter drawn normal, times `scale` (a block's own tests: no
    layer's initialisation matters there), evaluated; returned for chaining."""
    params = tree_flatten(module.parameters())
    module.update(tree_unflatten([(name, scale * mx.random.normal(p.shape, key=mx.random.key(seed + i)))
                                  for i, (name, p) in enumerate(params)]))
    mx.eval(module.parameters())
    return module


def _draw(name: str, value: mx.array, key: mx.array) -> mx.array:
    shape = value.shape
    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
    if name.endswith("dt_bias"):
        return mx.ones(shape)
    if value.ndim == 1:  # norm weights
        return 1.0 + 0.1 * mx.random.normal(shape, key=key)
    if name.endswith("conv1d.weight"):
        return mx.random.normal(shape, key=key) / shape[-1] ** 0.5
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape, key=key)
    scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0
    return scale * mx.random.normal(shape, key=key) / shape[-1] ** 0.5
