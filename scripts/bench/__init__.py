"""Measurements: benchmarks of strata (and mlx-lm beside it) and the random-weight models they and the tests use."""
