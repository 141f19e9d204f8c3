"""ExpertCache: a bounded set of resident expert slots per MoE block, fed from the streaming layout.

Legend: N = rows (tokens), k = experts per token, E = experts, S = slots per block.

- Slot banks: per block, one (S, ...) array per record tensor (gate/up/down, or their quantized
  weight/scales/biases), so the MLX graph never changes shape; an expert->slot table maps the
  router's ids to bank rows. A read lands in a staging slot (experts/staging.py: MLX memory the
  reader writes, kept on the host and mapped for a CUDA GPU), and a pass's loads write their bank
  slots from device views of it, which the staging slot keeps (`_record_rows`: an install builds
  its writes only), by `write_slots`: one static slice update for slots in a run, else one a
  slot, whose input buffer MLX donates, so a load copies one expert, not the bank. The
  writes are left lazy: they run with the layer's compute when the next routing readback
  evaluates it (no device sync of their own).
- Demand reads: the window's union of experts at a block is pinned (nothing in it is evicted
  while it is loaded); the missing ones are read with `os.preadv` on a thread pool (O_DIRECT where
  the file system allows) and the least recently used unpinned slots take them. A union larger
  than S is served in passes of at most S experts, each pass computed before the next loads, so
  every budget of at least one slot is exact.
- Prefetch reads the next block's predicted experts into host buffers while this block and the
  next block's attention compute: "router" applies the next block's router to this block's input,
  "history" ranks experts by how often they followed this block's picks before, "off" reads on
  demand only. With `root_prefetch` only row 0 of a window drives read-ahead. A block with a
  prefetch rule (cache-aware routing's, experts/moce.py) gets the predicted router probabilities
  and its residency through that rule instead of their top-k, so read-ahead follows the picks
  MoCE will make rather than the natural ones it would replace. With `readahead_min_prob`, router
  prefetch reads only the picks some row predicts with at least that probability. Reads go
  through a `ReadQueue` (experts/reads.py): with `readahead_depth`, demand reads go first, and a
  block that routes cancels its read-aheads still queued that it did not pick and promotes the
  ones it did to demand reads.
- Preload (`preload`): free slots filled before any window, block by block in file order, so a
  cache that holds every expert never reads while decoding and the disk sees long runs.

Exactness: routing is the model's own (each token's softmax top-k, computed before the cache is
asked) unless the user opts into cache-aware routing (experts/moce.py, `is_approximate`); the cache only decides where an expert's weights sit, and the matmuls are the resident
layer's own code over the slot banks. The cache is performance state: never rewound.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from ..cuda_driver import host_mapped, is_cuda
from ..model.moe import SparseMoeBlock
from ..options import StreamOptions
from ..rows_write import write_rows
from ..telemetry import ExpertWindowStats
from .reads import ReadQueue
from .staging import StagingArea
from .store import DTYPES, BlockLayout, ExpertStore, layer_of

# Per-block counters of one window (ExpertCache._counts columns).
COUNTERS = (
    "hits", "cold_misses", "capacity_misses", "prefetch_hits", "late_prefetches", "wasted_prefetches",
    "cancelled_prefetches",  # read-aheads dropped from the queue before they reached the disk
    "bytes_read", "prefetched_bytes", "wait_seconds", "union", "cold_beyond_root", "passes",
    "substitutions", "misses_saved", "bytes_saved",  # cache-aware routing (experts/moce.py) only
    "router_sync_seconds",  # the routing readback: evaluating the ids (and whatever compute they wait on)
    "install_seconds",  # writing read records into the slot banks (the reads' own wait apart)
)
_C = {name: i for i, name in enumerate(COUNTERS)}
DECODE, PREFILL = "decode", "prefill"
# (predicted router probabilities (N, E), resident mask (E,)) -> the expert ids to read ahead
PrefetchRule = Callable[[np.ndarray, np.ndarray], np.ndarray]


class DraftReadCost:
    """Predicts the seconds a window of T rows spends reading the cold experts its drafts need
    beyond the root's: the draft-length controller's `extra_cost` when experts stream, so
    `--suffix-draft auto` weighs disk reads (docs/design.md, "Draft-length controller").

    Learned from measured decode windows, as moving averages: seconds per expert read (the
    window's wait on reads over the experts it read) and cold experts per draft row
    (`cold_beyond_root / (T - 1)`). Until a window with drafts has been measured, a draft row is
    expected to need as many non-resident experts as a one-row window's root did (its misses
    and prefetch hits): a draft row routes on its own, and `auto` decides before a window runs,
    so without this prior the first drafts (and every probe) would look free of reads however
    cold the cache. Before the first decode window nothing is known, and a draft is not taken
    blind: the prediction is infinite (the controller runs that window alone).

    Args:
        smoothing: weight of the newest window in each average (default 0.2).
    """

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds_per_read: float | None = None
        self.cold_per_draft_row: float | None = None
        self.cold_per_row: float | None = None  # non-resident experts a one-row window needed

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe(self, stats: ExpertWindowStats, rows: int) -> float:
        """Learn from one decode window of `rows` rows; return the seconds its drafts' cold
        reads took (its `cold_beyond_root` at the window's own seconds per read)."""
        reads = stats.misses + stats.late_waits
        if rows > 1:
            self.cold_per_draft_row = self._average(self.cold_per_draft_row, stats.cold_beyond_root / (rows - 1))
        else:
            self.cold_per_row = self._average(self.cold_per_row, stats.misses + stats.prefetch_hits)
        if not reads:
            return 0.0
        per_read = stats.late_wait_seconds / reads
        self.seconds_per_read = self._average(self.seconds_per_read, per_read)
        return stats.cold_beyond_root * per_read

    def __call__(self, T: int) -> float:
        """Predicted extra seconds of a window of T rows: infinite before any decode window was
        observed, 0 while no read has been measured (nothing missed)."""
        if T <= 1:
            return 0.0
        if self.cold_per_row is None and self.cold_per_draft_row is None:  # no decode window observed yet
            return math.inf
        per_row = self.cold_per_draft_row if self.cold_per_draft_row is not None else self.cold_per_row
        if self.seconds_per_read is None or per_row is None:
            return 0.0
        return (T - 1) * per_row * self.seconds_per_read


class _Block:
    """One MoE block's slots: banks, the expert->slot table, LRU order and prefetches in flight."""

    def __init__(self, layout: BlockLayout, num_slots: int, dtype: mx.Dtype, num_experts: int, layout_key: int):
        self.layout = layout
        self.layout_key = layout_key  # which staging views fit its records: blocks of one layout share it
        self.dtypes = {}
        self.banks: dict[str, mx.array] = {}
        for t in layout.tensors:
            stored = DTYPES[t.dtype][1]
            self.dtypes[t.name] = dtype if mx.issubdtype(stored, mx.floating) else stored
            self.banks[t.name] = mx.zeros((num_slots, *t.shape), dtype=self.dtypes[t.name])
        self.slot_of = np.full(num_experts, -1, np.int64)  # expert -> slot, -1 = not resident
        self.expert_in = np.full(num_slots, -1, np.int64)  # slot -> expert, -1 = free
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident experts, oldest first
        self.seen = np.zeros(num_experts, bool)  # ever loaded: a miss on a seen expert is a capacity miss
        self.inflight: dict[int, Future] = {}  # prefetches, expert -> future


def picks_by_own_rule(moe) -> bool:
    """Whether MoE block `moe`'s router picks by a rule of its own (`gate.select`, Nemotron-H's
    sigmoid groups) rather than by the top-k of its gate's logits (`SparseMoeBlock`, GPT-OSS's
    linear router with a bias): read-ahead then predicts its picks, not probabilities."""
    return not isinstance(moe, SparseMoeBlock) and hasattr(moe.gate, "select")


def write_slots(bank: mx.array, rows: list[mx.array], slots: list[int]) -> mx.array:
    """`bank` (S, ...) with `rows[j]` (1, ...) in slot `slots[j]`, lazily (`write_rows`, which
    reuses the bank's buffer: a write costs one slot, not the bank): one write for slots in a run
    without gaps, else one a slot."""
    first = slots[0] if slots else 0
    if len(slots) > 1 and slots == list(range(first, first + len(slots))):
        return write_rows(bank, mx.concatenate(rows), first, axis=0)
    for slot, row in zip(slots, rows, strict=True):
        bank = write_rows(bank, row, slot, axis=0)
    return bank


class ExpertCache:
    """Resident expert slots for every streamed MoE block, with reads, prefetch and telemetry.

    Args:
        store: the opened streaming layout.
        blocks: (path, MoE block) of every streamed block, in layer order (their routers, `gate`
            and `top_k`, drive prefetch): `SparseMoeBlock`s and GPT-OSS's blocks, predicted from
            their gate's logits, or blocks whose router picks by its own rule
            (`picks_by_own_rule`: `gate.select(x)` -> (ids, weights)), predicted by its picks.
        num_slots: S, resident experts per block (1..E).
        dtype: compute dtype of the floating tensors (quantized weights keep theirs).
        options: prefetch mode, root-only prefetch and I/O threads.
    """

    def __init__(self, store: ExpertStore, blocks: list[tuple[str, object]], *, num_slots: int,
                 dtype: mx.Dtype, options: StreamOptions):
        E = store.num_experts
        if not 1 <= num_slots <= E:
            raise ValueError(f"num_slots must be in 1..{E}, got {num_slots}")
        self.store, self.options, self.num_slots, self.dtype = store, options, num_slots, dtype
        self.paths = [path for path, _ in blocks]
        self.layers = [layer_of(path) for path in self.paths]
        if self.layers != sorted(self.layers):  # prefetch reads for the next block in this order
            raise ValueError(f"blocks must come in layer order, got layers {self.layers}")
        self._position = {path: i for i, path in enumerate(self.paths)}
        layouts: dict[tuple, int] = {}  # a number for each record layout
        self._blocks = [_Block(store.blocks[path], num_slots, dtype, E,
                               layouts.setdefault(store.blocks[path].tensors, len(layouts))) for path in self.paths]
        self._routers = [(moe, moe.top_k) for _, moe in blocks]
        self._prefetch_rules: list[PrefetchRule | None] = [None] * len(self.paths)
        mx.eval([b.banks for b in self._blocks])
        advise = host_mapped() if is_cuda() else None
        self._staging = {b.layout.stride: StagingArea(b.layout.stride, advise=advise) for b in self._blocks}
        # transitions[i][e, f]: how often expert f at block i+1 followed expert e at block i
        self._transitions = [np.zeros((E, E), np.float32) for _ in self.paths[:-1]]
        self._window_ids: dict[int, np.ndarray] = {}
        self._pool = ReadQueue(options.io_threads, readahead_depth=options.readahead_depth, name="strata-experts")
        self._deferred: list[BaseException] = []
        self._request_no = 0  # which request a prefetch belongs to: its error is that request's only
        self._kind = DECODE
        self._counts = np.zeros((len(self.paths), len(COUNTERS)))
        self._rows = 0  # rows of the window being served
        self._last: ExpertWindowStats | None = None
        self.draft_read_cost = DraftReadCost()
        self.is_approximate = False  # set when cache-aware routing consults `resident_mask`
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, store)

    # -- windows -------------------------------------------------------------------------------

    def begin_window(self, *, kind: str = DECODE) -> None:
        """A window starts (its row 0 is the root); `kind` "prefill" (prompt chunks) turns prefetch off."""
        for i, block in enumerate(self._blocks):  # left over by a window that raised
            self._drop_prefetches(i, block)
        self._kind = kind
        self._counts[:] = 0
        self._rows = 0
        self._window_ids = {}

    def end_window(self) -> ExpertWindowStats:
        """The counters of the window since `begin_window`; a decode window also teaches
        `draft_read_cost`."""
        stats = self.window_stats()
        if self._kind == DECODE and self._rows:
            stats = replace(stats, draft_read_seconds=self.draft_read_cost.observe(stats, self._rows))
        self._last = stats
        return stats

    @property
    def last_window(self) -> ExpertWindowStats | None:
        return self._last

    def window_stats(self) -> ExpertWindowStats:
        c = self._counts
        total = c.sum(axis=0)
        layers = tuple(
            {"layer": layer, **{name: _num(c[i, j]) for j, name in enumerate(COUNTERS)}}
            for i, layer in enumerate(self.layers)
        )
        return ExpertWindowStats(
            union_experts=tuple(int(u) for u in c[:, _C["union"]]),
            cold_beyond_root=int(total[_C["cold_beyond_root"]]),
            misses=int(total[_C["cold_misses"]] + total[_C["capacity_misses"]]),
            bytes_read=int(total[_C["bytes_read"]]),
            prefetched_bytes=int(total[_C["prefetched_bytes"]]),
            late_waits=int(total[_C["late_prefetches"]]),
            late_wait_seconds=float(total[_C["wait_seconds"]]),
            hits=int(total[_C["hits"]]),
            cold_misses=int(total[_C["cold_misses"]]),
            capacity_misses=int(total[_C["capacity_misses"]]),
            prefetch_hits=int(total[_C["prefetch_hits"]]),
            wasted_prefetches=int(total[_C["wasted_prefetches"]]),
            cancelled_prefetches=int(total[_C["cancelled_prefetches"]]),
            passes=int(total[_C["passes"]]),
            router_sync_seconds=float(total[_C["router_sync_seconds"]]),
            install_seconds=float(total[_C["install_seconds"]]),
            substitutions=int(total[_C["substitutions"]]),
            misses_saved=int(total[_C["misses_saved"]]),
            bytes_saved=int(total[_C["bytes_saved"]]),
            approximate=self.is_approximate,
            layers=layers,
        )

    def staging(self) -> dict:
        """Staging slots made, over every record size, and how many of their chunks the GPU reads
        in place (CUDA advice taken; 0 elsewhere)."""
        areas = self._staging.values()
        return {"slots": sum(a.size for a in areas), "advised_chunks": sum(a.advised for a in areas)}

    def resident(self, path: str) -> list[int]:
        """Experts now resident in block `path`, least recently used first."""
        return list(self._blocks[self._position[path]].lru)

    def resident_mask(self, path: str) -> np.ndarray:
        """(E,) bool: which experts of block `path` are resident now."""
        return self._blocks[self._position[path]].slot_of >= 0

    def inflight_mask(self, path: str) -> np.ndarray:
        """(E,) bool: which experts of block `path` are being read ahead now (not yet resident)."""
        block = self._blocks[self._position[path]]
        mask = np.zeros(len(block.slot_of), bool)
        mask[list(block.inflight)] = True
        return mask

    @property
    def window_kind(self) -> str:
        """"decode" (row 0 is the root, the rest drafts) or "prefill" (prompt chunks)."""
        return self._kind

    def set_prefetch_rule(self, path: str, rule: PrefetchRule) -> None:
        """Router prefetch for block `path` reads `rule(probs (N, E), resident (E,))`: the experts
        the block's routing will pick given its predicted router probabilities and residency."""
        self._prefetch_rules[self._position[path]] = rule

    def record_routing(self, path: str, *, substitutions: int, misses_saved: int) -> None:
        """Count what cache-aware routing changed at block `path` in this window."""
        i = self._position[path]
        self._counts[i, _C["substitutions"]] += substitutions
        self._counts[i, _C["misses_saved"]] += misses_saved
        self._counts[i, _C["bytes_saved"]] += misses_saved * self._blocks[i].layout.stride

    def preload(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Read experts into free slots before any window, block by block in file order (expert
        0 first), each block's slots full or its experts all in: a cache that holds the whole
        model then never reads while decoding, and the disk sees long runs instead of one record
        per miss. At most `2 · io_threads` reads are in flight (so as many staging slots), and
        each block's installs run before the next block's reads begin. `progress(done, total)`
        after each block. Returns the records read.

        Raises:
            ExpertReadError: a record could not be read (naming the file and the expert).
        """
        self._raise_deferred()
        total, depth = 0, 2 * self.options.io_threads
        for i, block in enumerate(self._blocks):
            free = np.nonzero(block.expert_in < 0)[0].tolist()
            wanted = [e for e in range(len(block.slot_of)) if block.slot_of[e] < 0][: len(free)]
            for start in range(0, len(wanted), depth):
                group = wanted[start : start + depth]
                pending = [(e, self._submit(i, e)) for e in group]
                self._write(i, pending, free[start : start + len(group)])
            mx.eval(list(block.banks.values()))
            total += len(wanted)
            if progress:
                progress(i + 1, len(self._blocks))
        return total

    # -- serving a block -----------------------------------------------------------------------

    def serve(self, path: str, x: mx.array, inds: mx.array) -> Iterator[tuple[np.ndarray | None, np.ndarray, dict]]:
        """Make block `path`'s selected experts resident and say where they are.

        Evaluates the routing (the ids must be known to load them), issues the reads and the
        next block's prefetch, and yields once per pass:

        - `(None, slots (N, k), banks)` when the whole union fits in the slots (one pass);
        - `(picks, slots (P,), banks)` per pass otherwise: `picks` index the flattened (N·k)
          picks the pass serves. The caller must evaluate a pass before asking for the next.

        Raises:
            ExpertReadError: a record could not be read (naming the file and the expert).
        """
        self._raise_deferred()
        i = self._position[path]
        block = self._blocks[i]
        count = self._counts[i]
        predicted = self._router_prediction(i, x)
        start = time.perf_counter()
        mx.eval([a for a in (inds, predicted) if a is not None])
        ids = np.array(inds, dtype=np.int64)  # (N, k)
        count[_C["router_sync_seconds"]] += time.perf_counter() - start
        self._rows = max(self._rows, len(ids))
        union = np.unique(ids)
        self._cancel_prefetches(i, keep=union)
        missing = union[block.slot_of[union] < 0]
        count[_C["union"]] += len(union)
        count[_C["cold_beyond_root"]] += len(np.setdiff1d(missing, ids[0]))
        self._learn(i, ids)

        S = self.num_slots
        groups = [union[j : j + S] for j in range(0, len(union), S)]
        count[_C["passes"]] += len(groups)
        pending = self._request(i, groups[0])
        self._prefetch(i, ids, predicted)
        for g, group in enumerate(groups):
            if g:
                pending = self._request(i, group)
            self._install(i, group, pending)
            if g == len(groups) - 1:
                self._settle_prefetches(i)
            if len(groups) == 1:
                yield None, block.slot_of[ids].astype(np.uint32), block.banks
            else:
                flat = ids.reshape(-1)
                picks = np.nonzero(np.isin(flat, group))[0]
                yield picks, block.slot_of[flat[picks]].astype(np.uint32), block.banks

    def _request(self, i: int, group: np.ndarray) -> list[tuple[int, Future]]:
        """Touch the resident experts of `group`; return the reads it needs (expert, future)."""
        block, count = self._blocks[i], self._counts[i]
        pending = []
        for e in group.tolist():
            if block.slot_of[e] >= 0:
                block.lru.move_to_end(e)
                count[_C["hits"]] += 1
                continue
            future = block.inflight.pop(e, None)
            if future is not None:
                self._pool.promote(future)  # needed now: a demand read, if it has not started
                count[_C["prefetch_hits"]] += 1
                count[_C["late_prefetches"]] += not future.done()
            else:
                count[_C["capacity_misses" if block.seen[e] else "cold_misses"]] += 1
                count[_C["bytes_read"]] += block.layout.stride
                future = self._submit(i, e)
            pending.append((e, future))
        return pending

    def _install(self, i: int, group: np.ndarray, pending: list[tuple[int, Future]]) -> None:
        """Wait for `pending` reads and write them into the LRU unpinned slots."""
        if pending:
            self._write(i, pending, self._victims(self._blocks[i], len(pending), pinned=group))

    def _write(self, i: int, pending: list[tuple[int, Future]], victims: list[int]) -> None:
        """Wait for each read, then write the records into their slots (evicting the slots' experts).

        The slot writes are left lazy: they run with the layer's own compute when the next
        routing readback evaluates it (the next layer's input depends on them), so an install
        costs no device sync of its own. A pass's records go in together (`write_slots`: one
        write per bank tensor for slots in a run, else one a slot); a read that failed leaves
        the ones before it installed."""
        block, count = self._blocks[i], self._counts[i]
        area = self._staging[block.layout.stride]
        began, waited = time.perf_counter(), 0.0
        read: list[tuple[int, dict[str, mx.array], object]] = []  # (slot, the record's rows, staging slot)
        try:
            for n, ((e, future), slot) in enumerate(zip(pending, victims)):
                start = time.perf_counter()
                staged, _ = future.result()
                waited += time.perf_counter() - start
                try:
                    read.append((int(slot), self._record_rows(block, staged), staged))
                except BaseException:
                    area.release(staged)
                    raise
                old = int(block.expert_in[slot])
                if old >= 0:
                    block.slot_of[old] = -1
                    del block.lru[old]
                block.slot_of[e], block.expert_in[slot] = slot, e
                block.lru[e] = None
                block.seen[e] = True
        except BaseException:
            for _, future in pending[n + 1 :]:
                future.add_done_callback(self._recycle(block))
            raise
        finally:
            count[_C["wait_seconds"]] += waited
            slots = [slot for slot, _, _ in read]
            try:
                for name in block.banks:
                    block.banks[name] = write_slots(block.banks[name], [rows[name] for _, rows, _ in read], slots)
            finally:
                for _, _, staged in read:
                    area.release(staged, readers=lambda: list(block.banks.values()))
            count[_C["install_seconds"]] += time.perf_counter() - began - waited

    def _record_rows(self, block: _Block, staged) -> dict[str, mx.array]:
        """The record in staging slot `staged` as a (1, ...) row of each bank, in the bank's
        dtype. The views are made once per slot and layout and kept (the reader rewrites the
        bytes under them): an install builds only its writes, and a cast where the bank's
        dtype is not the record's."""
        views = staged.tensors.get(block.layout_key)
        if views is None:
            views = self.store.tensor_views(block.layout.path, staged.flat, {})
            views = staged.tensors[block.layout_key] = {name: v[None] for name, v in views.items()}
            mx.eval(list(views.values()))  # views of the slot's buffer: no copy
        return {name: v if v.dtype == block.dtypes[name] else v.astype(block.dtypes[name])
                for name, v in views.items()}

    @staticmethod
    def _victims(block: _Block, n: int, *, pinned: np.ndarray) -> list[int]:
        free = np.nonzero(block.expert_in < 0)[0][:n].tolist()
        if len(free) < n:
            keep = set(pinned.tolist())
            for e in block.lru:  # oldest first
                if e not in keep:
                    free.append(int(block.slot_of[e]))
                    if len(free) == n:
                        break
        assert len(free) == n, "a pass never holds more experts than there are slots"
        return free

    def _submit(self, i: int, expert: int, *, demand: bool = True) -> Future:
        path, area = self.paths[i], self._staging[self._blocks[i].layout.stride]
        slot = area.take()  # here, not on the reader thread: taking may evaluate earlier installs

        def read():
            try:
                return slot, self.store.read(path, expert, slot.view)
            except BaseException:
                area.release(slot)
                raise

        future = self._pool.submit(read, demand=demand)
        future.add_done_callback(lambda f: f.cancelled() and area.release(slot))
        return future

    # -- prefetch ------------------------------------------------------------------------------

    def _prefetch_active(self, i: int) -> bool:
        return self.options.prefetch != "off" and self._kind == DECODE and i + 1 < len(self.paths)

    def _router_prediction(self, i: int, x: mx.array) -> mx.array | None:
        """The next block's router applied to this block's input rows, lazy: its probabilities
        (N', E) when a prefetch rule or the confidence gate needs them, else its top-k ids (N', k)."""
        if not self._prefetch_active(i) or self.options.prefetch != "router":
            return None
        moe, k = self._routers[i + 1]
        gate = moe.gate
        rows = x.reshape(-1, x.shape[-1])
        rows = rows[:1] if self.options.root_prefetch else rows
        if picks_by_own_rule(moe):
            return gate.select(rows)[0]
        if self._prefetch_rules[i + 1] is not None or self.options.readahead_min_prob:
            return mx.softmax(gate(rows).astype(mx.float32), axis=-1)  # (N', E), as the block routes
        return mx.argpartition(-gate(rows), kth=k - 1, axis=-1)[:, :k]

    def _prefetch(self, i: int, ids: np.ndarray, predicted: mx.array | None) -> None:
        if not self._prefetch_active(i):
            return
        nxt = self._blocks[i + 1]
        guess = self._prefetch_guess(i, ids, predicted)
        experts, counts = np.unique(guess, return_counts=True)
        experts = experts[np.argsort(-counts, kind="stable")]
        wanted = [e for e in experts.tolist() if nxt.slot_of[e] < 0 and e not in nxt.inflight]
        room = self.num_slots - len(nxt.inflight)
        for e in wanted[: max(room, 0)]:
            nxt.inflight[e] = self._submit(i + 1, e, demand=False)
            self._counts[i + 1, _C["prefetched_bytes"]] += nxt.layout.stride

    def _prefetch_guess(self, i: int, ids: np.ndarray, predicted: mx.array | None) -> np.ndarray:
        """Block i+1's predicted picks (expert ids, a row's repeated in the next's)."""
        rule = self._prefetch_rules[i + 1]
        if predicted is not None and mx.issubdtype(predicted.dtype, mx.integer):
            return np.array(predicted, dtype=np.int64)  # top-k ids
        if predicted is not None:
            probs = np.array(predicted)  # (N', E)
            if rule is not None:
                guess = rule(probs, self._blocks[i + 1].slot_of >= 0)
            else:
                k = self._routers[i + 1][1]
                guess = np.argsort(-probs, axis=-1, kind="stable")[:, :k].reshape(-1)
            # a guess no row gives at least min_prob is more likely wasted than used
            confident = probs.max(axis=0) >= self.options.readahead_min_prob
            return guess[confident[guess]]
        # history: each row's k most frequent successors of its own picks
        rows = ids[:1] if self.options.root_prefetch else ids
        scores = self._transitions[i][rows].sum(axis=1)  # (N', E)
        k = self._routers[i + 1][1]
        guess = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        return guess[np.take_along_axis(scores, guess, axis=-1) > 0]

    def _learn(self, i: int, ids: np.ndarray) -> None:
        """Count which experts followed which across consecutive blocks (the history predictor)."""
        self._window_ids[i] = ids
        prev = self._window_ids.get(i - 1)
        if i and prev is not None and prev.shape[0] == ids.shape[0]:
            np.add.at(self._transitions[i - 1], (prev[:, :, None], ids[:, None, :]), 1.0)

    def _settle_prefetches(self, i: int) -> None:
        """Prefetches no row selected are wasted; the finished ones still fill free slots (never
        evicting for them), so a cache with room does not read them again."""
        block = self._blocks[i]
        free = np.nonzero(block.expert_in < 0)[0].tolist()
        keep = []
        for e, future in list(block.inflight.items()):
            if len(keep) < len(free) and future.done() and future.exception() is None:
                del block.inflight[e]
                self._counts[i, _C["wasted_prefetches"]] += 1
                keep.append((e, future))
        self._drop_prefetches(i, block)
        if keep:
            self._write(i, keep, free[: len(keep)])

    def _cancel_prefetches(self, i: int, *, keep: np.ndarray | None = None) -> None:
        """Read-aheads of block i still queued (not at the disk) and not in `keep`: cancelled,
        so the disk never reads them (counted apart from the wasted ones, which were read)."""
        block = self._blocks[i]
        for e in [e for e in block.inflight if keep is None or e not in keep]:
            if block.inflight[e].cancel():
                del block.inflight[e]
                self._counts[i, _C["cancelled_prefetches"]] += 1
                self._counts[i, _C["prefetched_bytes"]] -= block.layout.stride

    def _drop_prefetches(self, i: int, block: _Block) -> None:
        """Every prefetch still in flight for `block`: cancelled if still queued, else counted as
        wasted and its buffer recycled."""
        self._cancel_prefetches(i)
        for e in list(block.inflight):
            future = block.inflight.pop(e)
            self._counts[i, _C["wasted_prefetches"]] += 1
            future.add_done_callback(self._recycle(block))

    def _recycle(self, block: _Block):
        area = self._staging[block.layout.stride]
        request = self._request_no

        def done(future: Future) -> None:
            if future.cancelled():
                return
            error = future.exception()
            if error is not None:
                if request == self._request_no:
                    self._deferred.append(error)  # a broken file must not pass silently
            else:
                area.release(future.result()[0])  # read, never installed: nothing read the slot

        return done

    def begin_request(self) -> None:
        """A new request starts: errors that prefetches of earlier requests saved (or will save,
        when still in flight) are dropped; they belong to requests already answered."""
        self._request_no += 1
        self._deferred = []

    def _raise_deferred(self) -> None:
        if self._deferred:
            error, self._deferred = self._deferred[0], []
            raise error

    def close(self) -> None:
        """Stop the reader threads and close the files (also done when the cache is collected)."""
        self._finalizer()


def _shutdown(pool: ReadQueue, store: ExpertStore) -> None:
    pool.shutdown(wait=True)
    store.close()


def _num(value: float) -> float | int:
    return float(value) if not float(value).is_integer() else int(value)
