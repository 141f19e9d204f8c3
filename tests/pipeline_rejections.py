"""Forced rejections across ranks, run by tests/test_pipeline_ranks.py under `mlx.launch`.

Rank 0 holds the demo model's first stage and, for reference, the whole model in one engine.
Both engines take the same calls: every keep of every window T = 2..8 (T = 3 and 8 in partial
mode), its rejected drafts made wrong, then the next one-row window. Every row's logits must be the
single engine's bit for bit (the other rank's states decide them), and rank 0's own layers'
state the single engine's.
(tests/test_window_rollback.py checks the single engine against serial decoding.) Prints
"checked N" on success.
"""

import random
import sys

import mlx.core as mx
from state_checks import max_state_diff

from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions, LoadOptions
from strata_cli.runtime import load_checkpoint, open_model


def main() -> int:
    runtime = open_model(LoadOptions(), EngineOptions())
    if runtime.follower is not None:
        return runtime.follower.serve()
    pipeline = runtime.model
    held = len(pipeline.stage.kinds)
    whole = load_checkpoint(runtime.path)
    vocab = pipeline.config.vocab_size
    rng = random.Random(7)
    seq = [rng.randrange(vocab) for _ in range(48)]
    checked = 0
    for partial, pos0, sizes in ((False, 18, range(2, 9)), (True, 27, (3, 8))):
        options = EngineOptions(partial=partial)
        engines = (WindowEngine(pipeline, options), WindowEngine(whole, options))
        starts = []
        for engine in engines:
            engine.prefill(seq[:pos0])
            starts.append(engine.snapshot())
        for T in sizes:
            for keep in range(1, T + 1):
                wrong = [(t + 1 + i) % vocab for i, t in enumerate(seq[pos0 + keep: pos0 + T])]
                calls = [(seq[pos0: pos0 + keep] + wrong, pos0, keep), ([seq[pos0 + keep]], pos0 + keep, 1)]
                for engine, start in zip(engines, starts):
                    engine.restore(start)
                for tokens, at, kept in calls:
                    out = [engine.run(tokens, at) for engine in engines]
                    assert mx.array_equal(out[0].logits, out[1].logits).item(), (partial, T, keep, at)
                    for engine in engines:
                        engine.commit(kept)
                    mine, ref = engines[0].state_tensors()[:held], engines[1].state_tensors()[:held]
                    assert max_state_diff(mine, ref) == 0.0, (partial, T, keep, at)
                checked += 1
    print(f"checked {checked}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
