"""Sparse MoE block: softmax router, top-k, optional renormalisation, optional shared expert.

Legend: N = tokens, E = experts, k = experts per token, H = hidden, I = expert hidden.
Routing is exact: every token takes its own softmax top-k, whatever is resident, unless a
routing policy is attached (`SparseMoeBlock.routing_policy`: approximate, opt-in, experts/moce.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_shaders import moe_combine, router_window
from metal_shaders import rows_matvec as kernels

from .compiled import traced_on_host
from .layers import (
    MLP,
    WINDOW_ROWS,
    RowLinear,
    RowSplit,
    by_row,
    host_window,
    is_cpu_prompt,
    kernel_rows,
    over_streams,
    project,
    stack,
    stacked,
    swiglu,
    transposed,
)
from .sigmoid_routing import GroupLimitedTopK


def sorted_gather_is_exact() -> bool:
    """Whether `mx.gather_mm` may be told its picks are sorted. MLX 0.32.4's CUDA `gather_mm`
    returns wrong products with `sorted_indices=True` (unquantized weights: 5.7 off a dense
    matmul on the H200, where the unsorted call and the sorted `gather_qmm` are exact;
    docs/mlx-bugs.md), so off the CPU sorted picks go unflagged: the same products, one pick at
    a time."""
    return mx.default_device() == mx.cpu


def gather_matmul(x: mx.array, w: mx.array, experts: mx.array, *, is_sorted: bool = True,
                  wt: mx.array | None = None) -> mx.array:
    """x (M, 1, A) @ w[experts]ᵀ, with w (E, B, A) -> (M, 1, B); `is_sorted`: `experts` ascending.

    `wt`: w with its last two axes swapped and contiguous, where the caller keeps one (the CPU's
    faster layout, `layers.Transposed`); the same sums.
    """
    is_sorted = is_sorted and sorted_gather_is_exact()
    if x.dtype == mx.float32 or mx.default_device() != mx.cpu:
        rhs = w.swapaxes(-1, -2) if wt is None else wt
        if wt is not None and is_sorted:  # a CPU prompt chunk: its picks over the prompt streams
            return over_streams(lambda xs, ids: mx.gather_mm(xs, wt, rhs_indices=ids, sorted_indices=True),
                                x, experts)
        return mx.gather_mm(x, rhs, rhs_indices=experts, sorted_indices=is_sorted)
    # MLX's CPU gather_mm takes float32 only: gather the matrices instead.
    return x @ w[experts].swapaxes(-1, -2)


class SwitchGLU(nn.Module):
    """E stacked SwiGLU experts; `gate_proj`/`up_proj` are (E, I, H), `down_proj` (E, H, I).
    `activation(gate, up)`: silu(gate) * up unless a family clamps it (DeepSeek-V4)."""

    expert_kind = "glu"  # its record kind when streamed (experts/store.py)

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, activation=swiglu):
        super().__init__()
        self.activation = activation
        self.gate_proj = mx.zeros((num_experts, expert_size, hidden_size))
        self.up_proj = mx.zeros((num_experts, expert_size, hidden_size))
        self.down_proj = mx.zeros((num_experts, hidden_size, expert_size))

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        # Prompt chunks on the CPU multiply by cached contiguous transposes: 1.5x faster there.
        cached = x.dtype == mx.float32 and is_cpu_prompt(x)

        def matmul(name, xs, experts, is_sorted):
            wt = transposed(self, name) if cached else None
            return gather_matmul(xs, self[name], experts, is_sorted=is_sorted, wt=wt)

        return glu_by_expert(x, inds, matmul, self.activation)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     projections: dict[str, dict] | None = None) -> "QuantizedSwitchGLU":
        """The same experts, affine-quantized (what `nn.quantize` calls); `projections` gives some
        projections their own {"group_size", "bits"} (mlx-lm's mixed recipes record them so)."""
        return QuantizedSwitchGLU(self, group_size=group_size, bits=bits, mode=mode, projections=projections)


class QuantizedExperts(nn.Module):
    """E quantized matrices (E, out, in) as mlx-lm stores them: packed `weight`, `scales`, `biases`."""

    def __init__(self, weight: mx.array, *, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        if mode != "affine":
            raise ValueError(f"quantized experts support mode 'affine' only, got {mode!r}")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits, mode=mode)

    def __call__(self, x: mx.array, experts: mx.array, *, is_sorted: bool = True) -> mx.array:
        """x (M, 1, in) @ dequantized weight[experts]ᵀ -> (M, 1, out); `is_sorted`: `experts` ascending."""
        return gather_qmatmul(x, self.weight, self.scales, self.biases, experts,
                              group_size=self.group_size, bits=self.bits, mode=self.mode, is_sorted=is_sorted)


def gather_qmatmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None, experts: mx.array,
                   *, group_size: int, bits: int, mode: str = "affine", is_sorted: bool = True) -> mx.array:
    """x (M, 1, in) @ dequantized weight[experts]ᵀ -> (M, 1, out); `is_sorted`: `experts` ascending.

    The matmul of `QuantizedExperts`, public so that streamed experts (experts/switch.py) run the
    very same call over their slot banks. A decode window's picks (`is_sorted` False, at most
    WINDOW_ROWS · k of them) take the routed-experts kernel of metal_shaders/rows_matvec.py where
    it runs: each pick reduced alone, in its own blocks.

    Window picks may also come as x (..., in) of R rows with k·R picks, k a row in order
    (`glu_by_expert`'s `shared_rows`): -> (..., k, out), each pick times its row, the same bits
    as the rows copied k times (the kernel reads the row; elsewhere the rows are copied here).
    """
    rows, picks = x.size // x.shape[-1], experts.size
    flat = experts if experts.ndim == 1 else experts.reshape(-1)  # a reshape is one more op: only where needed
    if not is_sorted and (picks != rows or x.ndim != 3 or x.shape[1] != 1):  # window picks in another shape
        if window_kernel_takes(x, weight, biases, picks, mode=mode, group_size=group_size, bits=bits):
            return kernels.rows_gather_qmatvec(x, weight, scales, biases, flat, group_size=group_size, bits=bits)
        k, lead, K = picks // rows, x.shape[:-1], x.shape[-1]
        xs = x if k == 1 else mx.broadcast_to(x.reshape(rows, 1, 1, K), (rows, k, 1, K))
        out = gather_qmatmul(xs.reshape(picks, 1, K), weight, scales, biases, flat,
                             group_size=group_size, bits=bits, mode=mode, is_sorted=False)
        return out.reshape(*lead, -1) if k == 1 else out.reshape(*lead, k, -1)
    if window_kernel_takes(x, weight, biases, picks, mode=mode, group_size=group_size, bits=bits, is_sorted=is_sorted):
        # (M, 1, in) -> (M, 1, out) as it stands: the kernel reads rows, a reshape is one more op.
        return kernels.rows_gather_qmatvec(x, weight, scales, biases, flat, group_size=group_size, bits=bits)
    if (not is_sorted and mode == "mxfp4" and x.ndim == 3 and x.shape[1] == 1 and x.shape[0] <= kernels.MAX_PICKS
            and weight.ndim == 3 and group_size == 32 and bits == 4 and RowSplit.mode != "never"
            and kernels.supports(x.shape[-1]) and kernels.kernels_usable(x.dtype)):
        # GPT-OSS's MXFP4 experts: MLX's CUDA gather_qmm changes kernels at 8 picks (a T >= 2 window).
        return kernels.rows_gather_mxfp4matvec(x, weight, scales, experts if experts.ndim == 1 else experts.reshape(-1))
    if (is_sorted and x.dtype == mx.float32 and is_cpu_prompt(x)
            and weight.size * 32 // bits * 4 <= CPU_PROMPT_DEQUANTIZE_BYTES):
        # A prompt chunk on the CPU: MLX's CPU quantized gather runs slower than dequantizing the
        # bank once per chunk and multiplying by its contiguous transpose (docs/benchmarks.md).
        # Streamed slot banks take this very call too, so they stay bit-identical to resident ones.
        dense = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=x.dtype)
        return gather_matmul(x, dense, experts, wt=mx.contiguous(dense.swapaxes(-1, -2)))
    return mx.gather_qmm(
        x, weight, scales, biases, rhs_indices=experts, transpose=True,
        group_size=group_size, bits=bits, mode=mode, sorted_indices=is_sorted,
    )


def window_kernel_takes(x: mx.array, weight: mx.array, biases: mx.array | None, picks: int, *, mode: str,
                       group_size: int, bits: int, is_sorted: bool = False, width: int | None = None) -> bool:
    """Whether the routed-experts kernel runs a window's `picks` unsorted picks of x's rows (a
    whole number of picks a row) over affine-quantized `weight` (E, out, in) on this device.
    `width`: the input width, where x is not yet the projection's input (default x's)."""
    rows = x.size // x.shape[-1]
    return (not is_sorted and mode == "affine" and biases is not None and weight.ndim == 3 and picks % rows == 0
            and picks <= kernels.MAX_PICKS and RowSplit.mode != "never"
            and kernels.supports(width or x.shape[-1], group_size=group_size, bits=bits)
            and kernels.kernels_usable(x.dtype))


CPU_PROMPT_DEQUANTIZE_BYTES = 64 * 2**20  # largest expert bank dequantized per prompt chunk (float32 bytes)
# How a GPU prompt chunk multiplies its routed picks (docs/benchmarks.md, "H200: routed experts as
# padded batches"): "padded" (each expert's picks as one row of a padded batch) or "gather"
# (mx.gather_qmm pick by pick, MLX's form).
GPU_PROMPT_EXPERTS = "padded"
PADDED_MAX_ROWS_PER_PICK = 8  # a batch padded beyond this many rows per pick (skewed routing) gathers instead


class QuantizedSwitchGLU(nn.Module):
    """`SwitchGLU` with quantized experts, run through `mx.gather_qmm`."""

    expert_kind = "glu"

    def __init__(self, glu: SwitchGLU, *, group_size: int, bits: int, mode: str = "affine",
                 projections: dict[str, dict] | None = None):
        super().__init__()
        self.activation = glu.activation
        for name in ("gate_proj", "up_proj", "down_proj"):
            own = (projections or {}).get(name, {})
            setattr(self, name, QuantizedExperts(glu[name], group_size=own.get("group_size", group_size),
                                                 bits=own.get("bits", bits), mode=mode))

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        """x (N, H), inds (N, k) -> per-pick outputs (N, k, H)."""
        shared_rows = self.takes_shared_rows(x, inds)
        gate_up = self.gate_up if shared_rows and self.takes_gate_up(x) else None
        return glu_by_expert(x, inds, lambda name, xs, experts, is_sorted: self[name](xs, experts, is_sorted=is_sorted),
                             self.activation, shared_rows=shared_rows, gate_up=gate_up)

    def takes_gate_up(self, x: mx.array) -> bool:
        """Whether the GLU kernel (`gate_up`) may join a window's gate and up projections: SwiGLU
        (not a family's clamped form), both of one quantization, a dtype whose GLU probe passed.
        Asked once `takes_shared_rows` holds (so each projection takes the routed-experts kernel)."""
        gate, up = self.gate_proj, self.up_proj
        return (self.activation is swiglu and (gate.group_size, gate.bits) == (up.group_size, up.bits)
                and gate.scales.dtype == up.scales.dtype and kernels.glu_usable(x.dtype))

    def gate_up(self, x: mx.array, experts: mx.array) -> mx.array:
        """silu(gate) * up of a window's picks (x's rows, k picks a row) in one launch."""
        gate, up = self.gate_proj, self.up_proj
        return kernels.rows_gather_glu_qmatvec(x, (gate.weight, gate.scales, gate.biases),
                                               (up.weight, up.scales, up.biases), experts, group_size=gate.group_size,
                                               bits=gate.bits)

    def takes_shared_rows(self, x: mx.array, inds: mx.array) -> bool:
        """Whether a decode window's picks go to the routed-experts kernel with x's rows as they are
        (`glu_by_expert`'s `shared_rows`): every projection takes the kernel here."""
        return inds.size // inds.shape[-1] <= WINDOW_ROWS and all(
            window_kernel_takes(x, p.weight, p.get("biases"), inds.size, mode=p.mode, group_size=p.group_size,
                                bits=p.bits, width=p.weight.shape[-1] * 32 // p.bits)
            for p in (self.gate_proj, self.up_proj, self.down_proj))


def glu_by_expert(x: mx.array, inds: mx.array, matmul, activation=swiglu, *, window: bool | None = None,
                  shared_rows: bool = False, gate_up=None) -> mx.array:
    """SwiGLU over each token's picked experts; `matmul(name, xs, experts, is_sorted)` does one
    projection, `activation(gate, up)` joins the two (elementwise; GPT-OSS clamps it).
    x (..., H) and inds (..., k) share their leading axes (N tokens in all) -> (..., k, H).

    Also the compute of streamed experts (experts/switch.py), with slot ids for `inds`: keeping
    one code path is what makes them bit-identical to resident ones. `window` (default: N at most
    WINDOW_ROWS) says whether the picks belong to a decode window; a streamed window served in
    several passes sends a pass's picks as rows of one pick each, more than WINDOW_ROWS of them.
    `shared_rows`: a window's `matmul` takes x's rows as they are, k picks a row in order
    (`gather_qmatmul`'s shared rows, the routed-experts kernel), and gives (..., k, out): no copy
    of each row per pick, no reshapes (4 ops fewer a layer; the same bits). `gate_up(x, experts)`,
    where given with `shared_rows`: activation(gate, up) of those picks in one launch (the GLU
    kernel: 2 ops fewer a layer).
    """
    k = inds.shape[-1]
    N = inds.size // k
    flat = inds.reshape(-1)
    if N <= WINDOW_ROWS if window is None else window:
        # A decode window: each pick in row order, never grouped by the other rows' choices, so a
        # row's arithmetic is what it is alone (docs/design.md, "Row invariance"). Shapes as they
        # come, so a window's views are few (a step is bound by op count): a reshape, a broadcast, its copy.
        if shared_rows:
            h = (gate_up(x, flat) if gate_up is not None
                 else activation(matmul("gate_proj", x, flat, False), matmul("up_proj", x, flat, False)))
            return matmul("down_proj", h, flat, False)
        H = x.shape[-1]
        xs = mx.broadcast_to(x.reshape(N, 1, 1, H), (N, k, 1, H)).reshape(N * k, 1, H)
        h = activation(matmul("gate_proj", xs, flat, False), matmul("up_proj", xs, flat, False))
        return matmul("down_proj", h, flat, False).reshape(*inds.shape, -1)
    shape = inds.shape
    if inds.ndim != 2:
        x, inds = x.reshape(N, -1), inds.reshape(N, k)
    if GPU_PROMPT_EXPERTS == "padded" and mx.default_device() != mx.cpu:
        out = glu_padded(x, inds, matmul, activation)
        if out is not None:
            return out.reshape(*shape, -1)
    # Sorting by expert keeps each expert's rows together, so each is read once, in order.
    order = mx.argsort(flat)
    experts = flat[order]
    xs = x[order // k][:, None, :]  # (N·k, 1, H)
    h = activation(matmul("gate_proj", xs, experts, True), matmul("up_proj", xs, experts, True))
    out = matmul("down_proj", h, experts, True)  # (N·k, 1, H)
    return out[mx.argsort(order)].reshape(*shape, -1)


def glu_padded(x: mx.array, inds: mx.array, matmul, activation=swiglu) -> mx.array | None:
    """`glu_by_expert` for GPU prompt chunks, in `padded_by_expert`'s batches."""
    def experts_of(xs: mx.array, experts: mx.array) -> mx.array:
        h = activation(matmul("gate_proj", xs, experts, True), matmul("up_proj", xs, experts, True))
        return matmul("down_proj", h, experts, True)
    return padded_by_expert(x, inds, experts_of)


def padded_by_expert(x: mx.array, inds: mx.array, experts_of) -> mx.array | None:
    """Routed experts for GPU prompt chunks: each used expert's picks gathered into one row of
    a zero-padded (E, C, H) batch, C the most picks of any expert, so that each projection is one
    batched matmul of E problems of C rows (MLX's CUDA gather_qmm otherwise runs every pick as a
    one-row problem: 4x slower on an 80B-A3B layer). `experts_of(xs (E, C, H), experts (E,))`
    runs the experts (E, C, H) on it. The routing is read on the host once per call to size the
    batch; None (the caller gathers) when routing so skewed that the batch would exceed
    PADDED_MAX_ROWS_PER_PICK rows per pick.
    """
    N, k = inds.shape
    flat = np.asarray(inds).reshape(-1)
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    E = int(ids[-1]) + 1
    counts = np.bincount(ids, minlength=E)
    C, P = int(counts.max()), flat.size
    if E * C > PADDED_MAX_ROWS_PER_PICK * P:
        return None
    slot = ids * C + np.arange(P) - (np.cumsum(counts) - counts)[ids]  # padded row of each sorted pick
    rows = np.full(E * C, N, dtype=np.uint32)  # the token each padded row takes; N: a zero row
    rows[slot] = order // k
    x = mx.concatenate([x, mx.zeros((1, x.shape[-1]), dtype=x.dtype)])
    xs = x[mx.array(rows)].reshape(E, C, -1)
    out = experts_of(xs, mx.arange(E, dtype=mx.uint32)).reshape(E * C, -1)
    where = np.empty(P, dtype=np.uint32)
    where[order] = slot  # the padded row of each pick, in (token, k) order
    return out[mx.array(where)].reshape(N, k, -1)


class SparseLayerRule:
    """Qwen's rule for which decoder layers are sparse, mixed into its configs: every
    `decoder_sparse_step`-th layer, except `mlp_only_layers`, when there are experts."""

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )


class SigmoidTopkRouter(nn.Module):
    """DeepSeek-V3-style routing (Nemotron-H, GLM-4.x MoE; transformers' `*TopkRouter`): sigmoid
    scores; the top-k of score + `e_score_correction_bias` among the `topk_group` groups of experts
    whose two best biased scores sum highest; the picks weigh their unbiased scores, renormalised
    (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`. In float32, as transformers
    keeps the router.

    Calling it gives the logits (N, E), as a linear router does (the expert cache's prefetch ranks
    experts by them); `select` routes."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..the number of experts ({num_experts})")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts must split into n_group ({n_group}) groups, of which "
                             f"topk_group ({topk_group}) are kept")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the experts of topk_group ({topk_group}) groups")
        self.top_k = top_k
        self.rule = GroupLimitedTopK(top_k, n_group, topk_group, norm_topk_prob, float(routed_scaling_factor))
        self.weight = mx.zeros((num_experts, hidden_size))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        """x (N, H) -> router logits (N, E), float32. A decode window's rows go to the
        row-invariant kernel in one call where it runs (a GPU), not one matmul per row."""
        x, weight = x.astype(mx.float32), self.weight.astype(mx.float32)
        if kernel_rows(x) and kernels.supports(x.shape[-1]):
            return kernels.rows_matvec(x, weight)
        return by_row(lambda rows: rows @ weight.T, x)

    def scores(self, x: mx.array) -> mx.array:
        """x (N, H) -> sigmoid scores (N, E), float32."""
        return mx.sigmoid(self(x))

    def select(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k), float32."""
        return self.rule(self.scores(x), self.e_score_correction_bias)


class SparseMoeBlock(nn.Module):
    """Router, routed experts (`switch_mlp`) and optional shared expert.

    Hook for streamed experts: `switch_mlp` is any module with the `(x (N, H), inds (N, k)) ->
    (N, k, H)` contract; experts/switch.py swaps in a `StreamedSwitchGLU` that serves the experts
    from disk through a bounded cache. Routing stays here, so it never depends on residency.

    Hook for approximate routing: `routing_policy`, None (exact) or a callable `(probs (N, E)
    float32, top_k) -> (inds (N, k), mask (N, k))` that experts/moce.py attaches when the user
    opts in; masked-off picks get weight 0. The block knows nothing of what the policy consults.
    """

    routing_policy = None
    takes_routing_policy = True  # False where `route` has no softmax probabilities to hand a policy
    experts_attribute = "switch_mlp"  # where the routed experts sit (experts/ streams them from there)

    def __init__(
        self,
        *,
        hidden_size: int,
        expert_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_size: int = 0,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = RowLinear(hidden_size, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden_size, expert_size, num_experts)
        if shared_expert_size:
            self.shared_expert = MLP(hidden_size, shared_expert_size)
            self.shared_expert_gate = RowLinear(hidden_size, 1, bias=False)

    @property
    def compilable(self) -> bool:
        """Whether a decode window may run this block inside an `mx.compile` trace
        (model/compiled.py): not when routing or the experts consult the expert cache, whose
        contents a trace would freeze."""
        return self.routing_policy is None and type(self.switch_mlp) in (SwitchGLU, QuantizedSwitchGLU)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, H) -> expert ids (N, k) and their weights (N, k), float32."""
        return self.route_logits(self.gate(x))

    def route_logits(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The router's logits (N, E) -> expert ids (N, k) and their weights (N, k), float32."""
        inds, weights = self.picks(logits)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return inds, weights

    def picks(self, logits: mx.array, stacked: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The router's logits (..., E) -> expert ids (..., k) and their softmax probabilities
        (..., k), float32, not yet renormalised (`route_logits` divides by their sum;
        `routed` folds that division into its weighted sum, the same arithmetic). Exact routing of
        a window on a GPU runs all of it in one kernel (`router_kernel_takes`), the picks then in
        descending probability; elsewhere in MLX ops, the picks in argpartition's order.
        `stacked`: the stacked router's whole output whose first E columns `logits` are; the
        kernel reads them there (the slice is a strided view, which it would copy first)."""
        if self.routing_policy is None and router_kernel_takes(logits, self.top_k):
            rows = logits if stacked is None else stacked
            return router_window.router_window(rows, self.top_k, experts=logits.shape[-1])
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        if self.routing_policy is None:
            # The k largest at the end of an ascending partition: one op fewer than negating.
            E = probs.shape[-1]
            inds = mx.argpartition(probs, kth=E - self.top_k, axis=-1)[..., E - self.top_k:]
            return inds, mx.take_along_axis(probs, inds, axis=-1)
        inds, mask = self.routing_policy(probs, self.top_k)
        return inds, mx.take_along_axis(probs, inds, axis=-1) * mask

    @property
    def folds_residual(self) -> bool:
        """Whether a call takes the decoder layer's residual (`__call__`'s `residual`): only where
        the class keeps this `__call__` (a family's own takes x alone)."""
        return type(self).__call__ is SparseMoeBlock.__call__

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """x (..., H) -> the block's output (..., H); plus `residual` (x's shape: the decoder
        layer's stream) where given, added inside the combine kernel where it runs (the bits of
        the add it saves, one launch fewer a layer), else by one add."""
        shape = x.shape
        if "shared_expert" not in self:
            x = x.reshape(-1, shape[-1])
            inds, weights = self.route(x)
            picks = self.switch_mlp(x, inds)
            out = kernel_combine(picks, weights, shape, residual)
            return plus(residual, weighted_sum(picks, weights).reshape(shape)) if out is None else out
        shared = self.shared_expert
        if not host_window(x):
            router, inputs = stacked(self, "_router_rows"), stacked(self, "_shared_rows")
            if router is not None and inputs is not None:
                if not self.compilable:  # streamed experts and routing policies take (N, H) rows
                    x = x.reshape(-1, shape[-1])
                both, (logits, shared_gate) = router.outputs(x)
                inds, weights = self.picks(logits, both)
                picks = self.switch_mlp(x, inds)
                shared_out = shared.down_proj(shared.activated(x, inputs))
                gate_column = router.bounds[0]  # the gate's column of the stacked output: after the E logits
                out = kernel_combine(picks, weights, shape, residual, normalize=self.norm_topk_prob, shared=shared_out,
                                     gates=both, gate_column=gate_column)
                if out is None:
                    out = add_gated(picks_sum(picks, weights, normalize=self.norm_topk_prob), shared_out, shared_gate)
                    out = plus(residual, in_shape(out, shape))
                return out
        # The router and the shared expert's input projections read x together (`project`).
        x = x.reshape(-1, shape[-1])
        logits, gate, up, shared_gate = project(x, self.gate, shared.gate_proj, shared.up_proj,
                                                self.shared_expert_gate)
        y = self.routed_rows(x, logits)
        return plus(residual, add_gated(y, shared.down_proj(swiglu(gate, up)), shared_gate).reshape(shape))

    def stack_linears(self) -> None:
        """Stack the linears that read the block's input where their forms allow
        (`layers.StackedRows`): the router with the shared expert's gate, the shared expert's gate
        with its up projection. Called once the weights are loaded (`layers.stack_rows`)."""
        if "shared_expert" in self:
            stack(self, "_router_rows", "gate", "shared_expert_gate")
            stack(self, "_shared_rows", "shared_expert.gate_proj", "shared_expert.up_proj")

    def routed_rows(self, x: mx.array, logits: mx.array) -> mx.array:
        """`routed`, traced where the layer ends run eagerly (the CPU's host path) and nothing
        in it consults the expert cache."""
        if self.compilable:
            return traced_on_host(self, "_routed", self.routed, x.shape[0], x.dtype)(x, logits)
        return self.routed(x, logits)

    def routed(self, x: mx.array, logits: mx.array) -> mx.array:
        """x (..., H) and the router's logits (..., E) -> the routed experts' weighted sum (..., H)."""
        inds, weights = self.picks(logits)
        return picks_sum(self.switch_mlp(x, inds), weights, normalize=self.norm_topk_prob)


def router_kernel_takes(logits: mx.array, top_k: int) -> bool:
    """Whether a window's router logits (..., E) go to the router kernel (metal_shaders/router_window.py:
    softmax and top-k in one launch, each row alone) on this device: a window's rows, a shape it
    takes, a dtype whose probe passed. Serial 1-row steps go there too, so they share its arithmetic."""
    rows = logits.size // logits.shape[-1] if logits.ndim else 0
    return (RowSplit.kernel_may_take(rows) and router_window.takes(logits, top_k)
            and router_window.usable(logits.dtype))


def combine_kernel_takes(picks: mx.array, weights: mx.array, shared: mx.array | None = None,
                         gates: mx.array | None = None, gate_column: int = 0) -> bool:
    """Whether a window's picks (..., k, H) are combined by the combine kernel
    (metal_shaders/moe_combine.py: the weighted sum, its renormalisation, a shared expert's
    gated output and the layer's residual in one launch, each row alone) on this device: a
    window's rows, arrays it takes, a dtype whose probe passed. Serial 1-row steps go there too,
    so they share its arithmetic."""
    rows = picks.size // (picks.shape[-2] * picks.shape[-1]) if picks.ndim >= 2 else 0
    return (RowSplit.kernel_may_take(rows) and moe_combine.takes(picks, weights, shared, gates, gate_column)
            and moe_combine.usable(picks.dtype))


def kernel_combine(picks: mx.array, weights: mx.array, shape: tuple, residual: mx.array | None = None,
                   **combine) -> mx.array | None:
    """The combine kernel's output (`combine`: `moe_combine`'s keywords) in `shape`, plus
    `residual` (in `shape`) where given, or None where the kernel does not take the picks (the
    caller combines with MLX's ops). The residual goes into the launch where the kernel takes
    it (as the output's rows: a view where the picks' rows are shaped otherwise), else one add."""
    shared, gates, gate_column = combine.get("shared"), combine.get("gates"), combine.get("gate_column", 0)
    if not combine_kernel_takes(picks, weights, shared, gates, gate_column):
        return None
    rows = None if residual is None else in_shape(residual, (*picks.shape[:-2], picks.shape[-1]))
    if rows is not None and moe_combine.takes(picks, weights, shared, gates, gate_column, rows):
        return in_shape(moe_combine.moe_combine(picks, weights, residual=rows, **combine), shape)
    return plus(residual, in_shape(moe_combine.moe_combine(picks, weights, **combine), shape))


def in_shape(a: mx.array, shape: tuple) -> mx.array:
    """`a` in `shape`: no Reshape op where it has that shape already (a step is bound by op count)."""
    return a if a.shape == tuple(shape) else a.reshape(shape)


def plus(residual: mx.array | None, out: mx.array) -> mx.array:
    """residual + out (the decoder layer's add), or out where there is no residual."""
    return out if residual is None else residual + out


def picks_sum(picks: mx.array, weights: mx.array, *, normalize: bool = False) -> mx.array:
    """picks (..., k, H) weighted by weights (..., k), over their sum where `normalize`, summed
    over k: the combine kernel where it takes the window, else MLX's compiled ops."""
    if normalize and combine_kernel_takes(picks, weights):
        return moe_combine.moe_combine(picks, weights, normalize=True)
    if normalize and picks.shape[-2] > 1:
        return normalized_picks_sum(picks, weights)
    if normalize:  # k = 1: no shapeless sum over a length-1 axis (see weighted_sum)
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weighted_sum(picks, weights)


def weighted_sum(picks: mx.array, weights: mx.array) -> mx.array:
    """picks (..., k, H) weighted by weights (..., k) and summed over k: the combine kernel
    where it takes the window (a GPU's decode rows, float32 weights), else one compiled kernel.

    With k = 1 the sum is the one weighted pick, taken without a reduction: MLX 0.32.4 crashes on
    a shapeless-compiled sum over a length-1 axis (docs/mlx-bugs.md). Summing one value adds
    nothing, so both forms give the same bits.
    """
    if combine_kernel_takes(picks, weights):
        return moe_combine.moe_combine(picks, weights)
    if picks.shape[-2] == 1:
        return scaled(picks.reshape(*picks.shape[:-2], picks.shape[-1]), weights)
    return weighted_picks_sum(picks, weights)


@partial(mx.compile, shapeless=True)
def normalized_picks_sum(picks: mx.array, weights: mx.array) -> mx.array:
    """picks (..., k, H) weighted by weights (..., k) over their sum, summed over k: the
    renormalisation's division folded into the product's kernel (the same float32 quotient)."""
    weights = weights[..., None]  # expanded first, so the division fuses with the product
    weights = weights / weights.sum(axis=-2, keepdims=True)
    return (picks * weights.astype(picks.dtype)).sum(axis=-2)


@partial(mx.compile, shapeless=True)
def weighted_picks_sum(picks: mx.array, weights: mx.array) -> mx.array:
    return (picks * weights[..., None].astype(picks.dtype)).sum(axis=-2)


@partial(mx.compile, shapeless=True)
def scaled(x: mx.array, weight: mx.array) -> mx.array:
    """x (..., H) times weight (..., 1), in x's dtype."""
    return x * weight.astype(x.dtype)


@partial(mx.compile, shapeless=True)
def add_gated(y: mx.array, x: mx.array, gate: mx.array) -> mx.array:
    """y + x · sigmoid(gate) (`sigmoid_gate`, then the add) in one compiled kernel."""
    return y + x * mx.sigmoid(gate)
