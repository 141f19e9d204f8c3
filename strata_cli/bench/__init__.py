"""`strata bench`: named workloads × decoding modes (serial, fixed draft lengths, auto, mlx-lm
peers), repeated, with warm-up apart, medians and spread, and a greedy-identity check.

Modules: `workloads` (the example files), `runner` (the loop), `peers` (mlx-lm), `results`
(plain data and the speed targets), `report` (table and plot). The CLI's `bench` command is a thin
wrapper around `runner.run_bench` and `report`.
"""

from .peers import MlxLmPeer, PeerError, require_mlx_lm
from .report import PlotError, markdown, plot, render_table, require_matplotlib
from .results import BenchResult, result_from_dict
from .runner import (
    DEFAULT_BENCH_TOKENS,
    DEFAULT_MODES,
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    BenchOptions,
    BenchMode,
    collect_meta,
    count_runs,
    parse_modes,
    run_bench,
)
from .workloads import (
    MissingExtraError,
    Workload,
    WorkloadError,
    default_workloads_dir,
    load_workloads,
)

__all__ = [
    "DEFAULT_BENCH_TOKENS", "DEFAULT_MODES", "DEFAULT_REPEATS", "DEFAULT_WARMUP",
    "BenchOptions", "BenchResult", "MissingExtraError", "BenchMode", "MlxLmPeer", "PeerError", "PlotError",
    "Workload", "WorkloadError", "collect_meta", "count_runs", "default_workloads_dir", "load_workloads",
    "markdown", "parse_modes", "plot", "render_table", "require_matplotlib", "require_mlx_lm",
    "result_from_dict", "run_bench",
]
