"""Decode telemetry: the loop records windows, this module aggregates and renders them.

One `DecodeStats` feeds `generate --stats` (a rich table on stderr), `--json` (the `stats`
object) and, later, `bench`. The first window pays one-time costs (graph building, caches
warming), so it is reported apart from the steady state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WindowRecord:
    T: int  # rows run: root + drafts
    keep: int  # inputs committed
    emitted: int  # tokens emitted (keep, or fewer at an end-of-sequence)
    seconds: float  # wall time of the step: drafting, the run, acceptance and commit
    match_length: int = 0  # suffix match behind the drafts (0 = no proposal)

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
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    windows: list[WindowRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens += tokens
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
        proposed = [w for w in ws if w.match_length]
        latencies_ms = [1000 * w.seconds for w in steady] or [1000 * w.seconds for w in ws]
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated,
            "prefill_tokens_per_s": _rate(self.prompt_tokens, self.prefill_seconds),
            "tokens_per_s": _rate(self.generated, seconds),
            "steady_tokens_per_s": _rate(sum(w.emitted for w in steady), steady_seconds),
            "decode_seconds": seconds,
            "warmup_window_ms": 1000 * ws[0].seconds if ws else 0.0,
            "windows": len(ws),
            "tokens_per_window": self.generated / len(ws) if ws else 0.0,
            "drafts_offered": offered,
            "drafts_kept": kept,
            "acceptance": kept / offered if offered else 0.0,
            "proposal_coverage": len(proposed) / len(ws) if ws else 0.0,
            "mean_match_length": (
                sum(w.match_length for w in proposed) / len(proposed) if proposed else 0.0
            ),
            "window_T_histogram": {str(t): n for t, n in sorted(Counter(w.T for w in ws).items())},
            "window_ms_mean": sum(latencies_ms) / len(latencies_ms) if latencies_ms else 0.0,
            "window_ms_p95": percentile(latencies_ms, 95),
            "window_ms_p99": percentile(latencies_ms, 99),
        }

    def render(self, console, *, title: str = "strata decode") -> None:
        """Print the summary as a rich table on `console` (stderr in the CLI)."""
        from rich.table import Table

        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        for name, value in self.summary().items():
            if isinstance(value, float):
                value = f"{value:,.3f}"
            elif isinstance(value, dict):
                value = " ".join(f"{k}:{v}" for k, v in value.items()) or "-"
            table.add_row(name, str(value))
        console.print(table)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0
