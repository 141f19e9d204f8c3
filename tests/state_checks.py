"""What the rollback tests compare against: serial decoding's logits and committed state, token by
token, the largest difference between two engines' state tensors, and a prefix checkpoint and
session file of the state brought back."""

import random

import mlx.core as mx

from strata_cli.engine.window import WindowEngine
from strata_cli.options import EngineOptions

# Where the forced-rejection windows start, for states with neither a ring nor blocks (KV, latent
# KV, GDN, KDA, Mamba-2): none of them branches on pos0. A window writes at pos0 into one buffer
# (KV_STEP = 256 cells, far past these), and a prefill of fewer than PREFILL_MIN_ROWS = 16 rows
# takes the per-row path (scans and attention), so pos0 = 8..11 ran the same code on other data;
# the two ends are kept. Ring and block states (sliding_state, compressed_state) branch on
# pos0 % capacity or % rate, and their tests keep every offset.
REJECTION_OFFSETS = (8, 11)


def one_window(model, prompt=(3, 14, 15, 92, 65, 35), window=(89, 79, 32, 38, 46)):
    """A fresh engine's window after `prompt`: its logits (numpy) and greedy tokens."""
    import numpy as np

    engine = WindowEngine(model, EngineOptions())
    engine.prefill(list(prompt))
    out = engine.run(list(window), engine.length)
    return np.array(out.logits), out.tokens


def max_state_diff(a: list[dict], b: list[dict]) -> float:
    """The largest absolute difference between two `engine.state_tensors()` (same layers, same
    tensors, same shapes: asserted)."""
    worst = 0.0
    assert len(a) == len(b)
    for layer_a, layer_b in zip(a, b):
        assert layer_a.keys() == layer_b.keys()
        for name in layer_a:
            assert layer_a[name].shape == layer_b[name].shape, name
            if layer_a[name].size:  # an empty tail (a compressor at a block boundary) has nothing to differ
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


def check_forced_rejections(model, options, serial, pos0: int, tol: float) -> int:
    """Every keep of every window T = 2..8 at `pos0`, its rejected drafts made wrong: the kept
    rows' logits, the committed state, the next row's logits and the state after it must equal
    serial decoding's (`serial` from `serial_decode`) within `tol`. Returns the cases checked."""
    seq, serial_logits, serial_states = serial
    vocab = model.config.vocab_size
    engine = WindowEngine(model, options)
    engine.prefill(seq[:pos0])
    start = engine.snapshot()
    checked = 0
    for T in range(2, 9):
        for keep in range(1, T + 1):
            engine.restore(start)
            wrong = [(t + 1 + i) % vocab for i, t in enumerate(seq[pos0 + keep : pos0 + T])]
            out = engine.run(seq[pos0 : pos0 + keep] + wrong, pos0)
            for i in range(keep):  # rows up to the rejection saw only true inputs: serial rows
                diff = float(mx.abs(out.logits[i] - serial_logits[pos0 + i]).max())
                assert diff <= tol, (T, keep, i, diff)
            engine.commit(keep)
            assert engine.length == pos0 + keep
            diff = max_state_diff(engine.state_tensors(), serial_states[pos0 + keep - 1])
            assert diff <= tol, (T, keep, "state", diff)
            nxt = pos0 + keep
            out = engine.run([seq[nxt]], nxt)
            diff = float(mx.abs(out.logits[0] - serial_logits[nxt]).max())
            assert diff <= tol, (T, keep, "next logits", diff)
            engine.commit(1)
            diff = max_state_diff(engine.state_tensors(), serial_states[nxt])
            assert diff <= tol, (T, keep, "state after next", diff)
            checked += 1
    return checked


def check_checkpoint_round_trip(model, seq: list[int], path, *, identity: str, rejected: int = 1) -> None:
    """Prefix checkpoints (serve's ring) and a session file of this model's state, taken after a
    window that kept 4 rows and rejected `rejected` more, restore to the same next logits."""
    from strata_cli.serve.checkpoints import CheckpointRing
    from strata_cli.serve.session import load_session, save_session

    engine = WindowEngine(model)
    engine.prefill(seq[:20])
    ring = CheckpointRing(max_entries=4, max_positions=1000)
    ring.add(seq[:20], engine.snapshot())
    engine.run(seq[20:24] + [0] * rejected, 20)
    engine.commit(4)  # a pending lazy fold, where the state has one: the snapshot flushes it
    ring.add(seq[:24], engine.snapshot())
    expected = engine.run([seq[24]], 24).logits
    engine.commit(1)

    signature = {"identity": identity, "dtype": "float32", "layout": [type(s).__name__ for s in engine.states]}
    save_session(path, list(ring), **signature)
    restored = load_session(path, **signature, max_context=512, vocab_size=model.config.vocab_size,
                            check=engine.check_snapshot)
    assert [c.tokens for c in restored] == [tuple(seq[:20]), tuple(seq[:24])]
    for snapshot in (list(ring)[1].snapshot, restored[1].snapshot):  # the ring's, the file's
        fresh = WindowEngine(model)
        fresh.restore(snapshot)
        assert mx.array_equal(fresh.run([seq[24]], 24).logits, expected).item()


def speculation_matches_serial(engine: WindowEngine, calls: list, *, rows_of=lambda call: call,
                               max_tokens: int = 12) -> None:
    """A prompt that repeats itself (a random model then repeats too, so drafts get kept), decoded
    serially and with 3 drafts through `engine`: the tokens are equal, drafts were offered and
    kept, serial steps went through the kernel whose stand-in records `calls` (`rows_of(call)`:
    a call's rows), and speculation sent more multi-row windows to it than serial decoding did."""
    from strata_cli.decode import generate
    from strata_cli.options import GenerateOptions, SpecOptions
    from strata_cli.telemetry import DecodeStats

    def decode(prompt, drafts, tokens=max_tokens):
        stats = DecodeStats()
        out = [t for step in generate(engine, prompt, options=GenerateOptions(max_tokens=tokens),
                                      spec=SpecOptions(max_drafts=drafts), eos_ids=[], stats=stats)
               for t in step.tokens]
        return out, stats.summary()

    ids = [5, 17, 42, 8, 5, 17, 42, 8]
    continuation, _ = decode(ids, 0, tokens=8)
    prompt = ids + continuation + ids
    calls.clear()
    serial, _ = decode(prompt, 0)
    serial_rows = [rows_of(c) for c in calls]
    assert serial_rows.count(1) >= len(serial) - 1  # serial steps go through the kernel too
    calls.clear()
    spec, summary = decode(prompt, 3)
    assert spec == serial
    assert summary["drafts_offered"] > 0 and summary["drafts_kept"] > 0
    # multi-row windows went through the kernel (beyond the prompt's short last chunk, as in serial)
    assert sum(rows_of(c) > 1 for c in calls) > sum(n > 1 for n in serial_rows)
