"""Issue 31, item 6: a session file edited by someone who recomputes its checksum is still checked
against the model before anything is used: every array's shape and dtype, every slot, every
layer, every key. Each forgery is refused whole at start-up with one line and exit status 1; a good
session still restores. (A forged change to values of the right shape cannot be told from a real
state: docs/serve.md says so.)"""

import hashlib
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

SERVE = [sys.executable, "-m", "strata_cli.cli", "serve-stdio"]
PROMPT = {"prompt": "def fib(n):\n    if n < 2:", "max_tokens": 4}


def serve(session, stdin=b"", *args):
    proc = subprocess.run([*SERVE, "--session", str(session), *args], input=stdin, capture_output=True,
                          timeout=180, check=False, env={**os.environ, "STRATA_RAISE_ERRORS": ""})
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    session = tmp_path_factory.mktemp("forgery") / "good.session"
    rc, _, err = serve(session, json.dumps(PROMPT).encode() + b"\n")
    assert rc == 0 and session.is_file(), err
    return session.read_bytes()


def checksum(metadata, arrays):
    """What serve/session.py computes: anyone who can write the file can compute it too."""
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        digest.update(memoryview(a).tobytes())
    return digest.hexdigest()


def forge(good_bytes, path, change):
    path.write_bytes(good_bytes)
    arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    entries = json.loads(metadata["checkpoints"])
    change(arrays, metadata, entries)
    metadata["checkpoints"] = json.dumps(entries)
    metadata.pop("checksum")
    metadata["checksum"] = checksum(metadata, arrays)
    with open(path, "wb") as f:  # a file object: a path would get ".safetensors" appended
        mx.save_safetensors(f, arrays, metadata=metadata)
    return path


def slot_of(entries, layer, slot, checkpoint=0):
    return entries[checkpoint]["slots"][layer][slot]


# The demo model's layers: GDN (S, history), KV (keys, values, length), GDN, KV, GDN, KV.
def kv_keys(arrays, entries):
    return slot_of(entries, 1, 0)["array"]


def cut_head_dim(arrays, metadata, entries):
    name = kv_keys(arrays, entries)
    arrays[name] = arrays[name][..., :-8]


def cut_capacity_below_length(arrays, metadata, entries):
    name = kv_keys(arrays, entries)
    arrays[name] = arrays[name][:, :, :2, :]


def values_unlike_keys(arrays, metadata, entries):
    name = slot_of(entries, 3, 1)["array"]
    arrays[name] = mx.concatenate([arrays[name]] * 2, axis=2)


def gdn_state_cut(arrays, metadata, entries):
    name = slot_of(entries, 0, 0)["array"]
    arrays[name] = arrays[name][:, :3]


def gdn_history_transposed(arrays, metadata, entries):
    name = slot_of(entries, 2, 1)["array"]
    arrays[name] = arrays[name].transpose(0, 2, 1)


def to_float16(arrays, metadata, entries):
    name = kv_keys(arrays, entries)
    arrays[name] = arrays[name].astype(mx.float16)


def gdn_state_to_bfloat16(arrays, metadata, entries):
    name = slot_of(entries, 4, 0)["array"]
    arrays[name] = arrays[name].astype(mx.bfloat16)


def integer_slot_changed(arrays, metadata, entries):
    slot_of(entries, 1, 2)["int"] += 4


def integer_slot_as_text(arrays, metadata, entries):
    slot_of(entries, 1, 2)["int"] = str(slot_of(entries, 1, 2)["int"])


def integer_slot_as_bool(arrays, metadata, entries):
    slot_of(entries, 3, 2)["int"] = True


def array_where_an_int_goes(arrays, metadata, entries):
    entries[0]["slots"][1][2] = dict(slot_of(entries, 1, 0))


def slot_emptied(arrays, metadata, entries):
    del arrays[slot_of(entries, 0, 0)["array"]]  # stored for this slot alone
    entries[0]["slots"][0][0] = None


def fewer_layers(arrays, metadata, entries):
    dropped = entries[1]["slots"].pop()
    kept = {v["array"] for e in entries for layer in e["slots"] for v in layer if v and "array" in v}
    for v in dropped:  # a careful forger leaves no tensor unused
        if v and "array" in v and v["array"] not in kept:
            del arrays[v["array"]]


def fewer_slots(arrays, metadata, entries):
    entries[0]["slots"][1].pop()


def extra_tensor(arrays, metadata, entries):
    arrays["array.999"] = mx.zeros((4,))


def extra_metadata_key(arrays, metadata, entries):
    metadata["note"] = "hello"


def extra_slot_key(arrays, metadata, entries):
    slot_of(entries, 0, 0)["int"] = 3


def extra_entry_key(arrays, metadata, entries):
    entries[0]["extra"] = 1


def tokens_as_floats(arrays, metadata, entries):
    arrays["tokens.0"] = arrays["tokens.0"].astype(mx.float32) + 0.5


def tokens_two_dimensional(arrays, metadata, entries):
    arrays["tokens.0"] = arrays["tokens.0"][None]


def length_as_text(arrays, metadata, entries):
    entries[0]["length"] = str(entries[0]["length"])


def missing_tokens(arrays, metadata, entries):
    del arrays["tokens.1"]


FORGERIES = [
    (cut_head_dim, "layer 1 .*keys.*shape"),
    (cut_capacity_below_length, "layer 1 .*keys.*shape"),
    (values_unlike_keys, "layer 3 .*values.*shape"),
    (gdn_state_cut, "layer 0 .*shape"),
    (gdn_history_transposed, "layer 2 .*shape"),
    (to_float16, "layer 1 .*float16"),
    (gdn_state_to_bfloat16, "layer 4 .*bfloat16"),
    (integer_slot_changed, "layer 1 .*length"),
    (integer_slot_as_text, "slot"),
    (integer_slot_as_bool, "slot"),
    (array_where_an_int_goes, "layer 1 .*length"),
    (slot_emptied, "layer 0"),
    (fewer_layers, "5 layers.*6"),
    (fewer_slots, "layer 1 .*slots"),
    (extra_tensor, "array.999"),
    (extra_metadata_key, "note"),
    (extra_slot_key, "slot"),
    (extra_entry_key, "extra"),
    (tokens_as_floats, "tokens.0"),
    (tokens_two_dimensional, "tokens.0"),
    (length_as_text, "length"),
    (missing_tokens, "tokens.1"),
]


@pytest.mark.parametrize("change, message", FORGERIES, ids=[f.__name__ for f, _ in FORGERIES])
def test_a_forged_session_is_refused_at_start_with_one_line(good, tmp_path, change, message):
    import re

    path = forge(good, tmp_path / "forged.session", change)
    rc, out, err = serve(path)
    lines = err.strip().splitlines()
    assert rc == 1 and out == "", err
    assert len(lines) == 1 and str(path) in lines[0] and "did not start" in lines[0], err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err and "AssertionError" not in err


def test_an_unforged_rewrite_restores_and_is_used(good, tmp_path):
    path = forge(good, tmp_path / "same.session", lambda arrays, metadata, entries: None)
    rc, out, err = serve(path, json.dumps({"id": 1, **PROMPT}).encode() + b"\n", "-v")
    assert rc == 0, err
    assert "restored 2 checkpoints" in err
    done = [json.loads(line) for line in out.splitlines() if json.loads(line).get("done")]
    assert done and done[0]["usage"]["cached_tokens"] > 0


def test_a_good_session_of_a_streamed_checkpoint_restores(tmp_path):
    from click.testing import CliRunner

    from strata_cli.cli import cli

    model = tmp_path / "demo-stream"
    assert CliRunner().invoke(cli, ["convert", "demo", str(model), "--stream"]).exit_code == 0
    session = tmp_path / "s.session"
    line = json.dumps({"id": 1, **PROMPT}).encode() + b"\n"
    assert serve(session, line, "--model", str(model))[0] == 0
    rc, out, err = serve(session, line, "--model", str(model))
    assert rc == 0 and "restored 2 checkpoints" in err, err
    done = [json.loads(line) for line in out.splitlines() if json.loads(line).get("done")]
    assert done[0]["usage"]["cached_tokens"] > 0


def test_real_snapshots_pass_the_check_and_the_probe_leaves_state_alone(tiny_model):
    from strata_cli.engine.window import Snapshot, SnapshotError, WindowEngine

    engine = WindowEngine(tiny_model)
    engine.check_snapshot(engine.snapshot())  # empty: nothing restored yet
    engine.prefill([i % 90 for i in range(200)])
    engine.run([1, 2, 3], 200)
    engine.commit(2)
    before = engine.snapshot()
    reference = engine.run([4], 202).logits
    engine.commit(1)
    fresh = WindowEngine(tiny_model)
    fresh.restore(before)
    fresh.snapshot_like()  # after the restore: the probe runs on scratch state
    fresh.check_snapshot(before)
    assert fresh.length == 202 and mx.array_equal(fresh.run([4], 202).logits, reference).item()
    layer = next(i for i, s in enumerate(before.states) if len(s) == 3)
    shifted = list(before.states)
    shifted[layer] = (*before.states[layer][:2], 201)
    with pytest.raises(SnapshotError, match=rf"layer {layer} \(KVState\): length slot is int 201"):
        fresh.check_snapshot(Snapshot(202, tuple(shifted)))
