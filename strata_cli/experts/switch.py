"""Streamed experts inside the model: the switch layer that serves them, and attaching it.

`attach_streamed_experts` replaces every MoE block's `switch_mlp` with a `StreamedSwitchGLU`
that computes exactly what the resident layer computes (model/moe.py's own public helpers),
over slot banks that the `ExpertCache` (experts/cache.py) fills from disk.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model.layers import swiglu
from ..model.moe import SparseMoeBlock, gather_matmul, gather_qmatmul, glu_by_expert
from ..options import ConfigError, MoceOptions, StreamOptions
from ..telemetry import format_bytes
from .cache import ExpertCache
from .moce import attach_moce
from .store import DTYPES, GLU, ExpertStore, ExpertStoreError, expert_blocks


class StreamedSwitchGLU(nn.Module):
    """Takes a MoE block's `switch_mlp` place: the same `(x, inds) -> (N, k, H)` contract, with
    the experts served from an `ExpertCache` instead of resident stacked weights.

    It computes with the resident layers' own code (`moe.glu_by_expert` over
    `moe.gather_matmul` or `moe.gather_qmatmul`), indexing slot banks with slot ids, so its
    output is the resident layer's, bit for bit.

    Args:
        cache: the expert cache.
        path: this block's module path (its records in the layout).
    """

    def __init__(self, cache: ExpertCache, path: str, activation=swiglu):
        super().__init__()
        self.cache, self.path, self.activation = cache, path, activation
        self.quantization = cache.store.blocks[path].quantization

    def _matmul(self, banks: dict[str, mx.array]):
        def matmul(name: str, xs: mx.array, slots: mx.array, is_sorted: bool) -> mx.array:
            q = self.quantization.get(name)
            if q is None:
                return gather_matmul(xs, banks[name], slots, is_sorted=is_sorted)
            return gather_qmatmul(xs, banks[f"{name}.weight"], banks[f"{name}.scales"], banks.get(f"{name}.biases"),
                                  slots, **q, is_sorted=is_sorted)

        return matmul

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        N, k = inds.shape
        parts, served = [], []
        for picks, slots, banks in self.cache.serve(self.path, x, inds):
            if picks is None:
                return glu_by_expert(x, mx.array(slots), self._matmul(banks), self.activation)
            out = glu_by_expert(x[mx.array(picks // k)], mx.array(slots[:, None]), self._matmul(banks),
                                self.activation)
            mx.eval(out)  # before the next pass overwrites slots this one reads
            parts.append(out[:, 0])
            served.append(picks)
        order = np.argsort(np.concatenate(served))
        return mx.concatenate(parts)[mx.array(order)].reshape(N, k, -1)


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
                            moce: MoceOptions | None = None) -> ExpertCache:
    """Serve `model`'s routed experts from the streaming layout in `path` through an ExpertCache.

    Every MoE block's `switch_mlp` is replaced by a `StreamedSwitchGLU` (which has no
    parameters, so the dense checkpoint loads as usual) and `model.expert_cache` is set.

    Args:
        model: the freshly built model (its MoE blocks still hold empty SwitchGLUs).
        path: the checkpoint directory with `experts/index.json`.
        dtype: compute dtype for the floating expert tensors.
        options: budget, prefetch and I/O (default `StreamOptions()`: every expert resident).
        moce: cache-aware routing (experts/moce.py); default off (exact routing).

    Raises:
        ExpertStoreError: the layout does not match the model, or its files are unusable.
        ConfigError: a budget below one expert per block, MoCE knobs the model cannot take.
    """
    options = options or StreamOptions()
    store = ExpertStore(path, io=options.io, verify=options.verify)
    try:
        moes = dict(model.named_modules())
        blocks = [(p, moes[p.rsplit(".", 1)[0]]) for p, _ in expert_blocks(model)]
        _check_layout(store, blocks)
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
        moe.switch_mlp = StreamedSwitchGLU(cache, p, moe.switch_mlp.activation)
    model.expert_cache = cache
    return cache


def _check_layout(store: ExpertStore, blocks: list[tuple[str, SparseMoeBlock]]) -> None:
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
        layout, glu = store.blocks[p], moe.switch_mlp
        if store.num_experts != glu.gate_proj.shape[0]:
            raise ExpertStoreError(f"{where}: {store.num_experts} experts per block, the model has {glu.gate_proj.shape[0]}")
        specs = {t.name: t for t in layout.tensors}
        for proj in GLU:
            out_dim, in_dim = glu[proj].shape[1:]
            q = layout.quantization.get(proj)
            name = f"{proj}.weight" if q else proj
            spec = specs.get(name)
            packed = in_dim * q["bits"] // 32 if q else in_dim
            if spec is None or spec.shape != (out_dim, packed):
                got = spec.shape if spec else "nothing"
                raise ExpertStoreError(
                    f"{layout.file}: {p}.{name} is {got}, the model needs {(out_dim, packed)}"
                    + (f" ({q['bits']}-bit)" if q else "")
                )
