"""Lab code outside the wheel: benchmarks, demo-model training and one-off studies; run from the repo root as `python -m scripts.FOLDER.NAME`."""
