"""Nemotron-H (Nemotron-3-Nano and kin): a stack of single-mixer blocks, x + mixer(norm(x)).

`hybrid_override_pattern` names each block's mixer: M a Mamba-2 layer (model/mamba2.py), * full
attention with no positional embedding, - a relu² MLP, E a MoE of relu² experts with shared
experts and sigmoid group routing (transformers' `NemotronHTopkRouter`). Only M and * blocks
hold state, so the engine's states follow them in order. Module names are mlx-lm's
(`backbone.*`, stacked experts `switch_mlp.fc1`/`fc2`), which the Hugging Face layout's
`backbone.*` and per-expert `experts.E.up_proj`/`down_proj` are mapped onto.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .compiled import Compiled, LayerCompile
from .config import ConfigError, ModelConfig, time_step_limit
from .layers import WINDOW_ROWS, RMSNorm, RowLinear, is_cpu_prompt, lookup_embedding, tied_logits, transposed
from .layout import stack_experts
from . import moe
from .mamba2 import Mamba2Mixer
from .moe import QuantizedExperts, SigmoidTopkRouter, gather_matmul, weighted_sum

MAMBA, ATTENTION, MLP_BLOCK, MOE = "M", "*", "-", "E"
# transformers' block names (and the legacy ones it still reads) -> the pattern's characters
BLOCK_NAMES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
               "mlp": MLP_BLOCK, "moe": MOE}
# config.json spellings transformers accepts for these fields (its __post_init__)
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
           "mamba_conv_bias": "use_conv_bias", "num_local_experts": "n_routed_experts",
           "layer_norm_epsilon": "rms_norm_eps"}


@dataclass(frozen=True)
class NemotronHConfig(ModelConfig):
    # strata's own spelling, not config.json's: `strata convert` keeps SRC's pattern fields instead
    INTERNAL_FIELDS: ClassVar[tuple[str, ...]] = ("layer_types",)
    layer_types: tuple[str, ...]  # one pattern character per block
    num_attention_heads: int
    num_key_value_heads: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    intermediate_size: int = 0
    head_dim: int | None = None
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    use_bias: bool = False
    use_conv_bias: bool = True
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "NemotronHConfig":
        params = dict(params)
        for alias, name in ALIASES.items():
            if alias in params and name not in params:
                params[name] = params[alias]
        params["layer_types"] = _pattern(params)
        params["time_step_limit"] = time_step_limit(params)
        params["num_hidden_layers"] = len(params["layer_types"])
        config = super().from_dict(params)
        if config.head_dim is None:
            config = replace(config, head_dim=config.hidden_size // config.num_attention_heads)
        if MOE in config.layer_types:
            E, k = config.n_routed_experts, config.num_experts_per_tok
            if not 1 <= k <= E:
                raise ConfigError(f"num_experts_per_tok ({k}) must be in 1..n_routed_experts ({E})")
            if E % config.n_group or not 1 <= config.topk_group <= config.n_group:
                raise ConfigError(f"n_routed_experts ({E}) must split into n_group ({config.n_group}) groups, "
                                  f"of which topk_group ({config.topk_group}) are kept")
        return config


def _pattern(params: dict[str, Any]) -> tuple[str, ...]:
    """The blocks as pattern characters, from `hybrid_override_pattern` (a string, as the
    published configs write it) or transformers 5's `layers_block_type` / `layer_types`."""
    pattern = params.get("hybrid_override_pattern")
    if pattern is not None:
        blocks = tuple(pattern)
        unknown = sorted(set(blocks) - {MAMBA, ATTENTION, MLP_BLOCK, MOE})
    else:
        names = params.get("layers_block_type") or params.get("layer_types")
        if not names:
            raise ConfigError("config.json for nemotron_h lacks hybrid_override_pattern and layers_block_type")
        unknown = sorted(set(names) - set(BLOCK_NAMES))
        blocks = tuple(BLOCK_NAMES.get(name, "?") for name in names)
    if unknown:
        raise ConfigError(f"unknown Nemotron-H block types {unknown} (known: M, *, -, E: {sorted(BLOCK_NAMES)})")
    return blocks


Config = NemotronHConfig


class NemotronMLP(nn.Module):
    """down(relu²(up(x))): the "-" blocks and the MoE's shared experts."""

    def __init__(self, dims: int, hidden_dims: int, *, bias: bool):
        super().__init__()
        self.up_proj = RowLinear(dims, hidden_dims, bias=bias)
        self.down_proj = RowLinear(hidden_dims, dims, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.relu2(self.up_proj(x)))


def expert_matmul(x: mx.array, w: mx.array, experts: mx.array, *, is_sorted: bool,
                  wt_of: Callable[[], mx.array]) -> mx.array:
    """x (M, 1, in) @ w[experts]ᵀ with w (E, out, in) -> (M, 1, out), as `ExpertLinear` runs it;
    public so that streamed relu² experts (experts/switch.py) run the very same call over their
    slot banks. `wt_of()`: w's contiguous transpose, asked for on CPU prompt chunks only, which
    multiply by it (model/moe.py's reason)."""
    wt = wt_of() if is_sorted and x.dtype == mx.float32 and is_cpu_prompt(x) else None
    return gather_matmul(x, w, experts, is_sorted=is_sorted, wt=wt)


class ExpertLinear(nn.Module):
    """E stacked matrices (E, out, in) under mlx-lm's `SwitchLinear` name `weight`; quantizes
    to `QuantizedExperts` (weight, scales, biases), as mlx-lm stores quantized experts."""

    def __init__(self, num_experts: int, out_dims: int, in_dims: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))

    def __call__(self, x: mx.array, experts: mx.array, *, is_sorted: bool = True) -> mx.array:
        """x (M, 1, in) @ weight[experts]ᵀ -> (M, 1, out); `is_sorted`: `experts` ascending."""
        return expert_matmul(x, self.weight, experts, is_sorted=is_sorted, wt_of=lambda: transposed(self, "weight"))

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedExperts:
        return QuantizedExperts(self.weight, group_size=group_size, bits=bits, mode=mode)


class SwitchMLP(nn.Module):
    """E stacked relu² experts: fc1 (up) and fc2 (down), mlx-lm's `SwitchMLP` names."""

    expert_kind = "relu2"  # its record kind when streamed (experts/store.py)

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int):
        super().__init__()
        self.fc1 = ExpertLinear(num_experts, expert_size, hidden_size)
        self.fc2 = ExpertLinear(num_experts, hidden_size, expert_size)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        return relu2_by_expert(x, inds, lambda name, xs, experts, is_sorted: self[name](xs, experts,
                                                                                      is_sorted=is_sorted))


def relu2_by_expert(x: mx.array, inds: mx.array, matmul, *, window: bool | None = None) -> mx.array:
    """fc2(relu²(fc1(x))) over each token's picked experts; `matmul(name, xs, experts, is_sorted)`
    does one projection. Also the compute of streamed relu² experts (experts/switch.py), with slot
    ids for `inds`: one code path keeps them bit-identical to resident ones. `window`: as
    `moe.glu_by_expert`'s."""
    N, k = inds.shape
    flat = inds.reshape(-1)
    if N <= WINDOW_ROWS if window is None else window:
        # A decode window: each pick in row order, never grouped by the other rows' choices
        # (docs/design.md, "Row invariance"), as model/moe.py's glu_by_expert does.
        xs = mx.broadcast_to(x[:, None, None, :], (N, k, 1, x.shape[-1])).reshape(N * k, 1, -1)
        h = nn.relu2(matmul("fc1", xs, flat, False))
        return matmul("fc2", h, flat, False).reshape(N, k, -1)
    if moe.GPU_PROMPT_EXPERTS == "padded" and mx.default_device() != mx.cpu:
        # A GPU prompt chunk: one batched matmul of every used expert's picks per projection,
        # where the sorted gather runs each pick as a one-row problem (model/moe.py)
        out = moe.padded_by_expert(x, inds, lambda xs, experts: matmul(
            "fc2", nn.relu2(matmul("fc1", xs, experts, True)), experts, True))
        if out is not None:
            return out
    order = mx.argsort(flat)  # each expert's rows together, each expert read once
    experts = flat[order]
    h = nn.relu2(matmul("fc1", x[order // k][:, None, :], experts, True))
    out = matmul("fc2", h, experts, True)
    return out[mx.argsort(order)].reshape(N, k, -1)


class NemotronMoE(nn.Module):
    """Routed relu² experts (optionally in a latent space) plus the shared experts."""

    experts_attribute = "switch_mlp"  # where the routed experts sit (experts/ streams them from there)

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        dims = config.moe_latent_size or config.hidden_size
        self.gate = SigmoidTopkRouter(
            hidden_size=config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            n_group=config.n_group, topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
        )
        self.switch_mlp = SwitchMLP(dims, config.moe_intermediate_size, config.n_routed_experts)
        self.shared_experts = NemotronMLP(config.hidden_size, config.moe_shared_expert_intermediate_size,
                                          bias=config.mlp_bias)
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = RowLinear(config.hidden_size, dims, bias=config.mlp_bias)
            self.fc2_latent_proj = RowLinear(dims, config.hidden_size, bias=config.mlp_bias)

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    @property
    def compilable(self) -> bool:
        """Whether a decode window may run this block inside an `mx.compile` trace: not when
        its experts stream (the expert cache's contents would be frozen into the trace)."""
        return type(self.switch_mlp) is SwitchMLP

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        inds, weights = self.gate.select(x)
        h = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = weighted_sum(self.switch_mlp(h, inds), weights)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        return (y + self.shared_experts(x)).reshape(shape)


class NemotronBlock(nn.Module):
    """x + mixer(norm(x)). A Mamba or attention mixer splits into head (pure), core (its
    state) and tail (pure), as model/decoder_layer.py's layers do; MLP and MoE blocks are pure
    throughout. Decode windows run the pure parts compiled (model/compiled.py)."""

    def __init__(self, config: NemotronHConfig, block_type: str):
        super().__init__()
        self.block_type = block_type
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if block_type == MAMBA:
            self.mixer = Mamba2Mixer(
                hidden_size=config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
                state_size=config.ssm_state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
                eps=config.rms_norm_eps, time_step_limit=config.time_step_limit,
                use_bias=config.use_bias, use_conv_bias=config.use_conv_bias,
            )
        elif block_type == ATTENTION:
            self.mixer = GatedAttention(
                hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, rotary_dim=0,
                rope_theta=10000.0, eps=config.rms_norm_eps, output_gate=False, qk_norm=False,
            )
        elif block_type == MLP_BLOCK:
            self.mixer = NemotronMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        else:
            self.mixer = NemotronMoE(config)

    @property
    def has_state(self) -> bool:
        return self.block_type in (MAMBA, ATTENTION)

    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        return self.mixer.head(self.norm(x))

    def tail(self, x: mx.array, mixed: mx.array, *tail_in: mx.array) -> mx.array:
        return x + self.mixer.tail(mixed, *tail_in)

    def block(self, x: mx.array) -> mx.array:
        return x + self.mixer(self.norm(x))

    def __call__(self, x: mx.array, state=None) -> mx.array:
        fns = (self.head, self.tail) if self.has_state else (self.block,)
        if LayerCompile.applies(x) and getattr(self.mixer, "compilable", True):
            compiled = self.__dict__.get("_compiled")
            if compiled is None:
                compiled = self.__dict__["_compiled"] = Compiled(self, *fns)
            fns = compiled.functions()
        if not self.has_state:
            return fns[0](x)
        head, tail = fns
        core_in, tail_in = head(x)
        return tail(x, self.mixer.core(*core_in, state), *tail_in)


class Model(nn.Module):
    """Token ids in, logits out; one state per M or * block comes from the caller (the engine)."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.backbone.layers = [NemotronBlock(config, kind) for kind in config.layer_types]
        self.backbone.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = RowLinear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layers(self) -> list[nn.Module]:
        return self.backbone.layers

    @property
    def state_kinds(self) -> list[tuple[str, dict]]:
        """("mamba2", {conv_kernel}) per M block and ("kv", {}) per * block, in order."""
        kinds = {MAMBA: ("mamba2", {"conv_kernel": self.config.conv_kernel}), ATTENTION: ("kv", {})}
        return [kinds[layer.block_type] for layer in self.layers if layer.has_state]

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last row only."""
        return self.head(self.run_layers(self.embed(tokens), states), last_only=last_only)

    def state_span(self, start: int, stop: int) -> slice:
        """Only the M and * blocks hold state: the states of those among layers start..stop-1."""
        before = sum(layer.has_state for layer in self.layers[:start])
        return slice(before, before + sum(layer.has_state for layer in self.layers[start:stop]))

    def embed(self, tokens: mx.array) -> mx.array:
        return lookup_embedding(self.backbone.embeddings, tokens)

    def run_layers(self, h: mx.array, states: list, start: int = 0, stop: int | None = None) -> mx.array:
        states = iter(states)
        for layer in self.layers[start:stop]:
            h = layer(h, next(states) if layer.has_state else None)
        return h

    def head(self, h: mx.array, *, last_only: bool = False) -> mx.array:
        if last_only:
            h = h[:, -1:]
        h = self.backbone.norm_f(h)
        if self.config.tie_word_embeddings:
            return tied_logits(self.backbone.embeddings, h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map a Hugging Face or MLX-layout checkpoint's tensors onto this module's parameters:
        transformers' in-memory `model.*` names to `backbone.*`, per-expert or fused
        `experts.up_proj`/`down_proj` stacked into `switch_mlp.fc1`/`fc2`, the conv weight
        (HF (C, 1, K), mlx-lm (C, K, 1)) to (C, K); MTP layers dropped, as both references do."""
        weights = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in weights.items() if not k.startswith("mtp.")}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            prefix = f"backbone.layers.{i}.mixer"
            if layer.block_type == MAMBA:
                key = f"{prefix}.conv1d.weight"
                if key in weights and weights[key].ndim == 3:
                    weights[key] = weights[key].squeeze(1 if weights[key].shape[1] == 1 else 2)
            elif layer.block_type == MOE:
                stack_experts(weights, prefix, self.config.n_routed_experts,
                              names={"up_proj": "fc1", "down_proj": "fc2"})
                for source, target in (("up_proj", "fc1"), ("down_proj", "fc2")):  # transformers' fused form
                    fused = weights.pop(f"{prefix}.experts.{source}", None)
                    if fused is not None:
                        weights[f"{prefix}.switch_mlp.{target}.weight"] = fused
        return weights
