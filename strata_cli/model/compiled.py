"""Decode windows replay each layer's pure parts from `mx.compile` traces.

On a GPU, small-batch decoding is host-bound: every MLX op costs Python to build and a launch
to dispatch (docs/benchmarks.md). A compiled function is traced once per window size and
dtype, then replayed in C++ with its elementwise chains fused. Only pure parts are compiled —
projections, norms, residual adds, the MoE block — never state: KV writes, the GDN conv history
and recurrence stay eager, so the rollback rules are untouched. Serial steps and windows both
take the compiled parts, so a row still computes what it computes alone.

A trace holds the weights it saw as constants. `Compiled` retraces when any array or submodule
of its owner has been replaced (loading, `set_dtype`, quantizing), when `RowSplit.mode` or the
default device changes, and runs the first call of each such setting eagerly: the kernels'
start-up probes evaluate arrays, which a trace may not.
"""

from __future__ import annotations

from operator import getitem, is_
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .layers import WINDOW_ROWS, CpuShortCalls, RowSplit, host_rows, host_window


class LayerCompile:
    """Whether window-sized calls run compiled: "always" (the default; serial decoding on the
    H200 and on a 2-core CPU both run faster, docs/benchmarks.md) or "never"."""

    mode = "always"

    @classmethod
    def applies(cls, x: mx.array) -> bool:
        return cls.mode == "always" and 0 < x.size // x.shape[-1] <= WINDOW_ROWS and not host_window(x)

    @classmethod
    def applies_to_state(cls, rows: int) -> bool:
        """Whether a CPU call of `rows` rows, fewer than a prompt-sized one (decode windows, and
        short prompt chunks, which must still equal serial steps), runs its recurrence's pure
        steps from traces (model/gdn.py): inputs and state go in and come out as arrays, so the
        state's rules are untouched. CPU only: GPU backends have the GDN window kernels."""
        return cls.mode == "always" and CpuShortCalls.applies(rows)


class Holdings:
    """Every array and container under a module, each with where it was found, so that
    `current()` says whether any was replaced, added or removed without walking the tree again,
    in one pass in C (a decode window asks for every layer it runs)."""

    __slots__ = ("containers", "sizes", "owners", "keys", "values")

    def __init__(self, module: nn.Module):
        containers, owners, keys, values = [], [], [], []  # owners[i][keys[i]] was values[i]
        stack = [module]
        while stack:
            node = stack.pop()
            containers.append(node)
            for key in (tuple(node) if isinstance(node, dict) else range(len(node))):
                value = node[key]
                owners.append(node)
                keys.append(key)
                values.append(value)
                if isinstance(value, (dict, list, tuple)):
                    stack.append(value)
        self.containers, self.sizes = tuple(containers), tuple(map(len, containers))
        self.owners, self.keys, self.values = tuple(owners), tuple(keys), tuple(values)

    def current(self) -> bool:
        """Whether every container still holds exactly what it held (by identity)."""
        return (tuple(map(len, self.containers)) == self.sizes
                and all(map(is_, map(getitem, self.owners, self.keys), self.values)))


class Compiled:
    """`fns` compiled over `owner`'s current weights; see the module docstring for when they retrace."""

    __slots__ = ("owner", "fns", "held", "setting", "compiled")

    def __init__(self, owner: nn.Module, *fns: Callable):
        self.owner, self.fns = owner, fns
        self.held = self.setting = self.compiled = None

    def functions(self) -> tuple[Callable, ...]:
        """The functions to call now: compiled, or eager for the first call of a new setting."""
        setting = (RowSplit.mode, mx.default_device())
        if self.held is None or setting != self.setting or not self.held.current():
            self.held, self.setting, self.compiled = Holdings(self.owner), setting, None
            return self.fns  # eager: probes and lazily built constants run outside a trace
        if self.compiled is None:
            self.compiled = tuple(mx.compile(fn) for fn in self.fns)
        return self.compiled


def traced_on_host(owner: nn.Module, name: str, fn: Callable, rows: int, dtype: mx.Dtype) -> Callable:
    """`fn` (pure MLX, over `owner`'s weights) from a `Compiled` kept on `owner` as `name`, for a
    call of `rows` rows in `dtype` on the CPU's host path (`layers.host_rows`), where the layer
    ends run eagerly around numpy's linears and only their MLX pieces can be traced; `fn`
    itself elsewhere, or with LayerCompile "never"."""
    if LayerCompile.mode != "always" or not host_rows(rows, dtype):
        return fn
    compiled = owner.__dict__.get(name)
    if compiled is None:
        compiled = owner.__dict__[name] = Compiled(owner, fn)
    return compiled.functions()[0]
