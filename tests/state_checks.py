"""What the rollback tests compare against: serial decoding's logits and committed state, token by
token, and the largest difference between two engines' state tensors."""

import random

import mlx.core as mx

from strata_cli.engine.window import WindowEngine


def max_state_diff(a: list[dict], b: list[dict]) -> float:
    """The largest absolute difference between two `engine.state_tensors()` (same layers, same
    tensors, same shapes: asserted)."""
    worst = 0.0
    assert len(a) == len(b)
    for layer_a, layer_b in zip(a, b):
        assert layer_a.keys() == layer_b.keys()
        for name in layer_a:
            assert layer_a[name].shape == layer_b[name].shape, name
            worst = max(worst, float(mx.abs(layer_a[name] - layer_b[name]).max()))
    return worst


def serial_decode(model, length: int, *, seed: int = 1234):
    """Serial T=1 decoding of a fixed random sequence: (seq, logits, states) after each token."""
    rng = random.Random(seed)
    seq = [rng.randrange(model.config.vocab_size) for _ in range(length)]
    engine = WindowEngine(model)
    logits, states = [], []
    for pos, token in enumerate(seq):
        out = engine.run([token], pos)
        engine.commit(1)
        logits.append(out.logits[0])
        states.append(engine.state_tensors())
    return seq, logits, states
