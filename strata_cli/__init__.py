"""strata: sparse MoE models on MLX, with lossless suffix-lookup speculative decoding."""

__version__ = "0.1.0"
