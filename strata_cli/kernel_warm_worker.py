"""One worker of the parallel kernel warm-up (kernel_warm.py): load only the layers its units
need, run each unit on scratch state, print one JSON line per unit done.

    python -m strata_cli.kernel_warm_worker --model DIR --units JSON --options JSON [--dtype D]

A layer unit runs the layer that stands for its kind through a window engine of its own, with
random hidden states in place of the layers before it: `WindowEngine.warm` (a window keeping one
row, one keeping every row, the one-row window that folds) or `WindowEngine.prefill` (one prompt
chunk), so the layer's calls are the ones the parent's engine makes, compiled traces included.
The head unit runs the embedding, final norm and logits the same way. Exits 0 when every unit ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .distributed import prune
from .engine.window import WindowEngine
from .kernel_cache import prepare_kernel_cache
from .kernel_warm import HEAD, LAYER, Unit
from .model.loader import compute_dtype, load_model
from .options import EngineOptions


def state_kinds_of(model, layers) -> dict[int, list]:
    """Each of `layers`' state kinds (read on the whole model, before any layer is dropped)."""
    return {i: list(model.state_kinds[model.state_span(i, i + 1)]) for i in layers}


class Pick:
    """`load_model`'s `select`: keep `layers` (and, with `head`, everything outside the layers),
    after noting every kept layer's state kinds (which need the whole model to read)."""

    def __init__(self, layers: set[int], head: bool):
        self.layers, self.head = layers, head
        self.kinds: dict[int, list] = {}
        self.prefix = ""

    def select(self, model):
        self.kinds = state_kinds_of(model, self.layers)
        layers_path = next(path for path, module in model.named_modules() if module is model.layers[0])
        self.prefix = layers_path.rsplit(".", 1)[0] + "."
        for i in range(len(model.layers)):
            if i not in self.layers:
                model.layers[i] = nn.Module()
        if not self.head:
            prune(model, "", self.prefix)
        return self.holds

    def holds(self, name: str) -> bool:
        if name.startswith(self.prefix):
            layer = name[len(self.prefix):].split(".", 1)[0]
            return layer.isdigit() and int(layer) in self.layers
        return self.head


class Piece:
    """One layer (`layer` >= 0) or the head of `model`, as a window engine's model: tokens in,
    the piece's output as the "logits" (a layer's input is random hidden states)."""

    def __init__(self, model, layer: int, kinds: list, dtype: mx.Dtype):
        self.model, self.layer, self.dtype = model, layer, dtype
        self.config = model.config
        self.state_kinds = kinds

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        if self.layer < 0:
            return self.model.head(self.model.embed(tokens), last_only=last_only)
        B, T = tokens.shape
        h = mx.random.normal((B, T, self.config.hidden_size), key=mx.random.key(T)).astype(self.dtype)
        h = self.model.run_layers(h, states, self.layer, self.layer + 1)
        return h[:, -1:] if last_only else h


def run_unit(engine: WindowEngine, unit: Unit) -> float:
    """Run `unit` on `engine` (empty before and after); the seconds it took."""
    start = time.perf_counter()
    if unit.prompt:
        engine.prefill([i % engine.vocab_size for i in range(unit.rows)], chunk=unit.rows)
        engine.reset()
    else:
        engine.warm(unit.rows)
    return time.perf_counter() - start


def engines_for(model, units: list[Unit], kinds: dict[int, list], options: EngineOptions) -> dict[tuple, WindowEngine]:
    """One window engine per piece of `units`, keyed (piece, layer)."""
    dtype = compute_dtype(model)
    engines = {}
    for unit in units:
        key = (unit.piece, unit.layer)
        if key in engines:
            continue
        piece = Piece(model, unit.layer, kinds[unit.layer], dtype) if unit.piece == LAYER else Piece(model, -1, [], dtype)
        engines[key] = WindowEngine(piece, options)
    return engines


def run_units(model, units: list[Unit], kinds: dict[int, list], options: EngineOptions, report=print) -> None:
    """Run every unit in order, calling `report(json line)` after each."""
    engines = engines_for(model, units, kinds, options)
    for unit in units:
        seconds = run_unit(engines[unit.piece, unit.layer], unit)
        report(json.dumps({"unit": unit.name, "seconds": round(seconds, 3)}))


def load_for(path: Path, units: list[Unit], dtype: str | None):
    """The model with only what `units` run loaded, and each kept layer's state kinds."""
    pick = Pick({u.layer for u in units if u.piece == LAYER}, head=any(u.piece == HEAD for u in units))
    model = load_model(path, dtype=dtype, select=pick.select)
    return model, pick.kinds


def die_with_parent(parent: int | None) -> None:
    """End this worker when the process that launched it ends (a killed `strata generate` must
    not leave its workers compiling): Linux's parent-death signal, checked once against a
    parent gone already."""
    if parent is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's timeout still ends it
        pass
    if os.getppid() != parent:
        os._exit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--units", required=True, help="JSON list of kernel_warm.Unit fields")
    parser.add_argument("--options", default="{}", help="JSON EngineOptions fields")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--parent", type=int, default=None, help="end when this process ends")
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    prepare_kernel_cache()  # strata's own kernels and verdicts kept beside the parent's
    units = [Unit(**u) for u in json.loads(args.units)]
    model, kinds = load_for(args.model, units, args.dtype)
    run_units(model, units, kinds, EngineOptions(**json.loads(args.options)),
              report=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
