"""strata: sparse MoE models on MLX, with lossless suffix-lookup speculative decoding."""

import os

# MLX runs float32 matmuls at TF32 precision on CUDA (and on Metal's neural-accelerator route)
# unless told otherwise; that rounding differs between one-row and many-row kernels and flips
# near-tie greedy tokens between serial and speculative decoding. Full float32 is the default
# here; set MLX_ENABLE_TF32=1 yourself to trade that away for speed. Must precede `import mlx`.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"
