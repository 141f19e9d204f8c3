"""How well installed models copy text they cannot predict (the model card's random-span figure).

    python -m scripts.train.span_copy strata_cli/assets/demo OTHER_MODEL --data .train-data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from scripts.train.model_card import SPAN_LENGTHS, span_copy_accuracy
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--data", type=Path, default=Path(".train-data"), help="held-out tokens (val.bin) are here")
    parser.add_argument("--spans", type=int, default=5, help="spans of each length (default 5)")
    args = parser.parse_args()
    val = np.fromfile(args.data / "val.bin", dtype=np.uint16)
    for model in args.models:
        engine = open_model(LoadOptions(model=str(model), dtype="float32")).engine
        figures = {str(n): round(span_copy_accuracy(engine, val, n, args.spans), 3) for n in SPAN_LENGTHS}
        print(json.dumps({"model": str(model), "random_span_copy": figures}), flush=True)


if __name__ == "__main__":
    main()
