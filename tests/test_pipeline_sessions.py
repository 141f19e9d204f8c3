"""`--session` across ranks (distributed.py, serve/server.py): rank 0 gathers the later ranks'
layer states and writes one process's session file, so a session saved by two ranks restores
under another split or in one process, and one process's restores under ranks, each answering as
a fresh run does; a forged file is refused whole in one line, whichever rank holds the layer."""

import json
import os
import re
import signal
import stat
import subprocess
import time
import uuid

import pytest
from test_pipeline_ranks import STRATA, TIMEOUT, env, launch, rank_pid, read_frames
from test_session_forgery import forge, slot_of

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="finds rank pids in /proc (Linux)")
LONG = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(8))
FIRST = [{"id": "first", "prompt": LONG + "def g(a, b):", "max_tokens": 8, "suffix_draft": 0}]
AGAIN = [
    {"id": "again", "prompt": LONG + "class Foo:", "max_tokens": 12, "suffix_draft": 3},
    {"id": "sampled", "prompt": LONG + "def h(", "max_tokens": 12, "suffix_draft": 0, "temperature": 0.7, "seed": 5},
]
SERVE = ["serve-stdio", "--checkpoint-every", "64", "-v"]


def serve(requests, *args, ranks=1):
    """Done frames by id, and stderr: one process reads to end of input, ranks are stopped with
    SIGTERM to rank 0 once every request is answered (mlx.launch never ends their stdin)."""
    stdin = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    if ranks == 1:
        proc = subprocess.run(STRATA + SERVE + list(args), input=stdin, capture_output=True, timeout=TIMEOUT,
                              env=env(), check=False)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        frames = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        return {f["id"]: f for f in frames if f.get("done")}, proc.stderr.decode()
    token = uuid.uuid4().hex
    proc = subprocess.Popen(launch(ranks) + STRATA + SERVE + list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env(PIPELINE_TEST_TOKEN=token))
    try:
        proc.stdin.write(stdin)
        proc.stdin.flush()
        frames = read_frames(proc, len(requests), time.monotonic() + TIMEOUT)
        os.kill(rank_pid(token, 0), signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {f["id"]: f for f in frames if f.get("done")}, err.decode()


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory):
    session = tmp_path_factory.mktemp("pipeline-session") / "two.session"
    _, err = serve(FIRST, "--session", str(session), ranks=2)
    assert session.is_file(), err[-2000:]
    return session


@needs_proc
def test_a_session_saved_by_two_ranks_restores_anywhere_as_a_fresh_run(saved_by_two_ranks, tmp_path):
    assert stat.S_IMODE(saved_by_two_ranks.stat().st_mode) == 0o600
    fresh, _ = serve(AGAIN)
    results = {}
    for name, args, ranks in [("one process", [], 1), ("two ranks", [], 2),
                              ("two ranks, another split", ["--pipeline-split", "4,2"], 2)]:
        copy = tmp_path / f"{name}.session"
        copy.write_bytes(saved_by_two_ranks.read_bytes())
        results[name], err = serve(AGAIN, "--session", str(copy), *args, ranks=ranks)
        assert re.search("restored [1-9][0-9]* checkpoints", err), err[-2000:]
    for name, done in results.items():
        for rid, frame in fresh.items():
            assert done[rid]["token_ids"] == frame["token_ids"], (name, rid)
        assert done["again"]["usage"]["cached_tokens"] > 0 == fresh["again"]["usage"]["cached_tokens"], name
    assert results["two ranks, another split"]["again"]["stats"]["pipeline"]["layers"] == [[0, 4], [4, 6]]


@needs_proc
def test_one_process_session_restores_under_two_ranks_and_saves_again(tmp_path):
    session = tmp_path / "one.session"
    serve(FIRST, "--session", str(session))
    done, err = serve(AGAIN[:1], "--session", str(session), ranks=2)
    assert re.search("restored [1-9][0-9]* checkpoints", err), err[-2000:]
    assert done["again"]["usage"]["cached_tokens"] > 0
    _, err = serve(AGAIN[1:], "--session", str(session))  # what the ranks saved, read by one process
    assert "restored" in err and "saved" in err, err[-2000:]


def values_unlike_keys_on_rank_1(arrays, metadata, entries):  # layer 3: a KV state of rank 1 (3 + 3 layers)
    name = slot_of(entries, 3, 1)["array"]
    arrays[name] = arrays[name][..., :-8]


def gdn_state_cut_on_rank_0(arrays, metadata, entries):
    name = slot_of(entries, 0, 0)["array"]
    arrays[name] = arrays[name][:, :-1]


@pytest.mark.parametrize("change, message", [(values_unlike_keys_on_rank_1, r"checkpoint 0 .*layer 3 \(KVState\).*shape"),
                                             (gdn_state_cut_on_rank_0, r"checkpoint 0 .*layer 0 .*shape")],
                         ids=["rank-1-layer", "rank-0-layer"])
def test_a_forged_session_is_refused_whole_across_ranks(saved_by_two_ranks, tmp_path, change, message):
    path = forge(saved_by_two_ranks.read_bytes(), tmp_path / "forged.session", change)
    proc = subprocess.run(launch() + STRATA + ["serve-stdio", "--session", str(path)], stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=TIMEOUT, env=env(), check=False)
    err = proc.stderr.decode()
    lines = [line for line in err.strip().splitlines() if "[WARN]" not in line]  # the launcher's own
    assert "rank 0 exited with code 1" in err and proc.stdout == b"", err
    assert len(lines) == 1 and str(path) in lines[0] and "did not start" in lines[0], err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err
