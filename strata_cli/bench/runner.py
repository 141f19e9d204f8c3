"""Run every workload in every mode: warm-up apart, repeats interleaved, outputs compared.

Habits from mlx-lm's benchmark.py: a fixed seed, EOS disabled (every run generates exactly
`max_tokens` per prompt), warm-up before the timed trials. Modes run round-robin within each
repeat, so slow drift of a shared machine hits every mode alike.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..options import (
    MAX_SUFFIX_DRAFT,
    ConfigError,
    GenerateOptions,
    SpecOptions,
    parse_suffix_draft,
)
from ..speculative.controller import CostPrior
from ..speculative.suffix_drafter import DEFAULT_MIN_MATCH
from ..request import TextRequest
from ..telemetry import DecodeStats
from .peers import PEER_MODES, MlxLmPeer
from .results import (
    BenchResult,
    ModeResult,
    PeerRefusal,
    RunResult,
    WorkloadResult,
    first_difference,
)
from .workloads import Workload

SERIAL = "serial"
DEFAULT_MODES = f"{SERIAL},1-{MAX_SUFFIX_DRAFT},auto,{','.join(PEER_MODES)}"
DEFAULT_BENCH_TOKENS = 128
DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1


@dataclass(frozen=True)
class BenchMode:
    """One way to decode: a strata SpecOptions, or a peer's mode name.

    Attributes:
        label: "serial", "3", "auto:7", "mlx-lm", "mlx-lm-spec".
        spec: the strata options (None for a peer mode).
    """

    label: str
    spec: SpecOptions | None = None

    @property
    def kind(self) -> str:
        return "peer" if self.spec is None else "strata"


@dataclass(frozen=True)
class BenchOptions:
    """How long and how often each mode runs.

    Args:
        max_tokens: tokens generated per prompt, exactly (EOS is disabled; default 128).
        repeats: measured runs per mode and workload (default 3).
        warmup: warm-up runs per mode and workload, reported apart (default 1).
        seed: MLX's global seed and the requests' seed (greedy decoding does not use it).
        temperature: the requests' temperature (default 0: greedy). Sampled draws are keyed by
            position (sampling.py), so every mode's output still equals serial's.
    """

    max_tokens: int = DEFAULT_BENCH_TOKENS
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    seed: int = 0
    temperature: float = 0.0

    def __post_init__(self):
        if self.max_tokens < 1 or self.repeats < 1 or self.warmup < 0:
            raise ConfigError(
                f"bench needs max_tokens >= 1, repeats >= 1, warmup >= 0 "
                f"(got {self.max_tokens}, {self.repeats}, {self.warmup})"
            )
        if not self.temperature >= 0:
            raise ConfigError(f"bench temperature must be >= 0, got {self.temperature}")


def parse_modes(
    text: str, *, min_match: int = DEFAULT_MIN_MATCH, cost_prior: CostPrior | None = None
) -> list[BenchMode]:
    """Read a comma-separated mode list: serial, N, A-B (a range of fixed N), auto, auto:N,
    mlx-lm, mlx-lm-spec. Serial is always included (first): it is the reference output.

    Raises:
        ConfigError: an unknown or repeated mode, naming the accepted forms.
    """
    labels: list[str] = []
    for raw in (part.strip().lower() for part in text.split(",")):
        if not raw:
            continue
        if "-" in raw and raw not in PEER_MODES:
            low, _, high = raw.partition("-")
            try:
                labels += [str(n) for n in range(int(low), int(high) + 1)]
            except ValueError:
                raise ConfigError(f"bench mode {raw!r}: a range is A-B with numbers") from None
        else:
            labels.append(raw)
    modes: list[BenchMode] = [BenchMode(SERIAL, SpecOptions(max_drafts=0, min_match=min_match))]
    for label in labels:
        if label in (SERIAL, "0"):
            continue
        if label in PEER_MODES:
            mode = BenchMode(label)
        else:
            try:
                n, auto = parse_suffix_draft(label)
            except ConfigError:
                raise ConfigError(
                    f"bench mode {label!r}: expected serial, 1..{MAX_SUFFIX_DRAFT}, A-B, auto, auto:N, "
                    f"{' or '.join(PEER_MODES)}"
                ) from None
            spec = SpecOptions(max_drafts=n, min_match=min_match, auto=auto,
                               cost_prior=cost_prior if auto else None)
            mode = BenchMode(spec.label, spec)
        if any(m.label == mode.label for m in modes):
            raise ConfigError(f"bench mode {mode.label!r} is listed twice")
        modes.append(mode)
    return modes


def count_runs(workloads: Sequence[Workload], modes: Sequence[BenchMode], options: BenchOptions) -> int:
    """Runs `run_bench` will make at most (for a progress bar's total)."""
    return len(workloads) * len(modes) * (options.warmup + options.repeats)


class Prefilled:
    """Each prompt's committed state after prefilling `prompt[:-1]`, made once per workload.

    Every run restores it and resumes (`TextRequest.steps(prefilled=...)`) instead of prefilling
    again: prefill is not what bench measures, and on a long prompt it would dominate the
    bench's run time. The resumed state is exactly the prefilled one (snapshots are immutable).
    """

    def __init__(self, engine, tokenizer, texts: Sequence[str]):
        self.engine = engine
        self.tokenizer = tokenizer
        self.texts = list(texts)
        # bench decodes its prompts' ids as they are: no healing
        self.prompts = [TextRequest(tokenizer, text, GenerateOptions(heal=False)).prompt_ids for text in self.texts]
        self.snapshots = []
        self.prefill_tokens, self.prefill_seconds = 0, 0.0
        for ids in self.prompts:
            engine.reset()
            start = time.perf_counter()
            engine.prefill(ids[:-1])
            self.prefill_seconds += time.perf_counter() - start
            self.prefill_tokens += len(ids) - 1
            self.snapshots.append(engine.snapshot())

    @property
    def tokens_per_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    def run(self, spec: SpecOptions, options: BenchOptions) -> RunResult:
        """Decode every prompt once in one strata mode; time decode only."""
        stats = DecodeStats()
        gen = GenerateOptions(max_tokens=options.max_tokens, seed=options.seed, temperature=options.temperature,
                              heal=False)
        outputs, seconds = [], 0.0
        for text, ids, snapshot in zip(self.texts, self.prompts, self.snapshots):
            request = TextRequest(self.tokenizer, text, gen, stats=stats)
            self.engine.restore(snapshot)
            tokens: list[int] = []
            start = time.perf_counter()
            for step in request.steps(self.engine, spec=spec, eos_ids=(), prefilled=len(ids) - 1):
                tokens += step.tokens
            seconds += time.perf_counter() - start
            outputs.append(tokens)
        return RunResult(token_ids=outputs, tokens=sum(map(len, outputs)), seconds=seconds, summary=stats.summary())


def run_peer(peer: MlxLmPeer, mode: str, prompts: Sequence[list[int]], options: BenchOptions) -> RunResult | PeerRefusal:
    """Decode every prompt once with a peer mode (or return its refusal)."""
    outputs, seconds, summary = [], 0.0, {}
    for ids in prompts:
        result = peer.run(mode, list(ids), options.max_tokens)
        if isinstance(result, PeerRefusal):
            return result
        outputs += result.token_ids
        seconds += result.seconds
        for key, value in result.summary.items():
            summary[key] = summary.get(key, 0) + value if key == "drafts_kept" else value
    return RunResult(token_ids=outputs, tokens=sum(map(len, outputs)), seconds=seconds, summary=summary)


def run_bench(
    engine,
    tokenizer,
    workloads: Sequence[Workload],
    modes: Sequence[BenchMode],
    options: BenchOptions,
    *,
    peer: MlxLmPeer | None = None,
    meta: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the bench.

    Args:
        engine: strata's WindowEngine on the model under test.
        tokenizer: the model's tokenizer (prompts are encoded through `TextRequest`).
        workloads: what to run.
        modes: how (from `parse_modes`; the first must be serial).
        options: tokens, repeats, warm-up, seed.
        peer: the loaded mlx-lm peer; required when `modes` has peer modes.
        meta: facts about the run to keep in the result (commit, machine, model, ...).
        progress: called with a short description after every run.

    Returns:
        The `BenchResult`; `result.diverged` lists strata modes whose output differed from serial.
    """
    import mlx.core as mx

    if not modes or modes[0].label != SERIAL:
        raise ConfigError("the first bench mode must be serial (the reference output)")
    if any(m.kind == "peer" for m in modes) and peer is None:
        raise ConfigError("peer modes need a loaded mlx-lm peer")
    if any(m.kind == "peer" for m in modes) and GenerateOptions(temperature=options.temperature).is_sampling:
        raise ConfigError("peer modes decode greedily; they cannot run at temperature > 0")
    mx.random.seed(options.seed)
    result = BenchResult(meta=dict(meta or {}))
    notes = result.meta.setdefault("notes", [])
    for workload in workloads:
        prefilled = Prefilled(engine, tokenizer, workload.prompts)
        prompts = prefilled.prompts
        wr = WorkloadResult(workload.name, workload.category, workload.description,
                            prompts=len(prompts), prompt_tokens=[len(p) for p in prompts],
                            prefill_tokens_per_s=prefilled.tokens_per_s)
        wr.modes = [ModeResult(mode=m.label, kind=m.kind) for m in modes]
        for round_ in range(options.warmup + options.repeats):
            is_warmup = round_ < options.warmup
            for mode, mr in zip(modes, wr.modes):
                if mr.refusal is None:
                    run = (prefilled.run(mode.spec, options) if mode.spec is not None
                           else run_peer(peer, mode.label, prompts, options))
                    if isinstance(run, PeerRefusal):
                        mr.refusal = run
                    else:
                        (mr.warmup if is_warmup else mr.runs).append(run)
                if progress:
                    phase = "warm-up" if is_warmup else f"repeat {round_ - options.warmup + 1}/{options.repeats}"
                    progress(f"{workload.name} · {mode.label} · {phase}")
        _check_outputs(wr, options, notes)
        result.workloads.append(wr)
    return result


def _check_outputs(wr: WorkloadResult, options: BenchOptions, notes: list[str]) -> None:
    """Compare every run with serial's first output; note runs that generated too few tokens."""
    serial = wr.mode(SERIAL)
    reference = (serial.warmup + serial.runs)[0].token_ids
    expected = options.max_tokens * wr.prompts
    for mr in wr.modes:
        runs = mr.warmup + mr.runs
        if not runs:
            continue
        diffs = [first_difference(reference, run.token_ids) for run in runs]
        diffs = [d for d in diffs if d is not None]
        mr.identical = not diffs
        mr.first_difference = min(diffs) if diffs else None
        short = [run.tokens for run in runs if run.tokens != expected]
        if short:
            notes.append(f"{wr.name} / {mr.mode}: generated {short[0]} tokens, expected {expected} "
                         "(the context limit ends generation early)")


def collect_meta(*, model: str, device: str, dtype: str, options: BenchOptions, modes: Sequence[BenchMode],
                 extra: dict | None = None) -> dict:
    """Commit, machine and settings, for the JSON and docs/benchmarks.md."""
    import mlx.core as mx

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "machine": {
            "node": platform.node(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "mlx": getattr(mx, "__version__", "?"),
        },
        "device": device,
        "model": model,
        "dtype": dtype,
        "max_tokens": options.max_tokens,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "seed": options.seed,
        "temperature": options.temperature,
        "modes": [m.label for m in modes],
        **(extra or {}),
    }


def git_commit() -> str:
    """`git describe`-like: the short commit of the source tree, '+dirty' with local changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
