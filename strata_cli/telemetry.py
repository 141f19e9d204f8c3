"""Decode telemetry: the loop records windows, this module aggregates and renders them.

One `DecodeStats` feeds `generate --stats` (a rich table on stderr), `--json` (the `stats`
object) and `bench`. The first window pays one-time costs (graph building, caches warming), so
it is reported apart from the steady state.

Summary keys (stable names; bench and --json consumers read them):

- tokens: `prompt_tokens` (the prompt's tokens, less those healing backed up over),
  `healed_tokens` (the prompt's trailing tokens healing removed, healing.py: the first
  generated tokens reproduce their text and count as generated), `prefill_tokens` (those this request ran
  through prefill: the prompt minus its last token, which the first window runs, and minus any
  positions restored from a checkpoint), `generated_tokens`, `prefill_tokens_per_s`, `tokens_per_s` (all
  windows), `steady_tokens_per_s` (without the first window), `decode_seconds`,
  `warmup_window_ms`;
- windows: `windows`, `tokens_per_window`, `window_T_histogram`, `window_ms_mean`,
  `window_ms_p95`, `window_ms_p99` (steady windows);
- drafts: `proposal_coverage` (windows whose drafter offered drafts), `mean_match_length`,
  `match_length_histogram`, `drafts_proposed` (offered by the drafter after the window caps),
  `drafts_offered` (verified), `drafts_declined` (proposed but cut by the `auto` controller),
  `drafts_kept`, `acceptance`;
- `controller`: what the `auto` controller learned (absent without one);
- `experts`: expert-streaming figures (see `ExpertWindowStats`), `None` when the engine does
  not stream experts (nothing was measured, which is not the same as zero reads).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpertWindowStats:
    """What one window did to the expert cache (filled by a streaming engine).

    An engine that streams experts exposes `last_window_experts() -> ExpertWindowStats`; the
    decode loop attaches its answer to each `WindowRecord`. Names are stable: the summary's
    `experts` section sums or averages them.

    Attributes:
        union_experts: per MoE layer, how many distinct experts the window's rows selected.
        cold_beyond_root: experts the window had to make resident that the root row alone
            would not have needed (the cost of the drafts in reads).
        misses: expert loads that were not resident or in flight when the layer needed them.
        bytes_read: bytes read from storage on demand for this window.
        prefetched_bytes: bytes read ahead of need (prefetch) during this window.
        late_waits: times the layer waited for a read that had been issued (prefetch late).
        late_wait_seconds: total time the compute waited on reads (demand reads and late
            prefetches alike).
        hits: selected experts already resident.
        cold_misses / capacity_misses: `misses` split by whether the expert had never been
            loaded (cold) or had been loaded and evicted (capacity).
        prefetch_hits: selected experts a prefetch had read or was reading (not misses).
        wasted_prefetches: prefetched experts no row selected.
        passes: MoE block passes (a union larger than the slots takes several).
        draft_read_seconds: the part of `late_wait_seconds` spent on `cold_beyond_root` reads,
            at this window's measured seconds per read (what the drafts cost in reads).
        substitutions: picks cache-aware routing made outside a row's natural top-k.
        misses_saved / bytes_saved: non-resident experts (bytes) exact routing would have
            needed beyond what cache-aware routing needed, on the same residency.
        approximate: cache-aware routing was on (output may differ from exact decoding).
        layers: per MoE layer, a dict of the same counters (`layer`, `hits`, `cold_misses`, ...).
    """

    union_experts: tuple[int, ...] = ()
    cold_beyond_root: int = 0
    misses: int = 0
    bytes_read: int = 0
    prefetched_bytes: int = 0
    late_waits: int = 0
    late_wait_seconds: float = 0.0
    hits: int = 0
    cold_misses: int = 0
    capacity_misses: int = 0
    prefetch_hits: int = 0
    wasted_prefetches: int = 0
    passes: int = 0
    draft_read_seconds: float = 0.0
    substitutions: int = 0
    misses_saved: int = 0
    bytes_saved: int = 0
    approximate: bool = False
    layers: tuple[dict, ...] = ()


@dataclass(frozen=True)
class WindowRecord:
    T: int  # rows run: root + drafts
    keep: int  # inputs committed
    emitted: int  # tokens emitted (keep, or fewer at an end-of-sequence)
    seconds: float  # wall time of the step: drafting, the run, acceptance and commit
    match_length: int = 0  # suffix match behind the drafts (0 = no proposal)
    from_global: bool = False  # the drafts came from the cross-request suffix cache
    proposed: int = 0  # drafts the proposal offered after the window caps (>= T - 1)
    experts: ExpertWindowStats | None = None  # None: the engine does not stream experts

    @property
    def drafts_offered(self) -> int:
        return self.T - 1

    @property
    def drafts_kept(self) -> int:
        return self.keep - 1


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass
class DecodeStats:
    prompt_tokens: int = 0  # the prompts' tokens
    healed_tokens: int = 0  # trailing prompt tokens healing backed up over (regenerated)
    prefill_tokens: int = 0  # of those, the ones prefill ran (not the root, not restored positions)
    prefill_seconds: float = 0.0
    windows: list[WindowRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_bytes_read: int = 0  # weight bytes read from storage before decoding (streaming engines)
    controller: object | None = None  # the `auto` draft-length controller, if any (has snapshot())
    warmup_seconds: float = 0.0  # load time: every window shape run once (runtime.open_model)
    calibration_seconds: float = 0.0  # load time: the device's cost curve measured (calibrate.py)

    def attach_controller(self, controller) -> None:
        """Report what this draft-length controller learned in the summary's `controller`."""
        self.controller = controller

    def record_prompt(self, tokens: int) -> None:
        """Count a request's prompt tokens (all of them, however many prefill ran)."""
        self.prompt_tokens += tokens

    def record_heal(self, tokens: int) -> None:
        """Count the prompt's trailing tokens healing backed up over (healing.py)."""
        self.healed_tokens += tokens

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds

    def record_window(self, record: WindowRecord) -> None:
        self.windows.append(record)

    def note(self, message: str) -> None:
        """Something the user should hear about once (the CLI prints notes to stderr)."""
        if message not in self.notes:
            self.notes.append(message)

    @property
    def generated(self) -> int:
        return sum(w.emitted for w in self.windows)

    def summary(self) -> dict:
        """Every figure as plain data (JSON-ready)."""
        ws = self.windows
        seconds = sum(w.seconds for w in ws)
        steady = ws[1:]
        steady_seconds = sum(w.seconds for w in steady)
        offered = sum(w.drafts_offered for w in ws)
        kept = sum(w.drafts_kept for w in ws)
        proposed = [w for w in ws if w.proposed]
        latencies_ms = [1000 * w.seconds for w in steady] or [1000 * w.seconds for w in ws]
        return {
            "prompt_tokens": self.prompt_tokens,
            "healed_tokens": self.healed_tokens,
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated,
            "prefill_tokens_per_s": _rate(self.prefill_tokens, self.prefill_seconds),
            "tokens_per_s": _rate(self.generated, seconds),
            "steady_tokens_per_s": _rate(sum(w.emitted for w in steady), steady_seconds),
            "decode_seconds": seconds,
            "warmup_seconds": self.warmup_seconds,
            "calibration_seconds": self.calibration_seconds,
            "warmup_window_ms": 1000 * ws[0].seconds if ws else 0.0,
            "windows": len(ws),
            "tokens_per_window": self.generated / len(ws) if ws else 0.0,
            "drafts_proposed": sum(w.proposed for w in ws),
            "drafts_offered": offered,
            "drafts_declined": sum(w.proposed - w.drafts_offered for w in ws),
            "drafts_kept": kept,
            "drafts_offered_global": sum(w.drafts_offered for w in ws if w.from_global),
            "drafts_kept_global": sum(w.drafts_kept for w in ws if w.from_global),
            "acceptance": kept / offered if offered else 0.0,
            "proposal_coverage": len(proposed) / len(ws) if ws else 0.0,
            "mean_match_length": (
                sum(w.match_length for w in proposed) / len(proposed) if proposed else 0.0
            ),
            "match_length_histogram": _match_histogram(w.match_length for w in proposed),
            "window_T_histogram": {str(t): n for t, n in sorted(Counter(w.T for w in ws).items())},
            "window_ms_mean": sum(latencies_ms) / len(latencies_ms) if latencies_ms else 0.0,
            "window_ms_p95": percentile(latencies_ms, 95),
            "window_ms_p99": percentile(latencies_ms, 99),
            **({"controller": self.controller.snapshot()} if self.controller is not None else {}),
            **({"approximate": True} if self.is_approximate else {}),
            "experts": self._expert_summary(),
        }

    @property
    def is_approximate(self) -> bool:
        """Some window used cache-aware (approximate) routing: the label `--json`, serve-stdio and
        bench carry; absent in exact mode."""
        return any(w.experts is not None and w.experts.approximate for w in self.windows)

    def _expert_summary(self) -> dict | None:
        """Sums and means of the windows' `ExpertWindowStats`; None when no window had any."""
        es = [w.experts for w in self.windows if w.experts is not None]
        if not es:
            return None
        unions = [sum(e.union_experts) / len(e.union_experts) for e in es if e.union_experts]
        bytes_read = sum(e.bytes_read for e in es)
        prefetched = sum(e.prefetched_bytes for e in es)
        return {
            "union_experts_per_layer": sum(unions) / len(unions) if unions else 0.0,
            "cold_experts_beyond_root": sum(e.cold_beyond_root for e in es),
            "misses": sum(e.misses for e in es),
            "bytes_read": bytes_read,
            "prefetched_bytes": prefetched,
            "late_waits": sum(e.late_waits for e in es),
            "late_wait_ms": 1000 * sum(e.late_wait_seconds for e in es),
            "draft_read_ms": 1000 * sum(e.draft_read_seconds for e in es),
            "model_bytes_read": self.load_bytes_read + bytes_read + prefetched,
            **({"moce": {
                "substitutions": sum(e.substitutions for e in es),
                "misses_saved": sum(e.misses_saved for e in es),
                "bytes_saved": sum(e.bytes_saved for e in es),
            }} if any(e.approximate for e in es) else {}),
            **_expert_details(es, seconds=sum(w.seconds for w in self.windows), tokens=self.generated),
        }

    def render(self, console, *, title: str = "strata decode") -> None:
        """Print the summary as a rich table on `console` (stderr in the CLI)."""
        from rich.table import Table

        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        summary = self.summary()
        per_layer = (summary.get("experts") or {}).pop("per_layer", None)
        for name, value in summary.items():
            if isinstance(value, float):
                value = f"{value:,.3f}"
            elif isinstance(value, dict):
                value = " ".join(f"{k}:{_short(v)}" for k, v in value.items()) or "-"
            elif value is None:
                value = "-"
            table.add_row(name, str(value))
        console.print(table)
        if summary.get("approximate"):
            console.print("approximate: cache-aware routing (MoCE) was on; output may differ from exact routing")
        if per_layer:
            console.print(_layer_table(per_layer, title=f"{title}: experts per MoE layer"))


# ExpertWindowStats.layers counters the per-layer report sums over windows (union is averaged).
EXPERT_LAYER_COUNTERS = (
    "hits", "cold_misses", "capacity_misses", "prefetch_hits", "late_prefetches", "wasted_prefetches",
    "bytes_read", "prefetched_bytes", "wait_seconds", "cold_beyond_root", "passes",
    "substitutions", "misses_saved", "bytes_saved",
)


def _expert_details(es: list[ExpertWindowStats], *, seconds: float, tokens: int) -> dict:
    """Hit/miss split, prefetch coverage, late-wait share, bytes per token and the per-layer sums."""
    prefetch_hits, misses = sum(e.prefetch_hits for e in es), sum(e.misses for e in es)
    wait = sum(e.late_wait_seconds for e in es)
    read = sum(e.bytes_read + e.prefetched_bytes for e in es)
    per_layer: dict[int, dict] = {}
    for e in es:
        for row in e.layers:
            acc = per_layer.setdefault(row["layer"], {"layer": row["layer"], "windows": 0, "union_mean": 0.0})
            acc["windows"] += 1
            acc["union_mean"] += row.get("union", 0)
            for name in EXPERT_LAYER_COUNTERS:
                acc[name] = acc.get(name, 0) + row.get(name, 0)
    for acc in per_layer.values():
        acc["union_mean"] /= acc["windows"]
    return {
        "hits": sum(e.hits for e in es),
        "cold_misses": sum(e.cold_misses for e in es),
        "capacity_misses": sum(e.capacity_misses for e in es),
        "prefetch_hits": prefetch_hits,
        "prefetch_coverage": prefetch_hits / (prefetch_hits + misses) if prefetch_hits + misses else 0.0,
        "wasted_prefetches": sum(e.wasted_prefetches for e in es),
        "passes": sum(e.passes for e in es),
        "late_wait_share": wait / seconds if seconds > 0 else 0.0,
        "bytes_read_per_token": read / tokens if tokens else 0.0,
        "per_layer": [per_layer[k] for k in sorted(per_layer)],
    }


def _layer_table(rows: list[dict], *, title: str):
    from rich import box
    from rich.table import Table

    # hit / cold / cap: resident, never-loaded and evicted experts; pf hit / wasted: prefetches used
    # and unused; MB rd / MB pf: read on demand / ahead; c>root: cold experts beyond the root row's.
    columns = (  # header, value
        ("layer", lambda r: r["layer"]),
        ("union", lambda r: f"{r['union_mean']:.1f}"),
        ("hit", lambda r: r["hits"]),
        ("cold", lambda r: r["cold_misses"]),
        ("cap", lambda r: r["capacity_misses"]),
        ("pf hit", lambda r: r["prefetch_hits"]),
        ("wasted", lambda r: r["wasted_prefetches"]),
        ("MB rd", lambda r: f"{r['bytes_read'] / 1e6:.1f}"),
        ("MB pf", lambda r: f"{r['prefetched_bytes'] / 1e6:.1f}"),
        ("wait ms", lambda r: f"{1000 * r['wait_seconds']:.1f}"),
        ("c>root", lambda r: r["cold_beyond_root"]),
    )
    if any(r.get("substitutions") or r.get("misses_saved") for r in rows):  # cache-aware routing
        columns += (("subst", lambda r: r["substitutions"]), ("saved", lambda r: r["misses_saved"]))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for header, _ in columns:
        table.add_column(header, justify="right", min_width=len(header), no_wrap=True)
    for row in rows:
        table.add_row(*(str(value(row)) for _, value in columns))
    return table


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}:{_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return str(value)


def _match_histogram(lengths) -> dict[str, int]:
    """Match lengths counted by the controller's buckets ("4-5", "6-7", ..., "32+")."""
    from .speculative.controller import MATCH_BUCKET_EDGES, match_bucket

    labels, low = [], 0
    for edge in MATCH_BUCKET_EDGES:
        labels.append(f"{low}-{edge}" if low else f"<={edge}")
        low = edge + 1
    labels.append(f"{low}+")
    counts = Counter(match_bucket(m) for m in lengths)
    return {labels[b]: counts[b] for b in sorted(counts)}


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0
