"""Render a BenchResult: a rich table, the speed targets, a loud divergence warning, and a PNG plot.

The CLI calls these with its consoles; nothing here prints on its own.
"""

from __future__ import annotations

import re
from pathlib import Path

from .results import BenchResult, ModeResult, WorkloadResult


class PlotError(RuntimeError):
    """The plot cannot be drawn (matplotlib missing, or the file cannot be written)."""


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _output_cell(mr: ModeResult) -> str:
    if mr.identical is None:
        return "-"
    if mr.identical:
        return "[green]same[/green]"
    p, t = mr.first_difference
    if mr.kind == "strata":
        return f"[bold red]DIVERGED[/bold red] p{p}:t{t}"
    return f"[yellow]differs[/yellow] p{p}:t{t}"


def mode_row(wr: WorkloadResult, mr: ModeResult) -> list[str]:
    """The table cells of one mode (see `render_table` for the columns)."""
    if mr.refusal:
        return [wr.name, mr.mode, "[yellow]refused[/yellow]", "(see below)", "", "", "", "", "", "", ""]
    serial, best = wr.mode("serial"), wr.best_fixed()
    spread = mr.spread()
    kept, offered = mr.drafts()
    ratio = mr.median / serial.median if serial and serial.median and mr.median else None
    vs_best = mr.median / best.median if best and mr.median and mr.kind == "strata" else None
    warm = ", ".join(f"{r.tokens_per_s:.1f}" for r in mr.warmup) or "-"
    return [
        wr.name,
        mr.mode + (" [yellow](approximate)[/yellow]" if mr.is_approximate else ""),
        _fmt(mr.median),
        f"{spread[0]:.1f}..{spread[1]:.1f}" if spread else "-",
        warm,
        _fmt(ratio, ".2f") + ("x" if ratio else ""),
        _fmt(vs_best, ".2f") + (f"x ({best.mode})" if vs_best else ""),
        f"{kept}/{offered}" + (f" ({kept / offered:.0%})" if offered else "") if mr.kind == "strata" else
        (str(mr.runs[0].summary.get("drafts_kept", "-")) if mr.runs else "-"),
        _fmt(mr.median_of("tokens_per_window"), ".2f"),
        _fmt(mr.median_of("window_ms_p95"), ".2f"),
        _output_cell(mr),
    ]


COLUMNS = ("workload", "mode", "tok/s", "min..max", "warm-up", "vs serial", "vs best N", "drafts kept/offered",
           "tok/window", "p95 ms", "output")


def render_table(console, result: BenchResult) -> None:
    """The results table, then the targets, then any divergence (loudly). Notes are diagnostics:
    the CLI prints them on stderr (and the JSON keeps them), not here."""
    from rich.markup import escape
    from rich.table import Table

    meta = result.meta
    machine = meta.get("machine", {})
    title = (f"strata bench · {meta.get('model', '?')} · {meta.get('device', '?')} {meta.get('dtype', '')} · "
             f"{meta.get('max_tokens', '?')} tokens × {meta.get('repeats', '?')} repeats · "
             f"commit {meta.get('commit', '?')} · {machine.get('node', '?')}")
    table = Table(title=title, title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("workload", "mode", "output", "min..max") else "right")
    for i, wr in enumerate(result.workloads):
        if i:
            table.add_section()
        for mr in wr.modes:
            table.add_row(*mode_row(wr, mr))
    console.print(table)
    targets = result.targets()
    if targets:
        tt = Table(title="targets", title_justify="left")
        for name in ("workload", "rule", "ratio", "needs", "result"):
            tt.add_column(name)
        for t in targets:
            verdict = "[green]pass[/green]" if t.passed else "[red]FAIL[/red]"
            tt.add_row(t.workload, t.rule, f"{t.ratio:.3f}", f">= {t.threshold:.2f}", verdict)
        console.print(tt)
    refusals = {(mr.mode, mr.refusal.message) for wr in result.workloads for mr in wr.modes if mr.refusal}
    for mode, message in sorted(refusals):
        console.print(f"[yellow]{mode} refused:[/yellow] {escape(message)}")
    if result.diverged:
        console.print(
            "[bold red]DIVERGENCE: greedy output differs from serial in "
            + "; ".join(f"{w}: {', '.join(ms)}" for w, ms in result.diverged.items())
            + ". Speculative decoding must be lossless: this is a bug.[/bold red]"
        )


def markdown(result: BenchResult) -> str:
    """The results as a Markdown table (for docs/benchmarks.md), targets and refusals below it."""
    meta = result.meta
    machine = meta.get("machine", {})
    lines = [
        f"`strata bench` · model `{meta.get('model', '?')}` · {meta.get('device', '?')} {meta.get('dtype', '')} · "
        f"{meta.get('max_tokens', '?')} tokens per prompt, median of {meta.get('repeats', '?')} after "
        f"{meta.get('warmup', '?')} warm-up · commit `{meta.get('commit', '?')}` · "
        f"{machine.get('platform', '?')}, {machine.get('cpu_count', '?')} CPUs, MLX {machine.get('mlx', '?')} · "
        f"{meta.get('date', '?')}",
        "",
        "| workload | mode | tok/s | min..max | warm-up | vs serial | vs best N | drafts kept/offered | tok/window | "
        "p95 ms | output |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wr in result.workloads:
        for mr in wr.modes:
            cells = [re.sub(r"\[/?[a-z ]+\]", "", c) for c in mode_row(wr, mr)]
            lines.append("| " + " | ".join(cells) + " |")
    targets = result.targets()
    if targets:
        lines += ["", "| target | ratio | needs | result |", "|---|---|---|---|"]
        lines += [f"| {t.workload}: {t.rule} | {t.ratio:.3f} | >= {t.threshold:.2f} | {'pass' if t.passed else 'FAIL'} |"
                  for t in targets]
    refusals = sorted({(mr.mode, mr.refusal.message) for wr in result.workloads for mr in wr.modes if mr.refusal})
    lines += [""] + [f"{mode} refused: {message}" for mode, message in refusals] if refusals else []
    return "\n".join(lines) + "\n"


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend (the CLI calls this before a run that will plot).

    Raises:
        PlotError: matplotlib is missing (the `bench` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'strata-cli[bench]'") from None
    return plt


def plot(result: BenchResult, path: Path) -> None:
    """Grouped bars of median tokens/s by workload and mode, with min..max whiskers.

    Raises:
        PlotError: matplotlib is missing (the `bench` extra) or the file cannot be written.
    """
    plt = require_matplotlib()
    labels = []
    for wr in result.workloads:
        for mr in wr.modes:
            if mr.mode not in labels:
                labels.append(mr.mode)
    names = [wr.name for wr in result.workloads]
    width = 0.8 / max(len(labels), 1)
    bars = len(names) * max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.25 * bars + 2)), 4.5))
    cmap = plt.get_cmap("tab20")
    for j, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for i, wr in enumerate(result.workloads):
            mr = wr.mode(label)
            if mr is None or mr.median is None:
                continue
            low, high = mr.spread()
            xs.append(i + (j - (len(labels) - 1) / 2) * width)
            ys.append(mr.median)
            lo.append(mr.median - low)
            hi.append(high - mr.median)
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label, color=cmap(j % 20))
    for i, wr in enumerate(result.workloads):
        for j, label in enumerate(labels):
            mr = wr.mode(label)
            if mr is not None and mr.refusal:
                x = i + (j - (len(labels) - 1) / 2) * width
                ax.text(x, 0, "refused", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s (median, min..max)")
    meta = result.meta
    ax.set_title(f"strata bench: {meta.get('model', '?')} on {meta.get('device', '?')}, commit {meta.get('commit', '?')}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2, title="mode", title_fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise PlotError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)
