"""Decode telemetry: the loop records windows, this module aggregates and renders them.

One `DecodeStats` feeds `generate --stats` (a rich table on stderr), `--json` (the `stats`
object) and `bench`. The first window pays one-time costs (graph building, caches warming), so
it is reported apart from the steady state.

Summary keys are stable names (bench and --json consumers read them); `FIELDS` and
`EXPERT_FIELDS` below give each one's label, unit and meaning, and docs/stats.md is generated
from them.
"""

from __future__ import annotations

import time

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
        cancelled_prefetches: read-aheads dropped from the queue when their block routed, never
            read (which unpicked read-aheads a reader had started by then is timing, so wasted
            and cancelled split differently between runs that route alike).
        passes: MoE block passes (a union larger than the slots takes several).
        draft_read_seconds: the part of `late_wait_seconds` spent on `cold_beyond_root` reads,
            at this window's measured seconds per read (what the drafts cost in reads).
        router_sync_seconds: time spent evaluating each MoE layer's routing to learn which
            experts to read (the readback, and the pending compute it waits on).
        install_seconds: time spent writing read records into the resident slot banks (the
            wait for the reads apart).
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
    cancelled_prefetches: int = 0
    passes: int = 0
    draft_read_seconds: float = 0.0
    router_sync_seconds: float = 0.0
    install_seconds: float = 0.0
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
    shape_warmup_seconds: float = 0.0  # between windows: new shapes warmed on first use, outside every window
    calibration_seconds: float = 0.0  # load time: the device's cost curve measured (calibrate.py)
    seed: int | None = None  # the sampling seed used (None: greedy)
    first_token_unix_s: float | None = None  # wall clock when the first window ended (time to first token from outside)
    pipeline: dict | None = None  # across ranks (distributed.py): {rank, ranks, layers}; None in one process

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

    def record_shape_warmup(self, seconds: float) -> None:
        """Time spent warming a window shape before its first window (not in any window's time)."""
        self.shape_warmup_seconds += seconds

    def record_window(self, record: WindowRecord) -> None:
        if not self.windows:
            self.first_token_unix_s = time.time()
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
            "seed": self.seed,
            "prefill_tokens_per_s": _rate(self.prefill_tokens, self.prefill_seconds),
            "tokens_per_s": _rate(self.generated, seconds),
            "steady_tokens_per_s": _rate(sum(w.emitted for w in steady), steady_seconds),
            "decode_seconds": seconds,
            "warmup_seconds": self.warmup_seconds,
            "shape_warmup_seconds": self.shape_warmup_seconds,
            "calibration_seconds": self.calibration_seconds,
            "warmup_window_ms": 1000 * ws[0].seconds if ws else 0.0,
            "first_token_unix_s": self.first_token_unix_s,
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
            "window_ms_median": percentile(latencies_ms, 50),
            "window_ms_p95": percentile(latencies_ms, 95),
            "window_ms_p99": percentile(latencies_ms, 99),
            "window_ms_max": max(latencies_ms, default=0.0),
            **({"controller": self.controller.snapshot()} if self.controller is not None else {}),
            **({"approximate": True} if self.is_approximate else {}),
            **({"pipeline": self.pipeline} if self.pipeline is not None else {}),
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
            "router_sync_ms": 1000 * sum(e.router_sync_seconds for e in es),
            "install_ms": 1000 * sum(e.install_seconds for e in es),
            "model_bytes_read": self.load_bytes_read + bytes_read + prefetched,
            **({"moce": {
                "substitutions": sum(e.substitutions for e in es),
                "misses_saved": sum(e.misses_saved for e in es),
                "bytes_saved": sum(e.bytes_saved for e in es),
            }} if any(e.approximate for e in es) else {}),
            **_expert_details(es, seconds=sum(w.seconds for w in self.windows), tokens=self.generated),
        }

    def render(self, console, *, title: str = "strata decode") -> None:
        """Print the summary as a rich table on `console` (stderr in the CLI): a readable label
        and a unit for each figure (FIELDS), n/a where a ratio has nothing to divide."""
        from rich.table import Table

        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column("figure", style="bold")
        table.add_column("value", justify="right")
        table.add_column("key", style="dim")
        summary = self.summary()
        experts = summary.pop("experts", None) or {}
        per_layer = experts.pop("per_layer", None)
        summary.pop("first_token_unix_s", None)  # a timestamp, for tools (--json), not a figure to read
        for key, label, value in readable_rows(summary, FIELDS):
            table.add_row(label, value, key)
        for key, label, value in readable_rows({k: v for k, v in experts.items() if k != "moce"}, EXPERT_FIELDS):
            table.add_row(label, value, f"experts.{key}")
        for key, value in experts.get("moce", {}).items():
            table.add_row(f"MoCE {key.replace('_', ' ')}", f"{value:,}", f"experts.moce.{key}")
        console.print(table)
        if summary.get("approximate"):
            console.print("approximate: cache-aware routing (MoCE) was on; output may differ from exact routing")
        if per_layer:
            console.print(_layer_table(per_layer, title=f"{title}: experts per MoE layer"))


# The summary's figures as `--stats` shows them: key -> (label, unit, meaning). The unit is how the
# value prints: "tokens", "tok/s", "s", "ms", "%" (a share printed as a percentage), "" (a count or
# a plain number); "n/a if KEY" marks a ratio with no data when summary[KEY] is 0. docs/stats.md
# is generated from these tables (tests/test_cli_docs.py), so the glossary cannot drift.
FIELDS = {
    "prompt_tokens": ("prompt", "tokens", "the prompt's tokens, less those healing backed up over"),
    "healed_tokens": ("healed", "tokens", "the prompt's trailing tokens healing backed up over; the first "
                      "generated tokens rewrite their text and count as generated"),
    "prefill_tokens": ("prefilled", "tokens", "tokens this request ran through prefill: the prompt less its last "
                       "token (the first window runs it) and less positions restored from a checkpoint"),
    "generated_tokens": ("generated", "tokens", "tokens emitted (an end-of-sequence token is not emitted)"),
    "seed": ("sampling seed", "", "the seed this request sampled with (--seed, or drawn from the system when none "
             "was given: pass it as --seed to get the same text again); null when greedy"),
    "prefill_tokens_per_s": ("prefill speed", "tok/s", "prefilled tokens per second of prefill; n/a if prefill_tokens"),
    "tokens_per_s": ("decode speed", "tok/s", "generated tokens per second of decoding (all windows)"),
    "steady_tokens_per_s": ("decode speed, first window apart", "tok/s",
                            "as tokens_per_s without the first window, which pays one-time costs; n/a if windows"),
    "decode_seconds": ("decode time", "s", "wall time of all windows (drafting, runs, acceptance, commits)"),
    "warmup_seconds": ("shape warm-up at load", "s", "load time spent running every window shape once "
                       "(--warm-shapes; 0 by default, where shapes are warmed on first use)"),
    "shape_warmup_seconds": ("shape warm-up while decoding", "s", "time spent warming a window shape before the "
                             "first window of that shape (GPU backends warm shapes on first use by default); "
                             "in no window's time"),
    "calibration_seconds": ("cost-curve calibration at load", "s", "load time spent measuring this device's "
                            "window cost by T for --suffix-draft auto (0 when cached or not auto)"),
    "warmup_window_ms": ("first window", "ms", "wall time of the first window (kernel and graph building, caches "
                         "warming); not in the window latencies below"),
    "first_token_unix_s": ("first window's end", "unix s", "wall-clock time (seconds since the epoch) the first "
                           "window ended: time to first token, measured from outside the process"),
    "windows": ("windows", "", "windows run (one forward pass each: the root and its drafts)"),
    "tokens_per_window": ("tokens per window", "", "generated tokens / windows; below 1 when the last window "
                          "ended at an end-of-sequence token, which is not emitted; n/a if windows"),
    "drafts_proposed": ("drafts proposed", "", "drafts the drafters offered, after the budget and context caps"),
    "drafts_offered": ("drafts verified", "", "drafts the model checked (proposed less declined)"),
    "drafts_declined": ("drafts declined by auto", "", "proposed drafts the auto controller did not think worth "
                        "their cost"),
    "drafts_kept": ("drafts kept", "", "verified drafts the model agreed with (each one a token for free)"),
    "drafts_offered_global": ("verified from earlier requests", "", "verified drafts that came from the "
                              "cross-request suffix cache (serve-stdio --suffix-cache)"),
    "drafts_kept_global": ("kept from earlier requests", "", "of those, the ones kept"),
    "acceptance": ("acceptance", "%", "drafts kept / drafts verified; n/a if drafts_offered"),
    "proposal_coverage": ("windows with a proposal", "%", "windows whose drafters proposed at least one draft "
                          "(verified or declined); n/a if windows"),
    "mean_match_length": ("mean match length", "tokens", "the suffix match behind a proposal, averaged over "
                          "windows with one; n/a if drafts_proposed"),
    "match_length_histogram": ("match lengths", "", "windows with a proposal, by match-length bucket"),
    "window_T_histogram": ("windows by rows", "", "windows by T, their rows (1 = no drafts)"),
    "window_ms_mean": ("window latency, mean", "ms", "mean wall time of a window after the first; n/a if windows"),
    "window_ms_median": ("window latency, median", "ms", "median wall time of a window after the first; n/a if "
                         "windows"),
    "window_ms_p95": ("window latency, p95", "ms", "95th percentile of the same; n/a if windows"),
    "window_ms_p99": ("window latency, p99", "ms", "99th percentile of the same; n/a if windows"),
    "window_ms_max": ("window latency, max", "ms", "the slowest window after the first; n/a if windows"),
    "controller": ("auto controller", "", "--suffix-draft auto only: its cost prior (calibrated, cached, file:PATH "
                   "or builtin), learned acceptance by draft position, window ms by T and cost samples by T"),
    "approximate": ("approximate", "", "present (true) when cache-aware routing changed the output"),
    "pipeline": ("pipeline", "", "across ranks (mlx.launch) only: this rank, the number of ranks and every "
                 "rank's decoder layers [start, stop)"),
}
EXPERT_FIELDS = {  # the `experts` section, streamed checkpoints only
    "union_experts_per_layer": ("experts per layer per window", "", "distinct experts a window's rows picked, "
                                "mean over MoE layers and windows"),
    "cold_experts_beyond_root": ("cold experts drafts cost", "", "experts made resident that the root row alone "
                                 "would not have needed"),
    "misses": ("expert misses", "", "picked experts neither resident nor being read"),
    "bytes_read": ("bytes read on demand", "bytes", "expert bytes read when a layer needed them"),
    "prefetched_bytes": ("bytes read ahead", "bytes", "expert bytes read by prefetch"),
    "late_waits": ("late waits", "", "times a layer waited for a read already issued"),
    "late_wait_ms": ("time waiting on reads", "ms", "compute time spent waiting for expert reads"),
    "draft_read_ms": ("of which for drafts", "ms", "the part of that spent on the drafts' cold experts"),
    "router_sync_ms": ("time reading back routing", "ms", "time each MoE layer waited to learn its experts "
                       "(the routing readback and the compute before it)"),
    "install_ms": ("time installing experts", "ms", "time writing read experts into the resident slots"),
    "model_bytes_read": ("model bytes read", "bytes", "weight bytes read from storage: at load, on demand and ahead"),
    "hits": ("expert hits", "", "picked experts already resident"),
    "cold_misses": ("cold misses", "", "misses of experts never loaded before"),
    "capacity_misses": ("capacity misses", "", "misses of experts loaded before and evicted"),
    "prefetch_hits": ("prefetch hits", "", "picked experts a prefetch had read or was reading"),
    "prefetch_coverage": ("prefetch coverage", "%", "prefetch hits / (prefetch hits + misses); n/a if misses"),
    "wasted_prefetches": ("wasted prefetches", "", "prefetched experts no row picked"),
    "cancelled_prefetches": ("cancelled prefetches", "", "read-aheads dropped before they reached the disk"),
    "passes": ("MoE passes", "", "MoE block passes (a window whose experts outgrow the slots takes several)"),
    "late_wait_share": ("share of time waiting", "%", "time waiting on reads / decode time"),
    "bytes_read_per_token": ("bytes read per token", "bytes", "expert bytes read (demand and ahead) per "
                             "generated token"),
}


def readable_rows(summary: dict, fields: dict) -> list[tuple[str, str, str]]:
    """(key, label, value with unit) for each figure of `summary`, in its order."""
    rows = []
    for key, value in summary.items():
        label, unit, meaning = fields.get(key, (key.replace("_", " "), "", ""))
        if "n/a if " in meaning:
            guard = meaning.split("n/a if ", 1)[1].split()[0].rstrip(";,.")
            if not summary.get(guard):
                rows.append((key, label, "n/a"))
                continue
        rows.append((key, label, _with_unit(key, value, unit)))
    return rows


def _with_unit(key: str, value, unit: str) -> str:
    if value is None:
        return "-"
    if key == "controller":
        return _controller_text(value)
    if key == "seed":
        return str(value)
    if isinstance(value, dict):
        return " ".join(f"{k}:{_short(v)}" for k, v in value.items()) or "-"
    if unit == "%":
        return f"{100 * value:.1f} %"
    if unit == "bytes":
        return format_bytes(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        digits = 1 if unit in ("tok/s", "ms") else 3
        text = f"{value:,.{digits}f}"
    else:
        text = f"{value:,}"
    return f"{text} {unit}".rstrip()


def _controller_text(snapshot: dict) -> str:
    """The controller's snapshot in a few short lines (a table cell wraps them, never 500 columns)."""
    lines = [f"cost prior {snapshot.get('cost_prior')}"]
    if snapshot.get("acceptance_by_position"):
        lines.append("acceptance by draft position " + " ".join(f"{a:.2f}" for a in snapshot["acceptance_by_position"]))
    if snapshot.get("window_ms_by_T"):
        lines.append("window ms by T " + " ".join(f"{T}:{ms:.3g}" for T, ms in snapshot["window_ms_by_T"].items()))
    if snapshot.get("cost_samples_by_T"):
        lines.append("cost samples by T " + " ".join(f"{T}:{n}" for T, n in snapshot["cost_samples_by_T"].items()))
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """A byte count for people: B, kB, MB or GB (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


# ExpertWindowStats.layers counters the per-layer report sums over windows (union is averaged).
EXPERT_LAYER_COUNTERS = (
    "hits", "cold_misses", "capacity_misses", "prefetch_hits", "late_prefetches", "wasted_prefetches",
    "cancelled_prefetches", "bytes_read", "prefetched_bytes", "wait_seconds", "cold_beyond_root", "passes",
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
        "cancelled_prefetches": sum(e.cancelled_prefetches for e in es),
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
