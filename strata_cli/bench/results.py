"""Bench results as plain data: runs, their medians and spread, identity checks and the targets.

Column meanings (docs/benchmarks.md repeats them): `tokens/s` is generated tokens over decode
wall time (prefill excluded, every window and the loop's own work included), the median of the
measured repeats; `spread` is min..max of those repeats; `warm-up` is the tokens/s of the
warm-up run(s), reported apart and never in the median.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field

PROSE_TARGET = 0.97  # on prose, auto keeps at least 97% of serial tokens/s
COPY_TARGET = 0.90  # on copy-heavy workloads, auto reaches at least 90% of the best fixed N


@dataclass
class RunResult:
    """One run of one mode over every prompt of a workload.

    Attributes:
        token_ids: generated ids, one list per prompt.
        tokens: generated tokens in all.
        seconds: decode wall time in all (prefill excluded).
        summary: telemetry (`DecodeStats.summary()` for strata modes), JSON-ready.
    """

    token_ids: list[list[int]]
    tokens: int
    seconds: float
    summary: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def digest(self) -> str:
        """A short hash of every generated id, to compare outputs across modes."""
        text = "|".join(",".join(map(str, ids)) for ids in self.token_ids)
        return hashlib.sha1(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class PeerRefusal:
    """A peer mode the peer itself declined (its own message, verbatim)."""

    message: str


@dataclass
class ModeResult:
    """Every run of one mode on one workload.

    Attributes:
        mode: the mode's label ("serial", "3", "auto:7", "mlx-lm", "mlx-lm-spec").
        kind: "strata" or "peer".
        warmup: warm-up runs (reported apart).
        runs: measured runs.
        refusal: set when a peer declined the mode (then there are no runs).
        identical: every run's output equals strata serial's (None before the check, or for
            a refused peer). A strata mode that differs is a bug; a peer may differ after a
            while (other kernels, other float rounding) and is only reported.
        first_difference: (prompt index, token index) of the first difference from serial's
            output, or None when identical.
    """

    mode: str
    kind: str
    warmup: list[RunResult] = field(default_factory=list)
    runs: list[RunResult] = field(default_factory=list)
    refusal: PeerRefusal | None = None
    identical: bool | None = None
    first_difference: tuple[int, int] | None = None

    @property
    def rates(self) -> list[float]:
        return [r.tokens_per_s for r in self.runs]

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.runs else None

    def spread(self) -> tuple[float, float] | None:
        """(min, max) tokens/s of the measured runs."""
        return (min(self.rates), max(self.rates)) if self.runs else None

    def iqr(self) -> tuple[float, float] | None:
        """(25th, 75th) percentile of tokens/s; with fewer than 4 runs, (min, max)."""
        rates = sorted(self.rates)
        if len(rates) < 4:
            return self.spread()
        q = statistics.quantiles(rates, n=4)
        return q[0], q[2]

    def drafts(self) -> tuple[int, int]:
        """(kept, offered) drafts over the measured runs."""
        kept = sum(r.summary.get("drafts_kept", 0) for r in self.runs)
        offered = sum(r.summary.get("drafts_offered", 0) for r in self.runs)
        return kept, offered

    def median_of(self, key: str) -> float | None:
        values = [r.summary[key] for r in self.runs if isinstance(r.summary.get(key), (int, float))]
        return statistics.median(values) if values else None

    @property
    def is_approximate(self) -> bool:
        """A run used cache-aware routing (`--moce-protect`): not lossless, labelled in every row."""
        return any(r.summary.get("approximate") for r in self.runs)

    def to_dict(self) -> dict:
        spread, iqr = self.spread(), self.iqr()
        kept, offered = self.drafts()
        return {
            "mode": self.mode,
            "kind": self.kind,
            "refused": self.refusal.message if self.refusal else None,
            "median_tokens_per_s": self.median,
            "min_tokens_per_s": spread[0] if spread else None,
            "max_tokens_per_s": spread[1] if spread else None,
            "iqr_tokens_per_s": list(iqr) if iqr else None,
            "warmup_tokens_per_s": [r.tokens_per_s for r in self.warmup],
            "drafts_kept": kept,
            "drafts_offered": offered,
            "acceptance": kept / offered if offered else None,
            "identical_to_serial": self.identical,
            **({"approximate": True} if self.is_approximate else {}),
            "first_difference": list(self.first_difference) if self.first_difference else None,
            "runs": [
                {"tokens": r.tokens, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s,
                 "output_digest": r.digest(), "stats": r.summary}
                for r in self.runs
            ],
            "warmup": [
                {"tokens": r.tokens, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s,
                 "output_digest": r.digest()}
                for r in self.warmup
            ],
        }


@dataclass(frozen=True)
class TargetCheck:
    """One speed target (auto against serial on prose, against the best fixed N on copy-heavy
    work), evaluated on one workload."""

    workload: str
    rule: str
    ratio: float
    threshold: float

    @property
    def passed(self) -> bool:
        return self.ratio >= self.threshold

    def to_dict(self) -> dict:
        return {"workload": self.workload, "rule": self.rule, "ratio": self.ratio,
                "threshold": self.threshold, "passed": self.passed}


@dataclass
class WorkloadResult:
    name: str
    category: str
    description: str
    prompts: int
    prompt_tokens: list[int]
    modes: list[ModeResult] = field(default_factory=list)
    prefill_tokens_per_s: float | None = None  # strata's prefill of the prompts (done once, untimed in modes)

    def mode(self, label: str) -> ModeResult | None:
        return next((m for m in self.modes if m.mode == label), None)

    @property
    def diverged(self) -> list[str]:
        """strata modes whose output differs from serial's (must be empty)."""
        return [m.mode for m in self.modes if m.kind == "strata" and m.identical is False]

    def best_fixed(self) -> ModeResult | None:
        """The fixed draft length with the highest median tokens/s, or None without one."""
        fixed = [m for m in self.modes if m.kind == "strata" and m.mode.isdigit() and m.median]
        return max(fixed, key=lambda m: m.median) if fixed else None

    def auto_ratios(self) -> list[dict]:
        """Every auto mode's median tokens/s against serial's and the best fixed length's, all
        measured in this run (None where a reference is missing)."""
        serial, best = self.mode("serial"), self.best_fixed()
        return [
            {"mode": auto.mode,
             "vs_serial": auto.median / serial.median if serial and serial.median else None,
             "best_fixed": best.mode if best else None,
             "vs_best_fixed": auto.median / best.median if best else None}
            for auto in self.modes if auto.mode.startswith("auto") and auto.median
        ]

    def targets(self) -> list[TargetCheck]:
        """The targets that apply to this workload's category, for every auto mode measured."""
        checks = []
        for ratio in self.auto_ratios():
            if self.category == "prose" and ratio["vs_serial"] is not None:
                checks.append(TargetCheck(self.name, f"{ratio['mode']} / serial", ratio["vs_serial"], PROSE_TARGET))
            if self.category == "copy" and ratio["vs_best_fixed"] is not None:
                checks.append(TargetCheck(self.name, f"{ratio['mode']} / best fixed ({ratio['best_fixed']})",
                                       ratio["vs_best_fixed"], COPY_TARGET))
        return checks

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "category": self.category,
            "description": self.description,
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "diverged": self.diverged,
            "targets": [t.to_dict() for t in self.targets()],
            "auto_ratios": self.auto_ratios(),
            "modes": [m.to_dict() for m in self.modes],
        }


@dataclass
class BenchResult:
    meta: dict
    workloads: list[WorkloadResult] = field(default_factory=list)

    @property
    def diverged(self) -> dict[str, list[str]]:
        return {w.name: w.diverged for w in self.workloads if w.diverged}

    def targets(self) -> list[TargetCheck]:
        return [t for w in self.workloads for t in w.targets()]

    @property
    def missed(self) -> list[TargetCheck]:
        """Targets this run did not meet (`strata bench --check` exits 1 on any)."""
        return [t for t in self.targets() if not t.passed]

    def to_dict(self) -> dict:
        return {
            "meta": self.meta,
            "diverged": self.diverged,
            "targets": [t.to_dict() for t in self.targets()],
            "workloads": [w.to_dict() for w in self.workloads],
        }


def result_from_dict(data: dict) -> BenchResult:
    """Rebuild a BenchResult from its `to_dict()` JSON (to re-render a table or plot later).

    Generated ids are not stored in the JSON (only digests), so the rebuilt runs carry none.
    """

    def run(r: dict) -> RunResult:
        return RunResult(token_ids=[], tokens=r["tokens"], seconds=r["seconds"], summary=r.get("stats", {}))

    result = BenchResult(meta=data.get("meta", {}))
    for w in data.get("workloads", []):
        wr = WorkloadResult(w["name"], w["category"], w.get("description", ""), w["prompts"], w["prompt_tokens"],
                            prefill_tokens_per_s=w.get("prefill_tokens_per_s"))
        for m in w["modes"]:
            wr.modes.append(ModeResult(
                m["mode"], m["kind"], warmup=[run(r) for r in m["warmup"]], runs=[run(r) for r in m["runs"]],
                refusal=PeerRefusal(m["refused"]) if m.get("refused") else None,
                identical=m.get("identical_to_serial"),
                first_difference=tuple(m["first_difference"]) if m.get("first_difference") else None,
            ))
        result.workloads.append(wr)
    return result


def first_difference(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, token) index of the first differing id (a missing tail counts), or None."""
    for p, (a, b) in enumerate(zip(reference, other)):
        for t in range(max(len(a), len(b))):
            if t >= len(a) or t >= len(b) or a[t] != b[t]:
                return p, t
    if len(reference) != len(other):
        return min(len(reference), len(other)), 0
    return None
