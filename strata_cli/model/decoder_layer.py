"""The pre-norm decoder layer every family shares: x + mixer(norm(x)), then h + ffn(norm(h)).

The mixer (attention or GDN) splits its call into `head` (projections: pure), `core` (what
touches the layer's state) and `tail` (output projection: pure). Decode windows run the layer's
pure ends compiled (compiled.py): the input norm and the mixer's head in one trace; the mixer's
tail, the residual adds, the post norm and the feed-forward block in another (on a GPU the first
add and the post norm in one kernel, RMSNorm.add_and_norm, and the second add in the MoE block's
combine kernel where the block takes it, `folds_residual`). On the CPU, where
short calls' linears run in numpy, the tail runs on the host instead (host_tail.py), and the whole
layer where its mixer has a numpy form (host_layer.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import host_layer, host_tail
from .compiled import Compiled, LayerCompile
from .layers import host_window


class PreNormLayer(nn.Module):
    """Subclasses build `input_layernorm`, `post_attention_layernorm` and the modules that
    `mixer` and `ffn` return (the checkpoint names them per family)."""

    @property
    def mixer(self) -> nn.Module:
        raise NotImplementedError

    @property
    def ffn(self) -> nn.Module:
        raise NotImplementedError

    def head(self, x: mx.array) -> tuple[tuple, tuple]:
        return self.mixer.head(self.input_layernorm(x))

    def tail(self, x: mx.array, mixed: mx.array, *tail_in: mx.array) -> mx.array:
        h, normed = self.post_attention_layernorm.add_and_norm(x, self.mixer.tail(mixed, *tail_in))
        if getattr(self.ffn, "folds_residual", False):
            return self.ffn(normed, residual=h)  # on a GPU the add runs in the MoE combine kernel
        return h + self.ffn(normed)

    def __call__(self, x: mx.array, state) -> mx.array:
        head, tail = self.head, self.tail
        if host_window(x) and type(self).tail is PreNormLayer.tail and host_tail.applies(self, x):
            if type(self).head is PreNormLayer.head and host_layer.applies(self, x):
                return host_layer.call(self, x, state)
            tail = partial(host_tail.tail, self)
        elif LayerCompile.applies(x) and getattr(self.ffn, "compilable", True):
            compiled = self.__dict__.get("_compiled")
            if compiled is None:
                compiled = self.__dict__["_compiled"] = Compiled(self, self.head, self.tail)
            head, tail = compiled.functions()
        core_in, tail_in = head(x)
        return tail(x, self.mixer.core(*core_in, state), *tail_in)
