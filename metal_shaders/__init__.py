"""Kernels of strata's decode-window hot path.

Each kernel is one body that compiles for CUDA (`mx.fast.cuda_kernel`) and Metal
(`mx.fast.metal_kernel`) behind a thin per-backend prelude (`backends`), and has a pure-MLX
reference that the tests hold it to and that runs where no kernel can (the CPU).
`rows_matvec`: matrix × up to 8 rows, each row reduced in a fixed order whatever the row count.
`rows_mma`: the same projections on tensor cores (CUDA, bfloat16), every call 8 rows wide.
`gdn_window`: the GDN layer's decode window in two kernels. `mamba2_window`: the Mamba-2 layer's
decode window in two kernels. `attention_window`: a window's query
rows over the KV cache in one kernel, a block per row. `router_window`: a MoE router's softmax
and top-k in one kernel, a block per row. `add_norm`: a pre-norm layer's residual add and the
RMSNorm after it in one kernel, a block per row. `moe_combine`: a MoE layer's weighted sum of its picks
(renormalised or not, plus a shared expert's gated output) in one kernel, a thread an element.
`gated_norm`: a recurrent layer's gated RMSNorm over groups of channels (GDN's heads, Mamba-2's
groups) in one kernel, a block per row's group. `attention_prep`: an attention head after its
stacked projection (the gate taken from q, q/k norms, rotary at the row's position, the heads-first
layouts) in one kernel, a block per row's head. `embed_rows`: an affine-quantized embedding's
lookup (the rows gathered and dequantized, MLX's bits) in one kernel, a thread per packed word.
`pooled`: a window's ids joined from MLX's pooled pieces, and what the host reads back split into
them, each in one launch (CUDA). `argmax_rows`: a window's greedy tokens, a warp a chunk of a row
then a warp a row, written into the pool (CUDA).
"""
