"""Count the MLX primitives of a lazy graph and attribute them to the parts of a model step.

On a GPU every primitive of a decode step costs host time when it is dispatched (~10 µs on the
H200, docs/benchmarks.md, issue 10), and the primitives of a graph are the same on every
backend once the backend-specific calls are accounted for (scripts/bench/step_ops.py does that).
The graph comes from `mx.export_to_dot`, which walks every unevaluated input of its outputs.

An op is attributed to the first part (in the order given, normally the order the parts
finished building) whose output depends on it; ops no part depends on are `REST`.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

REST = "rest"
# Primitives that only describe a view of their input (no kernel when the input is contiguous);
# they still cost a trip through the evaluator.
VIEW_OPS = frozenset({"Broadcast", "Reshape", "Slice", "Split", "Transpose", "ExpandDims", "Squeeze",
                      "AsStrided", "Flatten", "Unflatten", "StopGradient"})

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)"')
_EDGE = re.compile(r'^("?)([^"\s]+)\1 -> ("?)([^"\s]+)\3$')


@dataclass(frozen=True)
class Graph:
    """Primitives by node id, with their input arrays, and the primitive that made each array."""

    labels: dict[str, str]  # node -> primitive name
    inputs: dict[str, list[str]]  # node -> input array names
    producer: dict[str, str]  # array name -> node

    def ancestors(self, array: str) -> set[str]:
        """Node ids `array` depends on (its own producer included)."""
        seen: set[str] = set()
        todo = [array]
        while todo:
            node = self.producer.get(todo.pop())
            if node is None or node in seen:
                continue
            seen.add(node)
            todo.extend(self.inputs[node])
        return seen


def parse_dot(text: str) -> Graph:
    """The graph of `mx.export_to_dot`'s output.

    The dot names a node by its primitive object, which calls of one compiled function share,
    so a node is each occurrence of a node line: its edges follow it, before the next one.
    """
    labels: dict[str, str] = {}
    inputs: dict[str, list[str]] = {}
    producer: dict[str, str] = {}
    current: dict[str, str] = {}  # dot id -> the occurrence its edges now belong to
    for line in text.splitlines():
        line = line.strip()
        node = _NODE.match(line)
        if node:
            occurrence = f"{node.group(1)}#{len(labels)}"
            current[node.group(1)] = occurrence
            labels[occurrence] = node.group(2)
            inputs[occurrence] = []
            continue
        edge = _EDGE.match(line)
        if not edge:
            continue
        source_quoted, source, target = edge.group(1), edge.group(2), edge.group(4)
        if source_quoted:  # array -> primitive
            inputs[current[target]].append(source)
        else:  # primitive -> array
            producer[target] = current[source]
    return Graph(labels, inputs, producer)


def export_graph(roots: list[mx.array], named: dict[str, mx.array] | None = None) -> Graph:
    """The unevaluated graph behind `roots`; `named` arrays keep their names in it."""
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *roots, **(named or {}))
    return parse_dot(buffer.getvalue())


@dataclass
class StepCount:
    """The primitives of one step: by part, by primitive name, and how many are views."""

    by_part: Counter
    by_primitive: Counter
    views: int

    @property
    def total(self) -> int:
        return sum(self.by_part.values())


def count_step(roots: list[mx.array], parts: list[tuple[str, mx.array]],
               relabel: list[tuple[str, mx.array]] = ()) -> StepCount:
    """Count the primitives behind `roots`, attributed to `parts` ((part, output) in build order).

    `relabel`: (name, output) pairs whose producing primitive is reported as `name` (stand-ins
    for backend kernels).
    """
    names: dict[int, str] = {}  # one name per array: a part's output may also be relabelled
    part_names = [names.setdefault(id(array), f"part{i}") for i, (_, array) in enumerate(parts)]
    relabel_names = [names.setdefault(id(array), f"relabel{i}") for i, (_, array) in enumerate(relabel)]
    arrays = {id(array): array for _, array in [*parts, *relabel]}
    graph = export_graph(roots, {name: arrays[key] for key, name in names.items()})
    labels = dict(graph.labels)
    for (name, _), array_name in zip(relabel, relabel_names):
        node = graph.producer.get(array_name)
        if node is not None:
            labels[node] = name
    by_part: Counter = Counter()
    assigned: set[str] = set()
    for (part, _), array_name in zip(parts, part_names):
        mine = graph.ancestors(array_name) - assigned
        by_part[part] += len(mine)
        assigned |= mine
    by_part[REST] += len(set(labels) - assigned)
    by_primitive = Counter(labels.values())
    views = sum(n for name, n in by_primitive.items() if name in VIEW_OPS)
    return StepCount(by_part, by_primitive, views)
