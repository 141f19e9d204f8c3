"""Is this tree slower than an older one anywhere? The same measurements run by both, alternating.

Each tree's own CLI and scripts run in their own processes (`PYTHONPATH` = the tree, a cache
directory each), on one checkpoint and one set of workload files, round by round, the trees'
order alternating so a machine's drift hits both:

- `greedy` and `sampled` (`--temperature`, one `--seed`): `strata bench` in `--modes`;
- `streamed`: the checkpoint converted by each tree's `strata convert --stream`, decoded with
  `--resident-experts` a `--cache-fraction` of each MoE layer's experts;
- `prefill`: each tree's `prefill_bench` (strata alone, `--prefill-args` passed on);
- `prompts` and `streamed-prompts`: one `strata generate --each-line --max-tokens 1` process
  prefilling each workload's prompt (its lines joined) `--repeats` + 1 times, the first of each
  apart as its shape's warm-up: prefill tokens/s as a user's later prompts get it, of the
  checkpoint and of the streamed conversion;
- `first-token`: `strata generate --max-tokens 1` of each workload's prompt, a process each, timed
  from its start to its exit (load, any warm-up, the prompt's prefill, one token: what a user
  waits), as prompt tokens a second of that wall time.

The report gives every (setting, workload, mode)'s median tokens/s of each tree over all runs of
all rounds and their ratio (new / old), and whether the two trees wrote the same texts (bench's
output digests: greedy text must match; sampled text matches when both trees draw the same
random numbers in the same order, which a lossless sampler keeps).

    python -m scripts.bench.versus_tree                                  # against d8d28df, demo model, every setting
    python -m scripts.bench.versus_tree --base-dir /tmp/base --settings sampled,streamed --rounds 3 --out v.json
    python -m scripts.bench.versus_tree --settings prefill --prefill-args "--synthetic 80b"   # GPU
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from strata_cli.bench.workloads import WorkloadError, parse_workload

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BASE = "d8d28df"  # the tree issue 37 was filed at: its "nothing slower than today"
SETTINGS = ("greedy", "sampled", "streamed", "prefill", "prompts", "streamed-prompts", "first-token")
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


class TreeError(RuntimeError):
    """A tree that cannot be unpacked or a run of it that failed (the message says which)."""


def unpack(rev: str, into: Path) -> Path:
    """The files of `rev` (this repository's git) under `into`, as `git archive` gives them."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
    if archive.returncode:
        raise TreeError(f"git archive {rev}: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


class Tree:
    """A source tree whose `strata_cli` and scripts run in child processes."""

    def __init__(self, label: str, path: Path, work: Path):
        self.label, self.path = label, path.resolve()
        self.cache = work / f"cache-{label}"  # calibrations and digests apart: the trees' formats may differ
        search = os.pathsep.join(filter(None, [str(self.path), os.environ.get("PYTHONPATH")]))  # MLX's own may be there
        self.env = {**os.environ, "PYTHONPATH": search, "XDG_CACHE_HOME": str(self.cache)}

    def run(self, argv: list[str], what: str, stdin: str | None = None) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=self.path, env=self.env, capture_output=True, text=True,
                              input=stdin)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
            raise TreeError(f"{self.label}: {what} failed (exit {done.returncode}):\n  " + "\n  ".join(tail))
        return done.stdout

    def cli(self, args: list[str], what: str, stdin: str | None = None) -> str:
        return self.run(["-m", "strata_cli.cli", *args], what, stdin)

    def check_imports(self) -> None:
        """Its children import this tree's `strata_cli`, not an installed one."""
        where = Path(self.run(["-c", "import strata_cli; print(strata_cli.__file__)"], "import").strip())
        if not where.resolve().is_relative_to(self.path):
            raise TreeError(f"{self.label}: imports strata_cli from {where}, not from {self.path}")

    def prefill_script(self) -> list[str]:
        """The tree's prefill_bench, wherever that tree keeps it (scripts/bench/ now, scripts/ once)."""
        if (self.path / "scripts/bench/prefill_bench.py").is_file():
            return ["-m", "scripts.bench.prefill_bench"]
        if (self.path / "scripts/prefill_bench.py").is_file():
            return [str(self.path / "scripts/prefill_bench.py")]
        raise TreeError(f"{self.label}: no prefill_bench script in {self.path}")


def expert_count(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    for key in EXPERT_COUNT_KEYS:
        if key in config:
            return int(config[key])
    raise TreeError(f"{model_dir}/config.json names no expert count ({', '.join(EXPERT_COUNT_KEYS)})")


def bench_runs(path: Path) -> list[dict]:
    """(workload, mode, tokens/s, output digest) of every measured run in a bench JSON, and each
    workload's one prefill before its modes (on a GPU the process's first of that prompt's shape,
    kernel builds and all: `prompts` gives the warm figure)."""
    result = json.loads(path.read_text())
    rows = []
    for workload in result["workloads"]:
        if workload.get("prefill_tokens_per_s"):
            rows.append(dict(workload=workload["name"], mode="one-shot prefill (bench)",
                             tokens_per_s=workload["prefill_tokens_per_s"], digest=None))
        for mode in workload["modes"]:
            for run in mode["runs"]:
                rows.append(dict(workload=workload["name"], mode=mode["mode"], tokens_per_s=run["tokens_per_s"],
                                 digest=run.get("output_digest")))
    return rows


def prefill_runs(path: Path) -> list[dict]:
    result = json.loads(path.read_text())
    side = result["sides"]["strata"]
    return [dict(workload=f"{result['tokens']} tokens", mode="prefill", tokens_per_s=result["tokens"] / s, digest=None)
            for s in side["seconds"]]


class Study:
    def __init__(self, args, trees: list[Tree], work: Path):
        self.args, self.trees, self.work = args, trees, work
        self.streamed: dict[str, Path] = {}  # each tree's own streamed conversion of the model
        self.resident: int | None = None

    def bench_args(self, setting: str, tree: Tree, out: Path) -> list[str]:
        a = self.args
        model = self.streamed[tree.label] if setting == "streamed" else a.model
        argv = ["bench", *a.workloads, "--workloads-dir", str(a.workloads_dir), "--no-peers",
                "--modes", a.stream_modes if setting == "streamed" else a.modes,
                "-n", str(a.max_tokens), "-r", str(a.repeats), "--warmup", str(a.warmup),
                "--seed", str(a.seed), "--model", str(model), "--out", str(out)]
        if setting == "sampled":
            argv += ["--temperature", str(a.temperature)]
        if setting == "streamed":
            argv += ["--resident-experts", str(self.resident)]
        if a.dtype:
            argv += ["--dtype", a.dtype]
        return argv + shlex.split(a.bench_args)

    def prepare_streamed(self) -> None:
        """Each tree converts the model with its own `convert --stream` (its format, its records)."""
        for tree in self.trees:
            dst = self.work / f"streamed-{tree.label}"
            if not (dst / "config.json").is_file():
                print(f"{tree.label}: convert {self.args.model} --stream", file=sys.stderr, flush=True)
                tree.cli(["convert", str(self.args.model), str(dst), "--stream"], "convert --stream")
            self.streamed[tree.label] = dst
        experts = expert_count(self.streamed[self.trees[-1].label])
        self.resident = max(1, round(experts * self.args.cache_fraction))

    def measure(self, setting: str, tree: Tree, tag: str) -> list[dict]:
        out = self.work / f"{setting}-{tree.label}-{tag}.json"
        if setting == "prefill":
            argv = [*tree.prefill_script(), "--no-peer", "--repeats", str(self.args.repeats), "--warmup", "1",
                    "--out", str(out), *shlex.split(self.args.prefill_args)]
            if self.args.model != "demo" and "--synthetic" not in self.args.prefill_args:
                argv += ["--model", str(self.args.model)]
            tree.run(argv, "prefill_bench")
            return prefill_runs(out)
        if setting == "first-token":
            return [self.first_token(tree, name) for name in self.args.workloads]
        if setting in ("prompts", "streamed-prompts"):
            return self.prompt_prefills(tree, streamed=setting == "streamed-prompts")
        tree.cli(self.bench_args(setting, tree, out), f"bench ({setting})")
        return bench_runs(out)

    def prompt(self, workload: str) -> str:
        """The workload's (first) prompt, read as bench reads it."""
        try:
            return parse_workload(self.args.workloads_dir / f"{workload}.txt").prompts[0]
        except WorkloadError as e:
            raise TreeError(str(e)) from None

    def generate_args(self, model) -> list[str]:
        return ["generate", "--model", str(model), "--max-tokens", "1", "--json",
                *(["--dtype", self.args.dtype] if self.args.dtype else [])]

    def prompt_prefills(self, tree: Tree, streamed: bool) -> list[dict]:
        times = self.args.repeats + 1
        names = [name for name in self.args.workloads for _ in range(times)]
        lines = [" ".join(self.prompt(name).split("\n")) for name in names]
        argv = [*self.generate_args(self.streamed[tree.label] if streamed else self.args.model), "--each-line"]
        if streamed:
            argv += ["--resident-experts", str(self.resident)]
        out = tree.cli(argv, "generate --each-line", stdin="\n".join(lines) + "\n")
        answers = [json.loads(line) for line in out.splitlines() if line.strip()]
        if len(answers) != len(lines):
            raise TreeError(f"{tree.label}: generate --each-line answered {len(answers)} of {len(lines)} prompts")
        return [dict(workload=name, mode=f"prefill of {answer['stats']['prefill_tokens']} tokens",
                     tokens_per_s=answer["stats"]["prefill_tokens_per_s"], digest=None)
                for i, (name, answer) in enumerate(zip(names, answers)) if i % times]  # each first one: warm-up

    def first_token(self, tree: Tree, workload: str) -> dict:
        argv = [*self.generate_args(self.args.model), self.prompt(workload)]
        started = time.perf_counter()
        stats = json.loads(tree.cli(argv, f"generate ({workload})"))["stats"]
        seconds = time.perf_counter() - started
        return dict(workload=workload, mode="launch to first token", tokens_per_s=stats["prompt_tokens"] / seconds,
                    seconds=seconds, digest=None)


def summarize(runs: list[dict], labels: list[str]) -> list[dict]:
    """Median tokens/s a tree per (setting, workload, mode), their ratio, and whether texts agree."""
    keys = sorted(dict.fromkeys((r["setting"], r["workload"], r["mode"]) for r in runs),
                  key=lambda k: SETTINGS.index(k[0]))  # stable: bench's own order within a setting
    rows = []
    for key in keys:
        of = {label: [r for r in runs if (r["setting"], r["workload"], r["mode"]) == key and r["tree"] == label]
              for label in labels}
        medians = {label: statistics.median(r["tokens_per_s"] for r in rs) for label, rs in of.items() if rs}
        digests = {label: sorted({r["digest"] for r in rs if r["digest"]}) for label, rs in of.items()}
        row = dict(setting=key[0], workload=key[1], mode=key[2], runs={k: len(v) for k, v in of.items()},
                   median_tokens_per_s=medians)
        if len(medians) == 2:
            old, new = (medians[label] for label in labels)
            row["ratio"] = new / old
        if all(digests.values()):
            row["same_text"] = len({tuple(d) for d in digests.values()}) == 1 and all(len(d) == 1 for d in digests.values())
        rows.append(row)
    return rows


def print_table(rows: list[dict], labels: list[str]) -> None:
    print(f"| setting | workload | mode | {labels[0]} tok/s | {labels[1]} tok/s | new / old | same text |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["median_tokens_per_s"]
        cells = [f"{m[label]:.1f}" if label in m else "-" for label in labels]
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        same = {True: "yes", False: "**no**"}.get(r.get("same_text"), "-")
        print(f"| {r['setting']} | {r['workload']} | {r['mode']} | {cells[0]} | {cells[1]} | {ratio} | {same} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"the old tree's revision (default {DEFAULT_BASE})")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="the old tree's files already unpacked (a machine without this repository's history)")
    parser.add_argument("--head-dir", type=Path, default=ROOT, help="the new tree (default: this checkout)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--model", default="demo", help="checkpoint directory or 'demo' (default demo)")
    parser.add_argument("--workloads", nargs="+", default=["copy_edit", "prose"], help="bench workloads")
    parser.add_argument("--workloads-dir", type=Path, default=ROOT / "strata_cli/assets/workloads",
                        help="one set of workload files for both trees (default: this checkout's)")
    parser.add_argument("--modes", default="serial,3,auto", help="bench modes of greedy and sampled")
    parser.add_argument("--stream-modes", default="serial,3", help="bench modes of streamed")
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="streamed: resident experts a layer")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampled: temperature")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dtype", default=None, help="bench's and generate's --dtype (default: each backend's)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs a process")
    parser.add_argument("--warmup", type=int, default=1, help="bench warm-up runs a process")
    parser.add_argument("--rounds", type=int, default=2, help="processes a tree and setting, alternating")
    parser.add_argument("--bench-args", default="", help="more `strata bench` arguments for both trees")
    parser.add_argument("--prefill-args", default="", help="more prefill_bench arguments (e.g. '--synthetic 80b')")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every run and the summary")
    args = parser.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        parser.error(f"--settings: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(SETTINGS)}")
    if not 0 < args.cache_fraction <= 1:
        parser.error("--cache-fraction must be in (0, 1]")

    work = args.dir or Path(tempfile.mkdtemp(prefix="strata-versus-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base_path = args.base_dir or unpack(args.base, work / f"tree-{args.base}")
        trees = [Tree("old", base_path, work), Tree("new", args.head_dir, work)]
        for tree in trees:
            tree.check_imports()
        study = Study(args, trees, work)
        if {"streamed", "streamed-prompts"} & set(settings):
            study.prepare_streamed()
        runs = []
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for setting in settings:
                for tree in order:
                    started = time.perf_counter()
                    got = study.measure(setting, tree, f"r{round_}")
                    runs += [dict(r, setting=setting, tree=tree.label, round=round_) for r in got]
                    print(f"round {round_ + 1}/{args.rounds} {setting} {tree.label}: {len(got)} runs in "
                          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    except TreeError as e:
        print(f"versus_tree: {e}", file=sys.stderr)
        return 1

    labels = [t.label for t in trees]
    rows = summarize(runs, labels)
    print_table(rows, labels)
    if args.out:
        import mlx.core as mx

        from strata_cli.bench.runner import git_commit

        meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), commit=git_commit(), base=args.base,
                    base_dir=str(base_path), head_dir=str(args.head_dir), node=platform.node(),
                    cpu_count=os.cpu_count(), mlx=mx.__version__, device=str(mx.default_device()),
                    argv=sys.argv[1:], resident_experts=study.resident)
        args.out.write_text(json.dumps(dict(meta=meta, summary=rows, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
