"""Small synthetic checkpoints in strata's format, plain and streamed (`convert --stream`).

Used by the expert-streaming tests (test_stream_*.py, test_experts*.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.convert import convert
from strata_cli.model.layout import to_mlx_layout
from strata_cli.model.loader import FORMAT_KEY, FORMAT_VERSION
from strata_cli.options import ConvertOptions

NUM_EXPERTS, TOP_K = 32, 4


def save_strata_checkpoint(model, path: Path) -> Path:
    """A model as a checkpoint in strata's own format (its parameters in mlx-lm's layout)."""
    path.mkdir(parents=True)
    params = {k: v for k, v in dataclasses.asdict(model.config).items() if v is not None}
    params.update({FORMAT_KEY: FORMAT_VERSION, "dtype": "float32"})
    (path / "config.json").write_text(json.dumps(params))
    mx.save_safetensors(str(path / "model.safetensors"), to_mlx_layout(dict(tree_flatten(model.parameters()))))
    return path


def build_pair(root: Path, *, seed: int = 3, bits: int | None = None, group_size: int = 64,
               **overrides) -> tuple[Path, Path]:
    """(full, streamed) checkpoints of one random tiny Qwen3-Next (32 experts, top-4 by default).

    With `bits`, `convert` quantizes both the same way (the full one keeps its experts in
    safetensors), so they are the same model.
    """
    config = tiny_qwen3_next_config(num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, **overrides)
    source = save_strata_checkpoint(random_model(config, seed=seed), root / "source")
    full, streamed = root / "full", root / "streamed"
    # model-only: the tests bring their own tokenizers
    convert(source, full, options=ConvertOptions(bits=bits, group_size=group_size), require_tokenizer=False)
    convert(source, streamed, options=ConvertOptions(bits=bits, group_size=group_size, stream=True),
            require_tokenizer=False)
    return full, streamed
