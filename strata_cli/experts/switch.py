"""Streamed experts inside the model: the switch layer that serves them, and attaching it.

`attach_streamed_experts` replaces every MoE block's routed experts with a `StreamedSwitchGLU`
that computes exactly what the resident layer computes (the resident stacks' own public helpers:
model/moe.py's for SwiGLU experts, with GPT-OSS's activation and bias rows where they have them,
model/nemotron_h.py's for relu² ones), over slot banks that the `ExpertCache` (experts/cache.py)
fills from disk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model import host_experts
from ..model.biased_experts import add_bias
from ..model.layers import WINDOW_ROWS, swiglu
from ..model.moe import gather_matmul, gather_qmatmul, glu_by_expert
from ..model.nemotron_h import expert_matmul, relu2_by_expert
from ..options import ConfigError, MoceOptions, StreamOptions
from ..telemetry import format_bytes
from .cache import ExpertCache, picks_by_own_rule
from .moce import attach_moce
from .store import DTYPES, ExpertStore, ExpertStoreError, expert_blocks


class StreamedSwitchGLU(nn.Module):
    """Takes the place of a MoE block's routed experts (`switch_mlp`, GPT-OSS's `experts`): the
    same `(x, inds) -> (N, k, H)` contract, with the experts served from an `ExpertCache` instead
    of resident stacked weights.

    It computes with the resident layers' own code, indexing slot banks with slot ids, so its
    output is the resident layer's, bit for bit: SwiGLU records ("glu", GPT-OSS's clamped form
    too) through `moe.glu_by_expert` over `moe.gather_matmul` or `moe.gather_qmatmul`, each
    projection plus its bias rows where the record has them; relu² records
    ("relu2", Nemotron-H) through `nemotron_h.relu2_by_expert` over `nemotron_h.expert_matmul`
    or `moe.gather_qmatmul`.

    Args:
        cache: the expert cache.
        path: this block's module path (its records in the layout).
        resident: the resident stack it replaces: SwiGLU records take its `activation` where it
            has one (GPT-OSS's clamped form), unquantized ones its `by_expert` form where it has
            one (Granite's GPU prompt form), the others `glu_by_expert`.
    """

    def __init__(self, cache: ExpertCache, path: str, resident: nn.Module | None = None):
        super().__init__()
        self.cache, self.path = cache, path
        layout = cache.store.blocks[path]
        self.kind, self.quantization = layout.kind, layout.quantization
        self.plain = {proj: layout.plain_name(proj) for proj in layout.projections}
        own = None if self.quantization else getattr(resident, "by_expert", None)
        activation = getattr(resident, "activation", None)
        if self.kind == "relu2":
            self.by_expert = relu2_by_expert
        elif own is not None:
            self.by_expert = own
        elif activation not in (None, swiglu):  # a clamped form (GPT-OSS, DeepSeek-V4)
            self.by_expert = partial(glu_by_expert, activation=activation)
        else:
            self.by_expert = glu_by_expert

    def _matmul(self, banks: dict[str, mx.array]):
        def matmul(name: str, xs: mx.array, slots: mx.array, is_sorted: bool) -> mx.array:
            q = self.quantization.get(name)
            if q is not None:
                y = gather_qmatmul(xs, banks[f"{name}.weight"], banks[f"{name}.scales"],
                                   banks.get(f"{name}.biases"), slots, **q, is_sorted=is_sorted)
            elif self.kind == "relu2":
                w = banks[self.plain[name]]
                y = expert_matmul(xs, w, slots, is_sorted=is_sorted, wt_of=lambda: mx.contiguous(w.swapaxes(-1, -2)))
            else:
                y = gather_matmul(xs, banks[self.plain[name]], slots, is_sorted=is_sorted)
            bias = banks.get(f"{name}.bias")  # biased experts' rows (GPT-OSS)
            return y if bias is None else add_bias(y, bias, slots)

        return matmul

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        N, k = inds.shape
        parts, served = [], []
        for picks, slots, banks in self.cache.serve(self.path, x, inds):
            if picks is None:
                return self.by_expert(x, mx.array(slots), self._matmul(banks))
            # A pass's picks, one per row: a decode window's stay on the window's per-pick form
            # however many there are, so their bits never depend on how the cache split them.
            out = self.by_expert(x[mx.array(picks // k)], mx.array(slots[:, None]), self._matmul(banks),
                                 window=N <= WINDOW_ROWS)
            mx.eval(out)  # before the next pass overwrites slots this one reads
            parts.append(out[:, 0])
            served.append(picks)
        order = np.argsort(np.concatenate(served))
        return mx.concatenate(parts)[mx.array(order)].reshape(N, k, -1)

    def host_forms(self) -> dict[str, host_experts.Form] | None:
        """The projections' forms where model/host_experts.py computes these experts (plain
        SwiGLU records in float32 or affine-quantized; what resident stacks of the same
        checkpoint would say), else None."""
        if self.kind != "glu" or self.by_expert is not glu_by_expert or self.cache.dtype != mx.float32:
            return None
        shapes = {t.name: t.shape for t in self.cache.store.blocks[self.path].tensors}
        forms = {}
        for proj in host_experts.PROJECTIONS:
            q = self.quantization.get(proj)
            if f"{proj}.bias" in shapes:
                return None
            if q is None:
                forms[proj] = host_experts.Form(*shapes[self.plain[proj]])
            elif q.get("mode", "affine") == "affine" and f"{proj}.biases" in shapes:
                out, packed = shapes[f"{proj}.weight"]
                forms[proj] = host_experts.Form(out, packed * 32 // q["bits"], q["bits"], q["group_size"])
            else:
                return None
        return forms

    def host_picks(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """model/host_experts.py's picks: x (N, H), expert ids (N, k) -> (N, k, H), each pick's
        matrices read from the slot the cache serves it in, pass by pass."""
        N, k = ids.shape
        out = np.empty((N, k, x.shape[-1]), dtype=np.float32)
        for picks, slots, banks in self.cache.serve(self.path, mx.array(x), mx.array(ids)):
            mx.eval(list(banks.values()))  # the pass's installs at once, not at each bank's conversion
            views = host_experts.host_views([
                banks[self.plain[proj]] if proj not in self.quantization
                else SimpleNamespace(weight=banks[f"{proj}.weight"], scales=banks[f"{proj}.scales"],
                                     biases=banks[f"{proj}.biases"], **self.quantization[proj])
                for proj in host_experts.PROJECTIONS])
            if picks is None:
                served = ((n, j, s) for n, row in enumerate(slots.tolist()) for j, s in enumerate(row))
            else:
                served = ((p // k, p % k, s) for p, s in zip(picks.tolist(), slots.tolist()))
            for n, j, s in served:
                out[n, j] = host_experts.glu(x[n], host_experts.expert_matrices(views, s))
        return out


def resolve_slots(options: StreamOptions, *, num_experts: int, bytes_per_expert: int, num_blocks: int) -> int:
    """Resident experts per block from the budget: `resident_experts`, or `cache_gb` over every
    block, or all of them when neither is set.

    Raises:
        ConfigError: a budget that holds less than one expert per block.
    """
    if options.resident_experts is not None:
        return min(options.resident_experts, num_experts)
    if options.cache_gb is None:
        return num_experts
    per_slot = bytes_per_expert * num_blocks
    slots = int(options.cache_gb * 1e9 // per_slot)
    if slots < 1:
        raise ConfigError(
            f"--expert-cache {options.cache_gb:g} GB holds no expert: one slot in each of the "
            f"{num_blocks} MoE blocks takes {format_bytes(per_slot)}; pass at least "
            f"--expert-cache {math.ceil(per_slot / 1e6) / 1e3:g} or --resident-experts 1"
        )
    return min(slots, num_experts)


def attach_streamed_experts(model, path: str | Path, *, dtype: mx.Dtype, options: StreamOptions | None = None,
                            moce: MoceOptions | None = None,
                            holds: Callable[[str], bool] | None = None) -> ExpertCache | None:
    """Serve `model`'s routed experts from the streaming layout in `path` through an ExpertCache.

    Every MoE block's routed experts (`switch_mlp`, GPT-OSS's `experts`) are replaced by a
    `StreamedSwitchGLU` (which has no parameters, so the dense checkpoint loads as usual) and
    `model.expert_cache` is set.

    Args:
        model: the freshly built model (its MoE blocks still hold empty SwitchGLUs).
        path: the checkpoint directory with `experts/index.json`.
        dtype: compute dtype for the floating expert tensors.
        options: budget, prefetch and I/O (default `StreamOptions()`: every expert resident).
        moce: cache-aware routing (experts/moce.py); default off (exact routing).
        holds: which blocks (module paths) this process holds (a pipeline stage's layers:
            distributed.py); the layout's other blocks are neither checked nor opened, and the
            budget counts this process's blocks only. Default None: every block.

    Returns:
        The cache, or None when `holds` leaves this process no MoE block (nothing to stream).

    Raises:
        ExpertStoreError: the layout does not match the model, or its files are unusable.
        ConfigError: a budget below one expert per block, MoCE knobs the model cannot take.
    """
    options = options or StreamOptions()
    store = ExpertStore(path, io=options.io, verify=options.verify, holds=holds)
    try:
        moes = dict(model.named_modules())
        blocks = [(p, moes[p.rsplit(".", 1)[0]]) for p, _ in expert_blocks(model)]
        _check_layout(store, blocks)
        if not blocks and holds is not None:  # a stage of dense layers only
            store.close()
            return None
        _check_routing_options(blocks, options, moce or MoceOptions())
        bytes_per_expert = sum(
            math.prod(t.shape) * (dtype if mx.issubdtype(DTYPES[t.dtype][1], mx.floating) else DTYPES[t.dtype][1]).size
            for t in store.blocks[blocks[0][0]].tensors
        )
        slots = resolve_slots(options, num_experts=store.num_experts, bytes_per_expert=bytes_per_expert,
                              num_blocks=len(blocks))
        cache = ExpertCache(store, blocks, num_slots=slots, dtype=dtype, options=options)
        attach_moce(cache, blocks, moce or MoceOptions())
    except BaseException:
        store.close()
        raise
    for p, moe in blocks:
        setattr(moe, moe.experts_attribute, StreamedSwitchGLU(cache, p, moe[moe.experts_attribute]))
    model.expert_cache = cache
    return cache


def _check_routing_options(blocks: list[tuple[str, nn.Module]], options: StreamOptions, moce: MoceOptions) -> None:
    """Refuse the options that read softmax router probabilities or the router's input where a
    block routes otherwise (Nemotron-H: sigmoid scores in groups; experts in a latent space)."""
    for path, moe in blocks:
        if not picks_by_own_rule(moe):
            continue
        if moe.gate.weight.shape[-1] != moe.switch_mlp.fc1.weight.shape[-1] and options.prefetch == "router":
            raise ConfigError(f"--expert-prefetch router: {path}'s experts take a latent projection of the "
                              "input its router reads; use --expert-prefetch history or off")
        if moce.is_enabled:
            raise ConfigError(f"cache-aware routing (--moce-protect) needs softmax router probabilities; {path} "
                              "routes by sigmoid scores in groups")
        if options.readahead_min_prob:
            raise ConfigError(f"--expert-readahead-min-prob needs softmax router probabilities; {path} routes by "
                              "sigmoid scores in groups")


def _check_layout(store: ExpertStore, blocks: list[tuple[str, nn.Module]]) -> None:
    where = store.root
    have, want = set(store.blocks), {p for p, _ in blocks}
    if have != want:
        extra, lacking = sorted(have - want), sorted(want - have)
        raise ExpertStoreError(
            f"{where}: the streamed blocks do not match the model"
            + (f"; the model has no {extra[0]}" if extra else "")
            + (f"; the layout lacks {lacking[0]}" if lacking else "")
        )
    for p, moe in blocks:
        layout, glu = store.blocks[p], moe[moe.experts_attribute]
        kind = type(glu).expert_kind
        if layout.kind != kind:
            raise ExpertStoreError(f"{layout.file}: {p} holds {layout.kind} records, the model's experts are {kind}")
        # SwitchGLU holds bare (E, out, in) stacks; the other stacks modules with a `weight` (and a `bias`)
        shapes = {proj: (glu[proj].weight if isinstance(glu[proj], nn.Module) else glu[proj]).shape
                  for proj in layout.projections}
        num_experts = shapes[layout.projections[0]][0]
        if store.num_experts != num_experts:
            raise ExpertStoreError(f"{where}: {store.num_experts} experts per block, the model has {num_experts}")
        specs = {t.name: t for t in layout.tensors}
        for proj in layout.projections:
            out_dim, in_dim = shapes[proj][1:]
            q = layout.quantization.get(proj)
            name = f"{proj}.weight" if q or isinstance(glu[proj], nn.Module) else proj
            spec = specs.get(name)
            packed = in_dim * q["bits"] // 32 if q else in_dim
            if spec is None or spec.shape != (out_dim, packed):
                got = spec.shape if spec else "nothing"
                raise ExpertStoreError(
                    f"{layout.file}: {p}.{name} is {got}, the model needs {(out_dim, packed)}"
                    + (f" ({q['bits']}-bit)" if q else "")
                )
            bias = specs.get(f"{proj}.bias")
            want = (out_dim,) if isinstance(glu[proj], nn.Module) and "bias" in glu[proj] else None
            if (bias.shape if bias else None) != want:
                raise ExpertStoreError(f"{layout.file}: {p}.{proj}.bias is {bias.shape if bias else 'nothing'}, "
                                       f"the model needs {want or 'none'}")
