"""Pipeline stages over `mx.distributed`: ranks started by `mlx.launch` share one model.

Each rank holds a contiguous stage of decoder layers and their state (docs/design.md, "Across
ranks"). Rank 0 also holds the embeddings, the final norm and the output head, and runs the
whole request: tokenizer, drafter, controller, sampling and output. Its window engine sees the
later stages as one more state (`RemoteStages`, kind "ranks") and the model as `PipelineModel`:
a window's hidden rows go rank 0 -> 1 -> ... -> N-1 and back to rank 0, which applies the head.

Every message from rank 0 starts with a header (int32): what to run (state set, pos0, T, mode)
and the state calls rank 0's engine made since the last message (commit, abandon, snapshot,
restore, and the drops of state sets and snapshots it no longer holds). The other ranks
(`StageFollower`) apply those calls to their own layers' states in the same order, so every
stage commits the same `keep` exactly once and rolls back by its own rules; they print nothing.

Failure never hangs: a rank that loses a peer raises the backend's error and ends with one line,
and every wait inside a window or prompt chunk is bounded by `PipelineOptions.timeout` (a
watchdog ends the process); `mlx.launch` then stops the other ranks.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .engine.state import ArraySpec, Mode
from .engine.window import Snapshot, SnapshotError, make_state
from .experts.store import ExpertStoreError, is_streamed, read_index
from .model.loader import ModelLoadError, compute_dtype, read_header, weight_files
from .options import ConfigError, EngineOptions
from .stage_transfer import decode_states, encode_states, recv_message, send_message

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
NOT_LOADED = ("visual.", "model.visual.", "vision_tower.")  # vision towers: never loaded
KEPT_ASIDE = ("mtp.", "model.mtp.")  # MTP layers: loaded with rank 0's share, outside the stack
EXIT_CODE = 70  # a rank that ends because the pipeline broke

# Header: kind, state set, pos0, T, mode, last_only, dtype, number of calls, then the calls as
# (call, a, b) triples.
RUN, CALLS, EXIT, GATHER, SCATTER = 1, 2, 3, 4, 5
COMMIT, ABANDON, SNAPSHOT, RESTORE, DROP_STATES, DROP_SNAPSHOT = 1, 2, 3, 4, 5, 6
MAX_CALLS = 32
HEADER_INTS = 8 + 3 * MAX_CALLS
MODES = (Mode.WINDOW, Mode.PARTIAL, Mode.COMMIT_ALL)
DTYPES = (mx.float32, mx.bfloat16, mx.float16)


class PipelineError(RuntimeError):
    """The ranks cannot work together: a rank went away or a split does not fit the model."""


def find_group():
    """The group `mlx.launch` started this process in, or None for a single process.

    Raises:
        PipelineError: the launcher started several ranks but no backend could join them (each
            would otherwise run the whole model alone and answer every request twice).
    """
    group = mx.distributed.init()
    if group.size() > 1:
        return group
    expected = launched_ranks()
    if expected > 1:
        try:
            mx.distributed.init(strict=True)
            reason = "the backend started a group of one"
        except RuntimeError as e:
            reason = str(e)
        raise PipelineError(f"started as rank {os.environ.get('MLX_RANK')} of {expected} but no distributed backend "
                            f"joined the ranks ({reason}); check mlx.launch's --backend for this machine")
    return None


def launched_ranks() -> int:
    """How many ranks the launcher's environment says it started (1 when none)."""
    if os.environ.get("MLX_WORLD_SIZE", "").isdigit():
        return int(os.environ["MLX_WORLD_SIZE"])
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            hosts = json.loads(Path(hostfile).read_text())
        except (OSError, ValueError):
            return 1
        return len(hosts) if isinstance(hosts, list) else 1
    return 1


# -- the split -------------------------------------------------------------------------------------


def checkpoint_layer_bytes(path: Path, num_layers: int) -> tuple[list[int], int]:
    """Bytes of each decoder layer's tensors in the checkpoint's safetensors headers and, for a
    streamed checkpoint, of its streamed experts' records; and of the rest (embeddings, final
    norm, output head), which rank 0 holds."""
    layers, rest = [0] * num_layers, 0
    if is_streamed(path):
        try:
            _, blocks = read_index(path)
        except ExpertStoreError as e:
            raise ModelLoadError(str(e)) from None
        for block in blocks:
            if 0 <= block.layer < num_layers:
                layers[block.layer] += block.record_bytes * block.num_experts
    for f in weight_files(path):
        for name, entry in read_header(f).items():
            if name == "__metadata__":
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            match = LAYER_NAME.search(name)
            if name.startswith(NOT_LOADED):
                continue
            if match and not name.startswith(KEPT_ASIDE) and int(match.group(1)) < num_layers:
                layers[int(match.group(1))] += size
            else:
                rest += size
    return layers, rest


def balanced_split(layer_bytes: Sequence[int], ranks: int, first_extra: int = 0) -> list[int]:
    """Layers per rank, contiguous and in order, that minimise the largest rank's bytes
    (rank 0's share counting `first_extra` too); each rank gets at least one layer."""
    n = len(layer_bytes)
    if ranks > n:
        raise PipelineError(f"{ranks} ranks but the model has only {n} decoder layers (one at least per rank)")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(rank: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first_extra if rank == 0 else 0)

    # best[r][i]: the least largest share placing layers[:i] on ranks 0..r-1; cut[r][i] where rank r-1 starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for r in range(1, ranks + 1):
        for i in range(r, n - (ranks - r) + 1):
            for j in range(r - 1, i):
                value = max(best[r - 1][j], cost(r - 1, j, i))
                if value < best[r][i]:
                    best[r][i], cut[r][i] = value, j
    counts, i = [], n
    for r in range(ranks, 0, -1):
        counts.append(i - cut[r][i])
        i = cut[r][i]
    return counts[::-1]


@dataclass
class Stage:
    """This rank's part of the model: its layers, and who holds the others.

    Attributes:
        rank, ranks: this process's rank and the group's size.
        split: layers per rank as `--pipeline-split` gave them, or None (balanced by bytes).
        path: the checkpoint directory (its safetensors headers give the bytes to balance).
        bounds: every rank's layers, in rank order (set by `select` while loading).
        kinds: this rank's layers' state kinds (set by `select`).
        layer_prefix: the decoder layers' module path with its dot, "model.layers." (set by `select`).
        whole_kinds: every layer's state kinds, the whole model's (set by `select`).
        state_counts: how many of them each rank holds, in rank order (set by `select`).
    """

    rank: int
    ranks: int
    split: tuple[int, ...] | None = None
    path: Path | None = None
    bounds: list[range] = field(default_factory=list)
    kinds: list[tuple[str, dict]] = field(default_factory=list)
    layer_prefix: str = ""
    whole_kinds: list[tuple[str, dict]] = field(default_factory=list)
    state_counts: list[int] = field(default_factory=list)

    @property
    def layers(self) -> range:
        return self.bounds[self.rank]

    @property
    def state_offset(self) -> int:
        """The index of this rank's first layer state among the whole model's."""
        return sum(self.state_counts[: self.rank])

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.ranks - 1

    def summary(self) -> dict:
        """What `--json` stats report: this rank, the group's size, every rank's [start, stop)."""
        return {"rank": self.rank, "ranks": self.ranks, "layers": [[b.start, b.stop] for b in self.bounds]}

    def plan(self, num_layers: int) -> list[range]:
        """Every rank's layers: `split`, or balanced by the checkpoint's bytes.

        Raises:
            ConfigError: a split whose ranks or layers do not match the group or the model,
                or more ranks than layers.
        """
        if self.split is not None:
            counts = list(self.split)
            if len(counts) != self.ranks:
                raise ConfigError(f"--pipeline-split gives {len(counts)} ranks, mlx.launch started {self.ranks}")
            if sum(counts) != num_layers:
                raise ConfigError(f"--pipeline-split gives {sum(counts)} layers, the model has {num_layers}")
        else:
            layer_bytes, rest = checkpoint_layer_bytes(self.path, num_layers)
            try:
                counts = balanced_split(layer_bytes, self.ranks, first_extra=rest)
            except PipelineError as e:
                raise ConfigError(str(e)) from None
        bounds, start = [], 0
        for count in counts:
            bounds.append(range(start, start + count))
            start += count
        return bounds

    def select(self, model) -> Callable[[str], bool]:
        """Drop what this rank does not hold from `model` (loader.load_model's `select`): other
        ranks' layers, and on ranks after the first the embeddings, final norm, output head and
        any tensors kept aside. Returns which checkpoint tensor names this rank reads."""
        num_layers = len(model.layers)
        self.bounds = self.plan(num_layers)
        span = model.state_span(self.layers.start, self.layers.stop)
        self.kinds = list(model.state_kinds[span])
        self.whole_kinds = list(model.state_kinds)
        self.state_counts = [len(self.whole_kinds[model.state_span(b.start, b.stop)]) for b in self.bounds]
        layers_path = next(path for path, module in model.named_modules() if module is model.layers[0])
        layer_prefix = layers_path.rsplit(".", 1)[0] + "."
        self.layer_prefix = layer_prefix
        for i in range(num_layers):
            if i not in self.layers:
                model.layers[i] = nn.Module()
        if not self.is_first:
            prune(model, "", layer_prefix)
        return self.holds

    def holds(self, name: str) -> bool:
        """Whether this rank holds the tensor or module `name` (a path inside a layer, or outside
        the layers): its own layers', and on rank 0 everything outside the layers. Set by `select`."""
        if name.startswith(self.layer_prefix):
            layer = name[len(self.layer_prefix):].split(".", 1)[0]
            return layer.isdigit() and int(layer) in self.layers
        return self.is_first


def prune(module: nn.Module, prefix: str, keep_prefix: str) -> None:
    """Replace every child of `module` outside `keep_prefix` (and not above it) with an empty
    module, so its parameters are never made."""
    for name, child in list(module.items()):
        path = f"{prefix}{name}."
        if keep_prefix.startswith(path):
            if isinstance(child, nn.Module):
                prune(child, path, keep_prefix)
        elif not path.startswith(keep_prefix):
            if isinstance(child, mx.array):
                del module[name]
            else:
                module[name] = nn.Module()


# -- bounded waits ---------------------------------------------------------------------------------


class Watchdog:
    """Ends the process with one line when an armed wait outlives its deadline: the backends'
    receives cannot time out themselves, and a stuck peer must not hang every rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.deadline: float | None = None
        self.what = ""
        self.seconds = 0.0
        threading.Thread(target=self._watch, name="strata-pipeline-watchdog", daemon=True).start()

    @contextmanager
    def armed(self, seconds: float, what: str):
        self.what, self.seconds = what, seconds
        self.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(f"strata: rank {self.rank}: no answer from the other ranks within "
                                 f"{self.seconds:g} s ({self.what}); ending (--pipeline-timeout)\n")
                sys.stderr.flush()
                os._exit(EXIT_CODE)


def lost_peer(rank: int, error: Exception) -> PipelineError:
    return PipelineError(f"rank {rank}: a rank of the pipeline went away ({error}); see its error above")


def barrier(group, rank: int) -> None:
    """Wait until every rank has loaded its stage (a rank that failed to load ends the others)."""
    try:
        mx.eval(mx.distributed.all_sum(mx.array([1], dtype=mx.int32), group=group))
    except RuntimeError as e:
        raise lost_peer(rank, e) from None


# -- rank 0 --------------------------------------------------------------------------------------


class Link:
    """Rank 0's end of the pipeline: state calls queued for the other ranks, windows sent."""

    def __init__(self, group, stage: Stage, hidden_size: int, timeout: float):
        self.group, self.stage, self.hidden_size, self.timeout = group, stage, hidden_size, timeout
        self.calls: deque[tuple[int, int, int]] = deque()
        self.next_id = 0
        self.is_open = True  # the other ranks are there (closing tells them to end)
        self.in_sync = True  # no window was left half done
        self.watchdog = Watchdog(0)
        atexit.register(self.close)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def queue(self, call: int, a: int, b: int = 0) -> None:
        if self.is_open:
            self.calls.append((call, a, b))

    def header(self, kind: int, fields: Sequence[int] = (0, 0, 0, 0, 0, 0)) -> mx.array:
        calls = []
        while self.calls and len(calls) < MAX_CALLS:
            calls.append(self.calls.popleft())
        values = [kind, *fields, len(calls)] + [v for call in calls for v in call]
        return mx.array(values + [0] * (HEADER_INTS - len(values)), dtype=mx.int32)

    def send_calls(self) -> None:
        """Send queued calls that do not fit in the next header on their own."""
        while len(self.calls) > MAX_CALLS:
            self._eval_send(self.header(CALLS))

    def through(self, h: mx.array, remote: "RemoteStages", last_only: bool) -> mx.array:
        """Send a window's hidden rows (1, T, D) to rank 1 and return the last stage's (1, T or 1, D)."""
        if not (self.is_open and self.in_sync):
            raise PipelineError("rank 0: the pipeline is closed (a rank went away or a window was interrupted)")
        pos0, T, mode = remote.window
        self.send_calls()
        header = self.header(RUN, (remote.id, pos0, T, MODES.index(mode), int(last_only), DTYPES.index(h.dtype)))
        try:
            # The header leaves once rank 0's rows are ready, so rank 1 wakes once for both.
            sent_header = mx.distributed.send(mx.depends(header, h), 1, group=self.group)
            mx.async_eval(mx.distributed.send(mx.depends(h, sent_header), 1, group=self.group))
            back = mx.distributed.recv((1, 1 if last_only else T, self.hidden_size), h.dtype, self.stage.ranks - 1,
                                       group=self.group)
            with self.watchdog.armed(self.timeout, f"a window of {T} rows at position {pos0}"):
                mx.eval(back)
        except RuntimeError as e:
            self.is_open = False
            raise lost_peer(0, e) from None
        except BaseException:  # interrupted mid-window: rows may be in flight, so no more windows
            self.in_sync = False
            raise
        return back

    def gather(self, ids: Sequence[int]) -> list[list[tuple]]:
        """The other ranks' layer states of each of their snapshots `ids`: per snapshot, every
        later layer's state in layer order (arrays shared between snapshots arrive once)."""
        description, arrays = self.exchange(GATHER, {"ids": list(ids), "parts": []}, [])
        states = [[] for _ in ids]
        for part in description["parts"]:  # rank 1's, then rank 2's, ...
            for c, encoded in enumerate(part):
                states[c].extend(decode_states(encoded, arrays))
        return states

    def scatter(self, ids: Sequence[int], lengths: Sequence[int], parts: Sequence[Sequence[Sequence[tuple]]],
                dtype: mx.Dtype) -> tuple[int, str] | None:
        """Give ranks 1..N-1 their layer states (`parts[r - 1]`: per snapshot, its layers' states),
        each checked there against its own layers and kept as snapshot `ids[c]` when all fit.
        Returns the first (snapshot index, problem) a rank found, or None."""
        arrays, index = [], {}
        encoded = [[encode_states(states, arrays, index) for states in part] for part in parts]
        description, _ = self.exchange(SCATTER, {"ids": list(ids), "lengths": list(lengths), "parts": encoded,
                                                 "dtype": DTYPES.index(dtype), "problems": []}, arrays)
        return next((tuple(problem) for problem in description["problems"] if problem), None)

    def exchange(self, kind: int, description: dict, arrays: list) -> tuple[dict, list]:
        """Send a message round the ranks (1, 2, ..., N-1, back to 0), each rank adding to it."""
        if not (self.is_open and self.in_sync):
            raise PipelineError("rank 0: the pipeline is closed (a rank went away or a window was interrupted)")
        self.send_calls()
        try:
            with self.watchdog.armed(self.timeout, "passing saved states between the ranks"):
                mx.eval(mx.distributed.send(self.header(kind), 1, group=self.group))
                send_message(description, arrays, 1, self.group)
                return recv_message(self.stage.ranks - 1, self.group)
        except RuntimeError as e:
            self.is_open = False
            raise lost_peer(0, e) from None
        except BaseException:
            self.in_sync = False
            raise

    def close(self) -> None:
        """Tell the other ranks to end (at exit; after a failure there is no one to tell)."""
        if self.is_open:
            self.calls.clear()
            self.is_open = False
            try:
                with self.watchdog.armed(self.timeout, "closing the pipeline"):
                    mx.eval(mx.distributed.send(self.header(EXIT), 1, group=self.group))
            except RuntimeError:
                pass

    def _eval_send(self, header: mx.array) -> None:
        try:
            with self.watchdog.armed(self.timeout, "sending state calls"):
                mx.eval(mx.distributed.send(header, 1, group=self.group))
        except RuntimeError as e:
            self.is_open = False
            raise lost_peer(0, e) from None


class RemoteSnapshot:
    """A snapshot the other ranks hold of their layers' states, dropped there when this goes."""

    def __init__(self, link: Link):
        self.id = link.new_id()
        weakref.finalize(self, link.queue, DROP_SNAPSHOT, self.id)


class RemoteStages:
    """The state of every layer rank 0 does not hold, as one entry of its engine's states: each
    call is queued for the other ranks, which make it on their own layers' states."""

    def __init__(self, link: Link):
        self.link = link
        self.id = link.new_id()
        self.window: tuple[int, int, Mode] | None = None
        weakref.finalize(self, link.queue, DROP_STATES, self.id)

    def begin(self, pos0: int, T: int, mode: Mode) -> None:
        self.window = (pos0, T, mode)

    def commit(self, keep: int) -> None:
        self.link.queue(COMMIT, self.id, keep)

    def abandon(self) -> None:
        self.link.queue(ABANDON, self.id)

    def flush(self) -> None:
        pass  # the other ranks flush their states when they snapshot them

    def snapshot(self) -> tuple:
        snap = RemoteSnapshot(self.link)
        self.link.queue(SNAPSHOT, self.id, snap.id)
        return (snap,)

    def restore(self, snap: tuple) -> None:
        (saved,) = snap
        if not isinstance(saved, RemoteSnapshot):
            raise ConfigError("this snapshot was not taken across these ranks")
        self.link.queue(RESTORE, self.id, saved.id)

    def tensors(self) -> dict[str, mx.array]:
        return {}  # held by the other ranks

    @staticmethod
    def check_snapshot(snap: tuple, like: tuple, length: int) -> str | None:
        if len(snap) == 1 and isinstance(snap[0], RemoteSnapshot):  # placed there (PipelineModel.place)
            return None
        return "saved state of other ranks' layers cannot be restored from outside"


class PipelineModel:
    """What rank 0's window engine runs: the embeddings and rank 0's layers, the other ranks'
    layers through the link, then the final norm and the output head."""

    def __init__(self, model, stage: Stage, link: Link):
        self.model, self.stage, self.link = model, stage, link
        self.config = model.config
        self.state_kinds = [*stage.kinds, ("ranks", {"make": lambda: RemoteStages(link)})]
        self.pipeline_summary = stage.summary()
        self.verification = getattr(model, "verification", None)
        self.expert_cache = getattr(model, "expert_cache", None)  # rank 0's layers' streamed experts
        self.load_notes = getattr(model, "load_notes", ())

    def whole_layout(self, options: EngineOptions) -> list[str]:
        """The whole model's per-layer state type names, as one process's engine has them."""
        return [type(make_state(kind, params, options)).__name__ for kind, params in self.stage.whole_kinds]

    def gather(self, snapshots: Sequence[Snapshot]) -> list[Snapshot]:
        """Rank 0's engine snapshots as one process's: every layer's state, the later ranks' sent here."""
        ids = []
        for snap in snapshots:
            (remote,) = snap.states[-1]
            ids.append(remote.id)
        later = self.link.gather(ids)
        return [Snapshot(snap.length, tuple(snap.states[:-1]) + tuple(states)) for snap, states in zip(snapshots, later)]

    def place(self, snapshots: Sequence[Snapshot]) -> list[Snapshot]:
        """One process's snapshots (every layer's state) as rank 0's engine holds them: the later
        ranks' layers' states sent to those ranks, checked and kept there.

        Raises:
            SnapshotError: a snapshot with another number of layer states, or one a rank's layers
                cannot have made (naming the checkpoint and the layer).
        """
        counts = self.stage.state_counts
        for c, snap in enumerate(snapshots):
            if len(snap.states) != sum(counts):
                raise SnapshotError(f"checkpoint {c}: {len(snap.states)} layers, this model has {sum(counts)}")
        remotes = [RemoteSnapshot(self.link) for _ in snapshots]
        parts, start = [], counts[0]
        for count in counts[1:]:
            parts.append([snap.states[start:start + count] for snap in snapshots])
            start += count
        problem = self.link.scatter([r.id for r in remotes], [snap.length for snap in snapshots], parts,
                                    compute_dtype(self.model))
        if problem is not None:
            c, text = problem
            raise SnapshotError(f"checkpoint {c} ({snapshots[c].length} positions): {text}")
        return [Snapshot(snap.length, tuple(snap.states[:counts[0]]) + ((remote,),))
                for snap, remote in zip(snapshots, remotes)]

    def __call__(self, tokens: mx.array, states: list, *, last_only: bool = False) -> mx.array:
        h = self.model.run_layers(self.model.embed(tokens), states[:-1], 0, self.stage.layers.stop)
        return self.model.head(self.link.through(h, states[-1], last_only), last_only=last_only)


# -- ranks 1..N-1 ----------------------------------------------------------------------------------


class StageFollower:
    """A rank after the first: runs its layers on the windows rank 0 sends, makes the state
    calls rank 0's engine made, and sends the rows on; never prints to stdout."""

    def __init__(self, model, stage: Stage, group, options: EngineOptions, timeout: float):
        self.model, self.stage, self.group, self.options, self.timeout = model, stage, group, options, timeout
        self.states: dict[int, list] = {}
        self.modes: dict[int, Mode] = {}
        self.saved: dict[int, list] = {}
        self.watchdog = Watchdog(stage.rank)
        self.expert_cache = getattr(model, "expert_cache", None)  # this rank's layers' streamed experts
        self.like: list[tuple] | None = None  # what this rank's layers' snapshots hold (`check`)
        self.source = stage.rank - 1
        self.target = (stage.rank + 1) % stage.ranks

    def serve(self) -> int:
        """Serve rank 0 until it says the run is over; returns the exit status."""
        rank = self.stage.rank
        # Ctrl-C reaches every rank: rank 0 winds down and tells this one (or its link drops).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while True:
                header = mx.distributed.recv((HEADER_INTS,), mx.int32, self.source, group=self.group)
                mx.eval(header)  # unbounded: rank 0 may wait for its next request
                if not self.stage.is_last:
                    with self.watchdog.armed(self.timeout, "passing a header on"):
                        mx.eval(mx.distributed.send(header, self.target, group=self.group))
                values = header.tolist()
                kind, n = values[0], values[7]
                for i in range(n):
                    self.call(*values[8 + 3 * i: 11 + 3 * i])
                if kind == EXIT:
                    return 0
                if kind == RUN:
                    self.run(*values[1:7])
                if kind in (GATHER, SCATTER):
                    self.exchange(kind)
        except PipelineError as e:  # rank 0 asked for something this rank does not hold
            sys.stderr.write(f"strata: {e}\n")
            return EXIT_CODE
        except RuntimeError as e:
            sys.stderr.write(f"strata: {lost_peer(rank, e)}\n")
            return EXIT_CODE

    def set_of(self, state_id: int) -> list:
        if state_id not in self.states:
            self.states[state_id] = [make_state(kind, params, self.options) for kind, params in self.stage.kinds]
        return self.states[state_id]

    def call(self, call: int, a: int, b: int) -> None:
        if call == COMMIT:
            states = self.set_of(a)
            for state in states:
                state.commit(b)
            if self.modes.get(a) is Mode.COMMIT_ALL:  # a prompt chunk: evaluate now, as rank 0 does
                mx.eval([v for state in states for v in state.snapshot() if isinstance(v, mx.array)])
        elif call == ABANDON:
            for state in self.set_of(a):
                state.abandon()
        elif call == SNAPSHOT:
            self.saved[b] = [state.snapshot() for state in self.set_of(a)]
        elif call == RESTORE:
            for state, saved in zip(self.set_of(a), self.saved[b]):
                state.restore(saved)
        elif call == DROP_STATES:
            self.states.pop(a, None)
            self.modes.pop(a, None)
        elif call == DROP_SNAPSHOT:
            self.saved.pop(a, None)
        else:
            raise PipelineError(f"rank {self.stage.rank}: unknown state call {call} from rank 0")

    def run(self, state_id: int, pos0: int, T: int, mode: int, last_only: int, dtype: int) -> None:
        states, mode = self.set_of(state_id), MODES[mode]
        self.modes[state_id] = mode
        with self.watchdog.armed(self.timeout, f"a window of {T} rows at position {pos0}"):
            h = mx.distributed.recv((1, T, self.model.config.hidden_size), DTYPES[dtype], self.source,
                                    group=self.group)
            h = self.forward(h, states, pos0, mode)
            if self.stage.is_last and last_only:
                h = h[:, -1:]
            mx.eval(mx.distributed.send(h, self.target, group=self.group))

    def forward(self, h: mx.array, states: list, pos0: int, mode: Mode) -> mx.array:
        """This rank's layers over a window's rows, its states opened for the window."""
        for state in states:
            state.begin(pos0, h.shape[1], mode)
        layers, cache = self.stage.layers, self.expert_cache
        if cache is not None:  # as WindowEngine does: experts are read while the graph is built
            cache.begin_window(kind="prefill" if mode is Mode.COMMIT_ALL else "decode")
        h = self.model.run_layers(h, states, layers.start, layers.stop)
        if cache is not None:
            cache.end_window()
        return h

    def exchange(self, kind: int) -> None:
        """Add this rank's states of the snapshots rank 0 names to the message going round
        (GATHER), or take and check its own from it (SCATTER), and pass it on."""
        with self.watchdog.armed(self.timeout, "passing saved states between the ranks"):
            description, arrays = recv_message(self.source, self.group)
        if kind == GATHER:
            missing = [i for i in description["ids"] if i not in self.saved]
            if missing:
                raise PipelineError(f"rank {self.stage.rank}: rank 0 asked for snapshot {missing[0]}, not held here")
            index = {id(a): k for k, a in enumerate(arrays)}
            description["parts"].append([encode_states(self.saved[i], arrays, index) for i in description["ids"]])
        else:
            mine, *later = description["parts"]
            snapshots = [decode_states(encoded, arrays) for encoded in mine]
            problem = self.check(snapshots, description["lengths"], DTYPES[description["dtype"]])
            if problem is None:
                for i, states in zip(description["ids"], snapshots):
                    self.saved[i] = states
            description["problems"].append(problem)
            received, arrays, index = arrays, [], {}  # pass on only what the later ranks take
            description["parts"] = [[encode_states(decode_states(encoded, received), arrays, index)
                                     for encoded in part] for part in later]
        with self.watchdog.armed(self.timeout, "passing saved states between the ranks"):
            send_message(description, arrays, self.target, self.group)

    def check(self, snapshots: list[list[tuple]], lengths: list[int], dtype: mx.Dtype) -> tuple[int, str] | None:
        """The first (snapshot index, problem) with states this rank's layers cannot have made
        after that snapshot's length (`LayerState.check_snapshot`), or None."""
        states = [make_state(kind, params, self.options) for kind, params in self.stage.kinds]
        if self.like is None:  # as WindowEngine.snapshot_like: a one-row window on scratch state, never evaluated
            scratch = [make_state(kind, params, self.options) for kind, params in self.stage.kinds]
            self.forward(mx.zeros((1, 1, self.model.config.hidden_size), dtype), scratch, 0, Mode.WINDOW)
            self.like = [tuple(ArraySpec.of(v) for v in state.snapshot()) for state in scratch]
        for c, (saved, length) in enumerate(zip(snapshots, lengths)):
            if len(saved) != len(states):
                return c, f"{len(saved)} layer states for rank {self.stage.rank}, whose layers have {len(states)}"
            for i, (state, slots, spec) in enumerate(zip(states, saved, self.like)):
                problem = state.check_snapshot(tuple(slots), spec, length)
                if problem:
                    return c, f"layer {self.stage.state_offset + i} ({type(state).__name__}): {problem}"
        return None
