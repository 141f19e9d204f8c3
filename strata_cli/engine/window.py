"""WindowEngine: run a window of [root, d1..dD] in one forward pass, then commit a prefix.

The contract (docs/design.md, "The window contract"):

- `run(tokens, pos0)` takes T = 1 + D tokens at positions pos0..pos0+T-1 and returns, for every
  row i, the logits and the greedy token out[i], the prediction for position pos0+i+1. It does not
  change committed state (in partial mode the root row, always kept, commits inside the run).
- `commit(keep)`, 1 <= keep <= T, exactly once per run, leaves every state equal to serially
  processing tokens[:keep].

`launch(token, pos0)` is serial decoding's overlapped form of a 1-row run: its token may be the
previous launch's greedy output still on the device, and it returns without waiting, so the
caller builds the next step while the device computes this one (mlx-lm's `async_eval` habit).
It changes no committed state until `commit(1)`; `abandon()` closes it instead.

A transaction guard turns every misuse (a second run before commit, a second commit, a keep out
of range, a window that does not start at the committed length) into a `WindowError`.

Shapes: a backend that builds kernels per shape (MLX's CUDA backend) pays for each new window
size once. With padding on, a window of T rows runs as its row bucket (1, 2, 4 or 8 rows), the
extra rows repeating the last token: under row invariance a row computes what it computes alone,
so the real rows' outputs are those of the unpadded window, bit for bit, and commit never keeps
a padded row (keep <= T). Each bucket is warmed once, at load (`warm_up`) or before the window
that first needs it (`ensure_warm`), on scratch state.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from metal_shaders.argmax_rows import device_argmax, host_argmax
from metal_shaders.pooled import device_ints

from ..options import PREFILL_CHUNK, ConfigError, EngineOptions
from .sliding_state import SlidingKVState
from .compressed_state import CompressedAttentionState
from .state import ArraySpec, GDNState, KVState, LatentKVState, Mamba2State, Mode

# Prompt rows per chunk on a GPU: on the H200 (80B-A3B shape, 4,096 tokens) 2,048-row chunks
# prefill at 7,699 tok/s against 6,736 with PREFILL_CHUNK's 512 (docs/benchmarks.md, "H200:
# prefill of the 80B-A3B shape");
# the CPU keeps 512 (1,024 is no faster there and holds twice the activations).
GPU_PREFILL_CHUNK = 2048


# The row counts a padded window runs: the compiled row capacities of metal_shaders/rows_matvec.py.
WINDOW_BUCKETS = (1, 2, 4, 8)


def default_prefill_chunk() -> int:
    """Prompt rows per chunk on the running backend."""
    return PREFILL_CHUNK if mx.default_device() == mx.cpu else GPU_PREFILL_CHUNK


def on_gpu() -> bool:
    """Whether the default device is a GPU (its backend builds kernels per shape)."""
    return mx.default_device().type != mx.cpu


def row_bucket(T: int) -> int:
    """The smallest bucket of WINDOW_BUCKETS that holds T rows (T itself past the largest)."""
    return next((b for b in WINDOW_BUCKETS if b >= T), T)


class WindowError(RuntimeError):
    """The window contract was broken by the caller."""


class SnapshotError(ValueError):
    """A snapshot from outside (a session file) that this engine's model cannot have made: the
    message names the layer, the slot and what is wrong."""


@dataclass(frozen=True)
class WindowOutput:
    logits: mx.array  # (T, V) float32 (lazy: a greedy caller never pays for the cast)
    tokens: list[int]  # greedy out[i] for each row


@dataclass(frozen=True)
class PendingToken:
    """A greedy token the device may still be computing (`WindowEngine.launch`)."""

    array: mx.array  # (1, 1) int32

    def value(self) -> int:
        """The token id (waits for the device)."""
        return self.array.item()


@dataclass(frozen=True)
class Snapshot:
    length: int
    states: tuple


def make_state(kind: str, params: dict, options: EngineOptions):
    if kind == "kv":
        return KVState()
    if kind == "latent_kv":
        return LatentKVState()
    if kind == "gdn":
        return GDNState(params["conv_kernel"], lazy=options.fold == "lazy")
    if kind == "mamba2":
        return Mamba2State(params["conv_kernel"], lazy=options.fold == "lazy")
    if kind == "ranks":  # the later pipeline stages' layers, whose states the other ranks hold (distributed.py)
        return params["make"]()
    if kind == "sliding_kv":
        return SlidingKVState(params["window"])
    if kind == "compressed_attention":
        return CompressedAttentionState(compress_rate=params["compress_rate"], head_dim=params["head_dim"],
                                        index_head_dim=params["index_head_dim"], rollback=options.compressed_rollback)
    raise ValueError(f"unknown layer state kind {kind!r}")


def compressed_block(state_kinds) -> int | None:
    """The block every compressed layer's windows close on (the smallest compress rate), or None
    without compressed layers. The cap `block - pos0 % block` is each layer's own cap or smaller
    when every rate is a multiple of it.

    Raises:
        ConfigError: a rate that is not a multiple of the smallest.
    """
    rates = sorted({p["compress_rate"] for kind, p in state_kinds if kind == "compressed_attention" and p["compress_rate"]})
    if not rates:
        return None
    bad = [r for r in rates if r % rates[0]]
    if bad:
        raise ConfigError(f"compress rates {rates}: {bad} not multiples of {rates[0]}, so one block cap cannot cover them")
    return rates[0]


class WindowEngine:
    """Owns every piece of per-request model state and the only rollback logic there is.

    Args:
        model: an MLX model with `state_kinds`, `config` and `__call__(tokens, states, last_only)`.
        options: fold mode, partial mode and context limit (default `EngineOptions()`).

    Raises:
        ConfigError: `options.max_context` above the model's `max_position_embeddings`.
    """


    def __init__(self, model, options: EngineOptions | None = None):
        self.model = model
        self.options = options or EngineOptions()
        model_limit = model.config.max_position_embeddings
        if self.options.max_context is not None and self.options.max_context > model_limit:
            raise ConfigError(
                f"max_context {self.options.max_context} is above this model's limit of {model_limit} "
                "positions (max_position_embeddings)"
            )
        self.max_context = self.options.max_context or model_limit
        self.vocab_size = model.config.vocab_size
        self.states = [make_state(kind, params, self.options) for kind, params in model.state_kinds]
        self.length = 0  # committed positions
        self._open: tuple[int, int, Mode] | None = None  # (pos0, T, mode) of a run awaiting commit
        # Streamed experts (experts/cache.py): performance state, told where windows start, never rewound.
        self.expert_cache = getattr(model, "expert_cache", None)
        self.prefill_expert_bytes = 0  # bytes the last prefill read from the expert files
        self._like: Snapshot | None = None  # snapshot_like(), made once
        self.block = compressed_block(model.state_kinds)
        # Compressor tails kept in rings (`--compressed-rollback cap`) are exact only for windows
        # that stay within one compressor block (speculative/safe_window.py's block cap).
        self.needs_block_cap = self.block is not None and self.options.compressed_rollback == "cap"
        pad = self.options.pad_windows
        if pad and self.needs_block_cap:
            raise ConfigError("windows cannot be padded to row buckets when they are capped at the compressor "
                              "block (--compressed-rollback cap): a padded row would write past the cap")
        # A padded row writes state a capped window may not touch, so capped engines never pad.
        self.pads_windows = (on_gpu() and self.expert_cache is None and not self.needs_block_cap) if pad is None else pad
        # Warm each window shape before first use, off the window's clock (EngineOptions.warm_shapes).
        self.warms_on_first_use = self.options.warm_shapes is None and on_gpu()
        self.warm_rows: set[int] = set()  # window row counts this process has run
        self.prompt_rows_cap: int | None = None  # `cap_prompt_chunks`

    # -- the window contract -------------------------------------------------------------------

    def run(self, tokens: Sequence[int], pos0: int) -> WindowOutput:
        """Process `tokens` at positions pos0.. and return every row's logits and greedy token."""
        if self._open is not None:
            raise WindowError(f"run() called again before commit() of the window at {self._open[0]}")
        T = len(tokens)
        self._check_window(tokens, pos0)
        mode = Mode.PARTIAL if self.options.partial else Mode.WINDOW
        rows = self.window_rows(T, pos0)
        ids = list(tokens) + [tokens[-1]] * (rows - T)  # padded rows: never kept (commit checks keep <= T)
        logits = self._forward(device_ints(ids, row=True), pos0, mode).squeeze(0)  # [0] would be 2 ops
        if logits.dtype == mx.float32 and self._host_logits(rows):
            greedy = np.argmax(np.asarray(logits), axis=-1).tolist()  # np.argmax breaks ties as mx.argmax does
        else:  # the argmax of the logits' own dtype: their float32 cast is exact, keeps every order and tie
            greedy = host_argmax(logits)
            logits = logits.astype(mx.float32)  # made only where a caller reads it (sampling, processors)
        self.warm_rows.add(rows)
        self._open = (pos0, T, mode)
        if mode is Mode.PARTIAL:
            self.length = pos0 + 1
        return WindowOutput(logits=logits[:T] if rows > T else logits, tokens=greedy[:T])

    def cap_prompt_chunks(self, rows: int | None) -> None:
        """Run prompts in chunks of at most `rows` rows (None: as asked): while a fresh GPU
        machine's workers compile the prompt path's kernels in the background (kernel_warm.py),
        a prompt runs on the kernels its windows use. Any chunking commits the same states,
        up to the rounding of the kernels that run (the window contract leaves prompts open)."""
        self.prompt_rows_cap = rows

    def window_rows(self, T: int, pos0: int) -> int:
        """Rows a window of T tokens at pos0 runs: its bucket when padding is on and the bucket
        fits the context, else T."""
        rows = row_bucket(T) if self.pads_windows else T
        return rows if pos0 + rows <= self.max_context else T

    def launch(self, token: int | PendingToken, pos0: int) -> PendingToken:
        """Start a 1-row window at pos0 and return its greedy token without waiting for it.

        `token` is an id or the `PendingToken` of the previous launch (committed already), so
        the device never waits for the host between steps. Nothing commits until `commit(1)`;
        `abandon()` instead leaves committed state as it was (an end-of-sequence token came
        back meanwhile). Only for engines whose forward pass never reads values back
        (`can_overlap`).
        """
        if self._open is not None:
            raise WindowError(f"launch() called before commit() of the window at {self._open[0]}")
        if isinstance(token, PendingToken):
            self._check_window([0], pos0)  # an argmax over the vocabulary: always a valid id
            ids = token.array
        else:
            self._check_window([token], pos0)
            ids = mx.array([[token]])
        logits = self._forward(ids, pos0, Mode.WINDOW)
        # Logits the host computed: the token too, so that the next step never waits on MLX.
        if logits.dtype == mx.float32 and self._host_logits(1):
            greedy = mx.array(np.argmax(np.asarray(logits)[0], axis=-1, keepdims=True).astype(np.uint32))
        else:
            greedy = device_argmax(logits.squeeze(0))  # [0] would be 2 ops; run()'s argmax
            mx.async_eval(greedy)
        self.warm_rows.add(1)
        self._open = (pos0, 1, Mode.WINDOW)
        return PendingToken(greedy)

    def abandon(self) -> None:
        """Close the last `launch()` without committing anything."""
        if self._open is None or self._open[2] is not Mode.WINDOW:
            raise WindowError("abandon() needs an open launch() (a partial run has committed its root)")
        for state in self.states:
            state.abandon()
        self._open = None

    @property
    def can_overlap(self) -> bool:
        """Whether serial decoding should overlap its steps with `launch`: the host builds the
        next step while the device (or MLX's CPU stream) runs this one. On the 2-core CPU too,
        with the layers' ends compiled: overlapped, serial decoding on the demo model runs at
        1.06-1.34x mlx-lm's tok/s, 0.88-0.91x without (docs/benchmarks.md, "CPU, demo model:
        one-token steps overlap"). Not with streamed experts, which read routing back while the
        graph is built."""
        return self.expert_cache is None

    def commit(self, keep: int) -> None:
        """Commit the first `keep` inputs of the last run."""
        if self._open is None:
            raise WindowError("commit() without an open run (each run commits exactly once)")
        pos0, T, _ = self._open
        if not isinstance(keep, int) or not 1 <= keep <= T:
            raise WindowError(f"commit keep must be in 1..{T} for this window, got {keep!r}")
        for state in self.states:
            state.commit(keep)
        self.length = pos0 + keep
        self._open = None

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        chunk: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> mx.array | None:
        """Process and commit `tokens` at the committed length, in chunks of `chunk` rows
        (default `default_prefill_chunk()`).

        Prompt rows are always kept, so every state commits inside the run and nothing is
        folded twice. Returns the last row's logits (V,), or None for no tokens.
        """
        if self._open is not None:
            raise WindowError("prefill() while a run awaits commit()")
        logits = None
        self.prefill_expert_bytes = 0
        chunk = min(chunk or default_prefill_chunk(), self.prompt_rows_cap or math.inf)
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            self._check_window(piece, self.length)
            logits = self._forward(mx.array([list(piece)]), self.length, Mode.COMMIT_ALL, last_only=True)
            for state in self.states:
                state.commit(len(piece))
            self.length += len(piece)
            mx.eval(logits, self._committed_arrays())
            if progress:
                progress(len(piece))
        return None if logits is None else logits[0, -1].astype(mx.float32)

    def warm_up(self, max_T: int, chunk: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> dict[int, float]:
        """Warm every window shape of T = 1..max_T rows once (`warm`), and with `chunk` one
        prefill chunk of that many rows (fewer when the context is smaller).

        With padding that is one shape per row bucket (four for T <= 8), else one per T. No
        shape depends on keep: a commit slices the window's rows, and the next window's fold
        scans them with the window's own scan. Needs an engine that holds nothing; it holds
        nothing afterwards.

        Returns:
            seconds spent per window row count, in the order warmed (`progress(done, total)`
            is called before the first and after each).
        """
        self._require_closed("warm_up")
        if self.length:
            raise WindowError(f"warm_up() needs an empty engine, this one holds {self.length} positions")
        if chunk:
            self.prefill([i % self.vocab_size for i in range(self.prompt_rows(chunk))])
            self.reset()
        shapes = self.window_shapes(max_T)
        seconds = {}
        if progress:
            progress(0, len(shapes))
        for done, rows in enumerate(shapes, 1):
            seconds[rows] = self.warm(rows)
            if progress:
                progress(done, len(shapes))
        return seconds

    def window_shapes(self, max_T: int) -> list[int]:
        """The row counts windows of T = 1..max_T run at position 0 (`warm_up` warms each once)."""
        return sorted({self.window_rows(T, 0) for T in range(1, min(max_T, self.max_context - 1) + 1)})

    def prompt_rows(self, chunk: int) -> int:
        """The rows a prompt chunk of `chunk` runs as its first (fewer when the context is smaller)."""
        return max(1, min(chunk, self.max_context - 1))

    def needs_warm(self, T: int, pos0: int) -> bool:
        """Whether a window of T tokens at pos0 would be the first of its shape, on an engine
        that warms shapes on first use."""
        return self.warms_on_first_use and self.window_rows(T, pos0) not in self.warm_rows

    def ensure_warm(self, T: int, pos0: int) -> float:
        """Warm the shape of a window of T tokens at pos0 if it is new (`needs_warm`); the
        seconds spent (0.0 when nothing was warmed). Call it between windows, outside their
        timing, so no window and no cost sample carries a kernel build."""
        return self.warm(self.window_rows(T, pos0)) if self.needs_warm(T, pos0) else 0.0

    def warm(self, rows: int) -> float:
        """Run windows of exactly `rows` rows on scratch state: one keeping one row, one keeping
        every row, then a one-row window that folds the first's kept row. The engine's own
        state is untouched. Returns the seconds spent."""
        self._require_closed("warm")
        states, length, pads = self.states, self.length, self.pads_windows
        self.states = [make_state(kind, params, self.options) for kind, params in self.model.state_kinds]
        self.length, self.pads_windows = 0, False  # `rows` as given: a bucket, or a window near the context's end
        start = time.perf_counter()
        try:
            tokens = [i % self.vocab_size for i in range(rows)]
            for keep in (1, rows):
                if self.length + rows + 1 > self.max_context:
                    break
                self.run(tokens, self.length)
                self.commit(keep)
            if self.length + 1 <= self.max_context:
                self.run([0], self.length)  # the last commit's fold
                self.commit(1)
            mx.eval(self._committed_arrays())
        finally:
            self.states, self.length, self.pads_windows, self._open = states, length, pads, None
        return time.perf_counter() - start

    # -- committed state -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Committed state as references (pending lazy folds are flushed first)."""
        self._require_closed("snapshot")
        return Snapshot(self.length, tuple(state.snapshot() for state in self.states))

    def restore(self, snap: Snapshot) -> None:
        self._require_closed("restore")
        for state, saved in zip(self.states, snap.states):
            state.restore(saved)
        self.length = snap.length

    def snapshot_like(self) -> Snapshot:
        """What this model's snapshots hold, slot by slot: `ArraySpec`s (shape and dtype) and
        the ints, from a one-row window run on scratch state and dropped unevaluated (streamed
        experts are read as the graph is built). Committed state is untouched; made once."""
        if self._like is None:
            self._require_closed("snapshot_like")
            states = self.states
            self.states = [make_state(kind, params, self.options) for kind, params in self.model.state_kinds]
            try:
                self._forward(mx.array([[0]]), 0, Mode.WINDOW, last_only=True)
                like = tuple(tuple(ArraySpec.of(v) for v in state.snapshot()) for state in self.states)
            finally:
                self.states = states
            self._like = Snapshot(1, like)
        return self._like

    def check_snapshot(self, snap: Snapshot) -> None:
        """Check that `snap` could be this engine's committed state: one state per layer, every
        slot of the shape, dtype and value this model's layer gives it after `snap.length`
        positions (`LayerState.check_snapshot`). Values of the right shape are not checked:
        nothing can tell a changed one from a real one.

        Raises:
            SnapshotError: naming the layer, its state type and the slot that does not fit.
        """
        like = self.snapshot_like()
        if not isinstance(snap.length, int) or not 0 <= snap.length <= self.max_context:
            raise SnapshotError(f"length {snap.length!r} is outside this engine's context of {self.max_context}")
        if len(snap.states) != len(self.states):
            raise SnapshotError(f"{len(snap.states)} layers, this model has {len(self.states)}")
        for i, (state, saved, spec) in enumerate(zip(self.states, snap.states, like.states)):
            problem = state.check_snapshot(tuple(saved), spec, snap.length)
            if problem:
                raise SnapshotError(f"layer {i} ({type(state).__name__}): {problem}")

    def reset(self) -> None:
        """Forget everything: the next window starts at position 0."""
        self.states = [make_state(kind, params, self.options) for kind, params in self.model.state_kinds]
        self.length = 0
        self._open = None

    def state_tensors(self) -> list[dict[str, mx.array]]:
        """Every layer's committed tensors (flushing lazy folds), for checkpoints and tests."""
        self._require_closed("state_tensors")
        return [state.tensors() for state in self.states]

    def context_left(self, pos0: int) -> int:
        """Positions still free at and after pos0."""
        return self.max_context - pos0

    # -- internals -----------------------------------------------------------------------------

    def _check_window(self, tokens: Sequence[int], pos0: int) -> None:
        T = len(tokens)
        if T < 1:
            raise WindowError("a window needs at least one token")
        if pos0 != self.length:
            raise WindowError(f"window starts at {pos0} but the committed length is {self.length}")
        if pos0 + T > self.max_context:
            raise WindowError(
                f"window of {T} at position {pos0} exceeds the context limit of {self.max_context}"
            )
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise WindowError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")

    def last_window_experts(self):
        """The expert cache's counters of the last run (`telemetry.ExpertWindowStats`), or None."""
        return self.expert_cache.last_window if self.expert_cache is not None else None

    @property
    def draft_read_cost(self) -> Callable[[int], float] | None:
        """Predicted seconds a window of T rows spends reading its drafts' cold experts (the
        controller's `extra_cost`), or None when experts do not stream."""
        return self.expert_cache.draft_read_cost if self.expert_cache is not None else None

    def _forward(self, ids: mx.array, pos0: int, mode: Mode, *, last_only: bool = False):
        """ids (1, T) -> logits (1, T or 1, V), the states opened for the window."""
        T = ids.shape[1]
        for state in self.states:
            state.begin(pos0, T, mode)
        if self.expert_cache is None:
            return self.model(ids, self.states, last_only=last_only)
        # Every MoE block reads its experts while the graph is built, so the window ends here.
        self.expert_cache.begin_window(kind="prefill" if mode is Mode.COMMIT_ALL else "decode")
        out = self.model(ids, self.states, last_only=last_only)
        stats = self.expert_cache.end_window()
        if mode is Mode.COMMIT_ALL:
            self.prefill_expert_bytes += stats.bytes_read + stats.prefetched_bytes
        return out

    def _host_logits(self, rows: int) -> bool:
        """Whether the model's head computes a window of `rows` rows' logits in numpy (layers.py:
        `DecoderStack.host_logits`), float32 and ready: the greedy tokens are then taken there."""
        host_logits = getattr(self.model, "host_logits", None)
        return host_logits is not None and host_logits(rows)

    def _committed_arrays(self) -> list[mx.array]:
        return [a for state in self.states for a in state.snapshot() if isinstance(a, mx.array)]

    def _require_closed(self, what: str) -> None:
        if self._open is not None:
            raise WindowError(f"{what}() while a run awaits commit()")
