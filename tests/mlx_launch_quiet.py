"""`mlx.launch` without its busy loops, for the tests that launch ranks (test_pipeline_ranks.py).

`python tests/mlx_launch_quiet.py ARGS` runs mlx's own launcher (`mlx._distributed_utils.launch.main`,
what the `mlx.launch` script calls) with two waits put back. In mlx 0.32 each rank's thread selects
the rank's stdout, stderr and stdin with a 1 s timeout, but a stdin pipe is writable whenever it is
not full, so the select returns at once and the thread spins; and with its own stdin at end of
input (the tests' DEVNULL) the main thread's select returns at once too. A two-rank 48-token
generate took 11 s of CPU, 6 of them the launcher's: on CI's 2 cores, time taken from the ranks
and from the other pytest worker. Here a rank thread's select first waits up to 20 ms for output
(stdin bytes go on at most that late), and a stdin at /dev/null is swapped for a pipe that stays
open and empty: the ranks see the same (no bytes and no end of input: the launcher never passes
the end on). And mlx 0.32's launcher exits 0 when a rank fails (it only warns, "Node with rank R
exited with code C"), so a test saw a failed rank as an empty output and lost its stderr: here a
rank that failed or was killed makes the exit status 1. The ranks, their environment and
everything else are the launcher's own.
"""

import os
import select
import sys

from mlx._distributed_utils import launch

OUTPUT_WAIT = 0.02  # s


def select_waiting_for_output(rlist, wlist, xlist, timeout=None):
    if wlist and timeout:  # a rank's stdin: writable nearly always, so wait for its output first
        select.select(rlist, [], xlist, min(timeout, OUTPUT_WAIT))
        timeout = 0
    return select.select(rlist, wlist, xlist, timeout)


failed_ranks: list[str] = []


def warning_noting_failed_ranks(*args, **kwargs):
    message = " ".join(map(str, args))
    if message.startswith("Node with rank"):  # "... exited with code C" or "... was killed"
        failed_ranks.append(message)
    log_warning(*args, **kwargs)


if __name__ == "__main__":
    if os.path.samestat(os.fstat(0), os.stat(os.devnull)):
        read_end, _write_end = os.pipe()  # the write end stays open: no bytes, no end of input
        os.dup2(read_end, 0)
    launch.select = select_waiting_for_output
    log_warning = launch.log_warning
    launch.log_warning = warning_noting_failed_ranks
    sys.argv[0] = "mlx.launch"
    status = launch.main()
    sys.exit(status or (1 if failed_ranks else 0))
