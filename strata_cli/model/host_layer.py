"""A whole pre-norm decoder layer on the CPU's host path: input norm, mixer and tail in numpy,
the routed experts too where host_experts.py takes them (else in MLX).

host_tail.py moved a layer's tail to numpy; its mixer's head, core and tail ends stayed MLX ops
(~90 of the ~95 MLX ops a layer of a one-row step), each costing several times the numpy op
that replaces it here. The state stays the engine's: the mixer's state calls are the ones the
MLX layer makes (host_gdn.py, host_attention.py). Two reads back a layer: the layer's input (the
previous layer's routed experts) and the state's cells.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import host_attention, host_blas, host_gdn, host_tail
from .layers import RMSNorm, host_weight


def applies(layer, x: mx.array) -> bool:
    """Whether `layer` (a `PreNormLayer` whose tail `host_tail` takes) runs here for one
    sequence's rows `x`: a plain RMSNorm input norm and a mixer host_gdn or host_attention computes."""
    rows = x.shape[1]
    return (x.shape[0] == 1 and type(layer.input_layernorm) is RMSNorm
            and layer.input_layernorm.weight.dtype == mx.float32
            and (host_gdn.applies(layer.mixer, rows) or host_attention.applies(layer.mixer, rows)))


def call(layer, x: mx.array, state) -> mx.array:
    """`PreNormLayer.__call__(x, state)` on the host (see above)."""
    host_blas.one_thread()
    shape = x.shape
    rows = np.asarray(x).reshape(-1, shape[-1])
    norm, mixer = layer.input_layernorm, layer.mixer
    normed = host_blas.rms_norm_rows(rows, host_weight(norm), norm.eps)
    host = host_gdn if type(mixer) is host_gdn.GatedDeltaNet else host_attention
    return host_tail.finish(layer, rows, host.mix(mixer, normed, state), shape)
