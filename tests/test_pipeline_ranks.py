"""Two ranks (three once) on loopback (`mlx.launch --backend ring`), each holding a stage of the
layers (distributed.py): output identical to one process — greedy serial, fixed drafts, `auto`, seeded
sampling, prefix checkpoints restored across ranks — and a stuck rank ends every rank with one
line, never a hang. Every subprocess has a timeout, so a hang fails fast."""

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hf_checkpoints import checkpoint_root, hybrid_hf_checkpoint

TIMEOUT = 90
# These tests signal one rank by its pid, found in /proc.
needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds rank pids in /proc (Linux)")
STRATA = [sys.executable, "-m", "strata_cli.cli"]
CODE = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib2(n):"


def launch(ranks: int = 2) -> list[str]:
    """`mlx.launch ...`: mlx's launcher, less its busy loops (mlx_launch_quiet.py says why)."""
    # beside other launches, and below Linux's ephemeral ports (32768-60999): a ring's own client
    # sockets take those, and one landed on a rank's port here (bind: error 98)
    port = random.randrange(20000, 32768 - 16, 16)
    return [sys.executable, str(Path(__file__).with_name("mlx_launch_quiet.py")), "--hosts", "127.0.0.1",
            "-n", str(ranks), "--backend", "ring", "--starting-port", str(port), "--"]


def env(**extra):
    return {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_RAISE_ERRORS": "", **extra}


def run(args, *, ranks=1):
    cmd = (launch(ranks) if ranks > 1 else []) + STRATA + args
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT, env=env())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout.decode()


def generate_record(args, ranks):
    (line,) = run(["generate", "--json", "--max-tokens", "48", *args, CODE], ranks=ranks).splitlines()
    return json.loads(line)


def cost_curve(tmp_path) -> str:
    """A cost prior for `auto`, so no test spends its time calibrating (calibrate.py)."""
    path = tmp_path / "curve.json"
    path.write_text(json.dumps([0.004 * (1 + 0.3 * t) for t in range(8)]))
    return str(path)


def test_a_failed_rank_fails_the_launch():
    """mlx 0.32's launcher exits 0 when a rank fails; tests/mlx_launch_quiet.py makes it 1, so run()
    reports the rank's stderr instead of an empty output."""
    fail_rank_0 = "import os, sys; print('rank', os.environ['MLX_RANK']); sys.exit(3 * (os.environ['MLX_RANK'] == '0'))"
    proc = subprocess.run(launch(2) + [sys.executable, "-c", fail_rank_0], stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=TIMEOUT, env=env())
    assert proc.returncode == 1 and "rank 0 exited with code 3" in proc.stderr.decode()
    ok = subprocess.run(launch(2) + [sys.executable, "-c", "print('ok')"], stdin=subprocess.DEVNULL,
                        capture_output=True, timeout=TIMEOUT, env=env())
    assert ok.returncode == 0 and ok.stdout.decode().split() == ["ok", "ok"]


def test_generate_on_two_ranks_equals_one_process(tmp_path):
    """`auto`: windows of drafts with serial stretches between them; both kinds of step cross the ranks."""
    args = ["--suffix-draft", "auto", "--draft-cost", cost_curve(tmp_path)]
    one, two = generate_record(args, 1), generate_record(args, 2)
    assert two["token_ids"] == one["token_ids"] and two["text"] == one["text"]
    assert two["stats"]["pipeline"] == {"rank": 0, "ranks": 2, "layers": [[0, 3], [3, 6]]}
    assert "pipeline" not in one["stats"]
    assert two["stats"]["drafts_kept"] > 0 and two["stats"]["window_T_histogram"].get("1")
    assert two["stats"]["controller"]["cost_prior"].startswith("file:")


def test_a_hybrid_with_stateless_blocks_on_three_ranks(tmp_path_factory):
    """Nemotron-H (Mamba-2, attention, MLP and MoE blocks; only some hold state), and a middle
    rank that passes headers and rows on."""
    path = str(hybrid_hf_checkpoint(checkpoint_root(tmp_path_factory), "nemotron_h"))
    args = ["--model", path, "--no-heal", "--suffix-draft", "3"]
    one, three = generate_record(args, 1), generate_record(args, 3)
    assert three["token_ids"] == one["token_ids"]
    assert three["stats"]["pipeline"]["ranks"] == 3


def serve_requests():
    long = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(8))
    return [
        {"id": "serial", "prompt": long + "def g(a, b):", "max_tokens": 12, "suffix_draft": 0},
        {"id": "prefix", "prompt": long + "class Foo:", "max_tokens": 12, "suffix_draft": 3},  # reuses a checkpoint
        {"id": "auto", "prompt": CODE, "max_tokens": 32},  # the server's default
        {"id": "sampled", "prompt": CODE, "max_tokens": 24, "suffix_draft": 0, "temperature": 0.7, "seed": 11},
        {"id": "sampled-drafts", "prompt": CODE, "max_tokens": 24, "suffix_draft": 3, "temperature": 0.7, "seed": 11},
        {"id": "again", "prompt": long + "def g(a, b):", "max_tokens": 12, "suffix_draft": 0},
    ]


def read_frames(proc, count: int, deadline: float) -> list[dict]:
    """stdout frames until `count` done frames (each line must be one JSON object)."""
    frames, buffer = [], b""
    while sum(bool(f.get("done")) for f in frames) < count:
        assert time.monotonic() < deadline, frames
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, "stdout closed early"
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            frames += [json.loads(line) for line in lines]
    return frames


@needs_proc
def test_serve_stdio_on_two_ranks_equals_one_process(tmp_path):
    requests = serve_requests()
    stdin = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    args = ["serve-stdio", "--checkpoint-every", "64", "--suffix-draft", "auto", "--draft-cost", cost_curve(tmp_path)]
    proc1 = subprocess.run(STRATA + args, input=stdin, capture_output=True, timeout=TIMEOUT, env=env())
    one = {f["id"]: f for f in map(json.loads, proc1.stdout.decode().splitlines()) if f.get("done")}
    # mlx.launch passes stdin on but never its end: the server is stopped with SIGTERM once done.
    token = uuid.uuid4().hex
    proc = subprocess.Popen(launch() + STRATA + args, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(PIPELINE_TEST_TOKEN=token))
    try:
        proc.stdin.write(stdin)
        proc.stdin.flush()
        frames = read_frames(proc, len(requests), time.monotonic() + TIMEOUT)
        os.kill(rank_pid(token, 0), signal.SIGTERM)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [f.get("ready") for f in frames].count(True) == 1  # the other rank writes nothing to stdout
    two = {f["id"]: f for f in frames if f.get("done")}
    assert set(two) == set(one) == {r["id"] for r in requests}
    for rid, frame in one.items():
        assert two[rid]["token_ids"] == frame["token_ids"], rid
    assert two["again"]["stats"]["prefill_tokens"] < two["serial"]["stats"]["prefill_tokens"]  # restored across ranks
    assert two["serial"]["stats"]["pipeline"]["ranks"] == 2
    assert two["sampled-drafts"]["stats"]["drafts_offered"] > 0


def rank_pid(token: str, rank: int) -> int | None:
    """The pid of the rank this test launched (its environment carries `token`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PIPELINE_TEST_TOKEN={token}".encode() in environ and f"MLX_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@needs_proc
def test_a_stuck_rank_ends_every_rank_with_one_line():
    token = uuid.uuid4().hex
    proc = subprocess.Popen(launch() + STRATA + ["serve-stdio", "--pipeline-timeout", "3"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(PIPELINE_TEST_TOKEN=token))
    follower, err = None, b""
    try:
        proc.stdin.write(b'{"id": 1, "prompt": "def f(x):", "max_tokens": 4}\n')
        proc.stdin.flush()
        read_frames(proc, 1, time.monotonic() + TIMEOUT)
        follower = rank_pid(token, 1)
        os.kill(follower, signal.SIGSTOP)  # alive but silent: only a timeout can tell
        start = time.monotonic()
        proc.stdin.write(b'{"id": 2, "prompt": "def g(y):", "max_tokens": 4}\n')
        proc.stdin.flush()
        while b"no answer" not in err and time.monotonic() < start + 30:
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                err += os.read(proc.stderr.fileno(), 65536)
        elapsed = time.monotonic() - start
    finally:
        if follower is not None:
            os.kill(follower, signal.SIGKILL)  # a stopped process never takes the launcher's SIGTERM
        else:
            proc.kill()
        proc.wait(timeout=TIMEOUT)
    assert b"strata: rank 0: no answer from the other ranks within 3 s" in err, err[-2000:]
    assert elapsed < 30  # and the launcher has ended every rank (proc.wait above)


def test_forced_rejections_across_ranks_match_one_engine():
    script = str(Path(__file__).with_name("pipeline_rejections.py"))
    proc = subprocess.run(launch() + [sys.executable, script], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=4 * TIMEOUT, env=env())
    assert "checked 46" in proc.stdout.decode(), proc.stderr.decode()[-3000:]
