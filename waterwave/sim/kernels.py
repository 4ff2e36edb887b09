"""What library kernels do that a captured graph cannot show: the workspaces
they allocate through PyTorch around themselves (cuDNN's convolution
workspaces above all), and the host time of their first call in a thread
(cuDNN chooses an algorithm and builds a plan, then caches it).

Both matter. In the H100 snapshots a ResNet-50 step at batch 64 allocates up
to 316 MB for one convolution's workspace, beside 205 MB outputs; and a job's
first backward, beside another job's first forward, freed almost nothing for
100 ms while its cuDNN calls warmed up, which set the pair's peak.

Two sources, in order:

- *measured*, per operator, from a GPU snapshot of the same model at one
  batch size (``measure``): the snapshot's first step on a stream is aligned
  with the captured graph's allocations in order; a block allocated and
  freed at once right after an operator's output is that operator's
  workspace, and the host time from its outputs to the next operator's is
  its first call's (the kernel is chosen after its outputs are allocated;
  not across a phase boundary, where jobs may wait at a barrier). Workspaces scale with the batch (cuDNN's grow with the
  activations they tile); first calls do not.
- *rules*, fitted on the measured tables (``fit``), for models without one:
  workspaces in proportion to an operator's input and output bytes, with the
  median ratio per operator and kernel shape (1×1 convolutions or not); a
  first call's host time affine in a convolution's weight bytes (least
  squares), the median for other operators.

``data/h100_kernels.json`` holds the tables and rules measured from the H100
snapshots in bench/data/gpu-snapshots; ``bench/calibrate.py`` writes it.

May import: waterwave.graph, this package.
"""
from __future__ import annotations

import difflib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..graph import Graph, Node, round_size
from .phases import phases
from .trace import Trace

DATA = Path(__file__).with_name("data") / "h100_kernels.json"
# Operators whose kernels take workspaces and warm up: the convolutions.
CONV_OPS = ("aten.convolution.default", "aten.convolution_backward.default")


def _kind(node: Node) -> str:
    """The workspace rule's key: operator and whether its kernel is 1×1."""
    pointwise = all(k == 1 for k in node.attrs.get("kernel", [0]))
    return f"{node.op.split('.')[1]}/{'1x1' if pointwise else 'kxk'}"


def _io_bytes(g: Graph, node: Node) -> int:
    return sum(g.tensors[t].size for t in (*node.inputs, *node.outputs))


def weight_bytes(g: Graph, node: Node) -> int:
    """A convolution's weight: argument 1 forward, 2 backward."""
    k = 2 if "backward" in node.op else 1
    return g.tensors[node.inputs[k]].size if len(node.inputs) > k else 0


def measure(snapshot: Trace, g: Graph, stream: int = 0) -> dict[str, dict]:
    """Each operator's first-call host time (µs) and each convolution's
    workspaces in the first step of ``stream`` of a snapshot of the model
    ``g`` was captured from, at the same batch size: name ->
    {"workspaces": [...], "first_us": ...}."""
    allocs: list[tuple[int, float]] = []  # the stream's lasting allocations: (bytes, time)
    temps: dict[int, list[int]] = {}      # index in allocs -> workspaces right after it
    ops = [op for op in snapshot.ops if op.stream == stream and (op.alloc or op.free)]
    i = 0
    while i < len(ops):
        op = ops[i]
        if (op.alloc and i + 1 < len(ops) and ops[i + 1].free
                and ops[i + 1].free[0] == op.alloc[0][0]):
            temps.setdefault(len(allocs) - 1, []).append(op.alloc[0][1])
            i += 2
            continue
        if op.alloc:
            allocs.append((op.alloc[0][1], op.time_us or 0.0))
        i += 1
    outputs = [(node, g.tensors[t].size) for node in g.nodes for t in node.outputs
               if g.tensors[t].size]
    # The first step starts at the first output of the graph's first operator.
    at = next((k for k, (n, _) in enumerate(allocs) if n == outputs[0][1]), None) if outputs else None
    found: dict[str, dict] = {}
    if at is None:
        return found
    # Align the first step (and no more) with the graph's outputs in order.
    window = allocs[at:at + len(outputs) + len(outputs) // 2]
    match = difflib.SequenceMatcher(None, [n for n, _ in window], [n for _, n in outputs],
                                    autojunk=False)
    starts: list[tuple[Node, float]] = []  # each matched operator and its first output's time
    for block in match.get_matching_blocks():
        for i in range(block.size):
            node, k = outputs[block.b + i][0], at + block.a + i
            if not starts or starts[-1][0] is not node:
                starts.append((node, allocs[k][1]))
            entry = found.setdefault(node.name, {"workspaces": [], "first_us": 0.0})
            if node.op in CONV_OPS:
                entry["workspaces"] += temps.get(k, [])
    # A kernel is chosen after its outputs are allocated: its first call's
    # host time runs from its outputs to the next operator's.
    # Not across a phase boundary: jobs wait at barriers there.
    phase = phases(g)
    for (node, start), (after, following) in zip(starts, starts[1:]):
        if phase[node.id] == phase[after.id]:
            found[node.name]["first_us"] = round(max(0.0, following - start), 1)
    return found


def fit(tables: list[tuple[Graph, dict[str, dict]]], first_call: list[tuple[Graph, dict]]) -> dict:
    """The rules: per workspace kind the median ratio of each workspace
    (first, second ...) to the operator's input and output bytes; per
    operator the first call's host time as a + b·(weight MiB)."""
    ratios: dict[str, list[list[float]]] = {}
    for g, nodes in tables:
        by_name = {n.name: n for n in g.nodes}
        for name, entry in nodes.items():
            node = by_name[name]
            if node.op not in CONV_OPS:
                continue
            slots = ratios.setdefault(_kind(node), [])
            for k, size in enumerate(entry["workspaces"]):
                if len(slots) <= k:
                    slots.append([])
                slots[k].append(size / _io_bytes(g, node))
    points: dict[str, list[tuple[float, float]]] = {}
    for g, nodes in first_call:
        by_name = {n.name: n for n in g.nodes}
        for name, entry in nodes.items():
            node = by_name[name]
            x = weight_bytes(g, node) / 2**20 if node.op in CONV_OPS else 0.0
            points.setdefault(node.op.split(".")[1], []).append((x, entry["first_us"]))
    return {"workspaces": {kind: [round(statistics.median(r), 4) for r in slots]
                           for kind, slots in ratios.items()},
            "first_us": {op: [round(c, 1) for c in _affine(pts)] for op, pts in points.items()}}


def _affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares a + b·x through the points; the median where x does
    not vary (operators without a weight)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if not var:
        return statistics.median(ys), 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / var
    return my - b * mx, b


@dataclass
class KernelModel:
    """Workspaces and first-call host time per operator: measured tables by
    model name (each with the batch size it was measured at), else rules."""
    tables: dict[str, dict] = field(default_factory=dict)  # model -> {"batch", "nodes"}
    rules: dict = field(default_factory=dict)              # see fit()
    source: str = ""

    @classmethod
    def load(cls, path: str | Path = DATA) -> "KernelModel":
        d = json.loads(Path(path).read_text())
        return cls(d.get("tables", {}), d.get("rules", {}), str(d.get("source", path)))

    def save(self, path: str | Path = DATA) -> None:
        Path(path).write_text(json.dumps({"source": self.source, "rules": self.rules,
                                          "tables": self.tables}, indent=1) + "\n")

    def _measured(self, node: Node, model: str | None) -> tuple[dict | None, int]:
        table = self.tables.get(model or "")
        if table is None:
            return None, 0
        return table["nodes"].get(node.name), table["batch"]

    def workspaces(self, g: Graph, node: Node, model: str | None, batch: int | None) -> list[int]:
        """The workspaces ``node`` allocates around its kernels, in order."""
        if node.op not in CONV_OPS:
            return []
        entry, measured_at = self._measured(node, model)
        if entry is not None and batch:
            return [round_size(int(n * batch / measured_at)) for n in entry["workspaces"]]
        io = _io_bytes(g, node)
        ratios = self.rules.get("workspaces", {}).get(_kind(node), [])
        return [round_size(int(r * io)) for r in ratios if r > 0]

    def first_us(self, g: Graph, node: Node, model: str | None) -> float:
        """Host time of the operator's first call in a thread."""
        entry, _ = self._measured(node, model)
        if entry is not None:
            return float(entry.get("first_us", 0.0))
        a, b = self.rules.get("first_us", {}).get(node.op.split(".")[1], (0.0, 0.0))
        x = weight_bytes(g, node) / 2**20 if node.op in CONV_OPS else 0.0
        return max(0.0, a + b * x)


NONE = KernelModel(source="none: no workspaces, no first-call costs")
