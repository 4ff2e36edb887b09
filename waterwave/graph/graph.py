"""The dataflow graph of one training step, as the planners see it.

Nodes are operators in program order. Tensors are *storages*: views share
their base's storage, so they add no tensor (their users become users of the
base). A node reads its ``inputs``, creates its ``outputs`` (all at once,
for multi-output operators) and may write some inputs in place
(``mutates``); ``deps`` are extra ordering edges that in-place writes need
(earlier readers of the old value run before the writer, later readers after).

Persistent tensors (weights, gradients kept across steps, optimizer state,
buffers) exist before and after the step; they have no producer inside it.
Graph inputs (the batch) also exist before the step but die after their last
use. Sizes are in bytes, rounded as PyTorch's CUDA caching allocator rounds
them (multiples of 512).

JSON format (``format: "waterwave-graph"``, ``version: 1``)::

    {"format": "waterwave-graph", "version": 1, "name": "...",
     "meta": {...},
     "tensors": [{"id": 0, "name": "...", "size": 512, "kind": "activation",
                  "persistent": false}, ...],
     "nodes": [{"id": 0, "name": "...", "op": "aten.addmm.default",
                "inputs": [0, 1], "outputs": [2], "mutates": [], "deps": [],
                "inplace_ok": [0]}, ...]}

``meta`` says how the step was captured: ``optimizer``, ``input_shapes`` and
``kernels``, the device whose operators the graph records (``cuda`` or
``cpu``; graphs saved before it was recorded are ``cpu``).
Nodes may also carry ``flops`` (from torch's flop counter) and ``attrs``
(``{"kernel": [kh, kw]}`` for convolutions): the simulator times operators
and sizes convolution workspaces from them; graphs without them still load.
``kind`` is one of ``input``, ``param``, ``buffer``, ``grad``,
``optimizer_state``, ``activation``. ``inplace_ok`` lists inputs that the
operator could overwrite with its output (pointwise operators of equal size,
from the operator's tags): the MXNet and Paddle baselines may share those.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable

from .input_limits import input_limits, read_bytes

FORMAT = "waterwave-graph"
VERSION = 1
KINDS = ("input", "param", "buffer", "grad", "optimizer_state", "activation")


class GraphError(ValueError):
    """A graph that is malformed or a graph file that cannot be read."""


class _NumberOutOfRange(Exception):
    """A number in a file that no waterwave file holds."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NumberOutOfRange(text)
    return value


def _int64(text: str) -> int:
    # Checked on the digits first: a number of thousands of digits is not
    # worth converting (Python refuses past 4,300 anyway).
    if len(text.lstrip("-")) > 20 or not -(1 << 63) <= (value := int(text)) < 1 << 64:
        raise _NumberOutOfRange(text)
    return value


def _no_constant(text: str) -> float:
    raise _NumberOutOfRange(text)  # NaN, Infinity, -Infinity: not JSON, but Python writes them


def read_json(path: str, error: type[ValueError]) -> object:
    """Parse a JSON file of at most the file-size limit (input_limits.py); a
    parse failure, nesting too deep for the parser, or a number past what a
    waterwave file holds (a float that is not finite, a whole number beyond
    64 bits) raises ``error`` saying the file is corrupt."""
    raw = read_bytes(path, error)
    try:
        return json.loads(raw, parse_float=_finite_float, parse_int=_int64,
                          parse_constant=_no_constant)
    except _NumberOutOfRange as e:
        number = str(e) if len(str(e)) <= 24 else f"{str(e)[:20]}... ({len(str(e))} digits)"
        raise error(f"{path}: holds the number {number}, past what a waterwave file holds "
                    "(finite numbers, whole numbers within 64 bits); the file is corrupt") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); the file is corrupt") from None
    except RecursionError:
        raise error(f"{path}: not a waterwave file: its JSON is nested too deeply to read; the "
                    "file is corrupt") from None


def write_json(path: str, d: dict) -> None:
    """Write a file's dict as JSON."""
    with open(path, "w") as f:
        json.dump(d, f)


def check_header(d: object, fmt: str, version: int, error: type[ValueError], redo: str) -> None:
    """Check a versioned file's ``format`` and ``version``; ``redo`` says how to get a new one."""
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise error(f"not a waterwave {fmt.split('-')[-1]} (expected \"format\": \"{fmt}\")")
    if d.get("version") != version:
        raise error(f"{fmt} format version {d.get('version')!r} is not supported "
                    f"(this waterwave reads version {version}); {redo}")


@dataclass
class Tensor:
    id: int
    name: str
    size: int
    kind: str = "activation"
    persistent: bool = False

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "size": self.size, "kind": self.kind,
                "persistent": self.persistent}


@dataclass
class Node:
    id: int
    name: str
    op: str
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    mutates: list[int] = field(default_factory=list)
    deps: list[int] = field(default_factory=list)
    inplace_ok: list[int] = field(default_factory=list)
    flops: int = 0  # floating-point operations, where torch's flop counter knows the operator
    attrs: dict = field(default_factory=dict)  # e.g. {"kernel": [3, 3]} for a convolution

    def to_dict(self) -> dict:
        d = {"id": self.id, "name": self.name, "op": self.op, "inputs": self.inputs,
             "outputs": self.outputs, "mutates": self.mutates, "deps": self.deps,
             "inplace_ok": self.inplace_ok}
        if self.flops:
            d["flops"] = self.flops
        if self.attrs:
            d["attrs"] = self.attrs
        return d


class Graph:
    def __init__(self, name: str = "graph", meta: dict | None = None):
        self.name = name
        self.meta = dict(meta or {})
        self.tensors: list[Tensor] = []
        self.nodes: list[Node] = []
        self._derived = None

    # Building -------------------------------------------------------------
    def add_tensor(self, name: str, size: int, kind: str = "activation",
                   persistent: bool = False) -> int:
        if kind not in KINDS:
            raise GraphError(f"tensor kind {kind!r} is not one of {', '.join(KINDS)}")
        if size < 0:
            raise GraphError(f"tensor {name!r} has a negative size ({size})")
        t = Tensor(len(self.tensors), name, int(size), kind, bool(persistent))
        self.tensors.append(t)
        self._derived = None
        return t.id

    def add_node(self, name: str, op: str, inputs: Iterable[int] = (), outputs: Iterable[int] = (),
                 mutates: Iterable[int] = (), deps: Iterable[int] = (),
                 inplace_ok: Iterable[int] = (), flops: int = 0, attrs: dict | None = None) -> int:
        n = Node(len(self.nodes), name, op, _unique(inputs), _unique(outputs), _unique(mutates),
                 _unique(deps), _unique(inplace_ok), int(flops), dict(attrs or {}))
        self.nodes.append(n)
        self._derived = None
        return n.id

    # Derived structure (cached) ---------------------------------------------
    def _derive(self):
        if self._derived is not None:
            return self._derived
        producer = [None] * len(self.tensors)
        consumers: list[list[int]] = [[] for _ in self.tensors]
        for n in self.nodes:
            for t in n.outputs:
                producer[t] = n.id
            for t in n.inputs:
                consumers[t].append(n.id)
        preds: list[set[int]] = [set() for _ in self.nodes]
        for n in self.nodes:
            for t in n.inputs:
                if producer[t] is not None and producer[t] != n.id:
                    preds[n.id].add(producer[t])
            preds[n.id].update(d for d in n.deps if d != n.id)
        succs: list[list[int]] = [[] for _ in self.nodes]
        for v, ps in enumerate(preds):
            for p in ps:
                succs[p].append(v)
        self._derived = (producer, consumers, [sorted(p) for p in preds], succs)
        return self._derived

    def producer(self, t: int) -> int | None:
        return self._derive()[0][t]

    def consumers(self, t: int) -> list[int]:
        return self._derive()[1][t]

    def preds(self, v: int) -> list[int]:
        return self._derive()[2][v]

    def succs(self, v: int) -> list[int]:
        return self._derive()[3][v]

    @property
    def program_order(self) -> list[int]:
        return [n.id for n in self.nodes]

    def persistent_bytes(self) -> int:
        return sum(t.size for t in self.tensors if t.persistent)

    def validate(self) -> None:
        """Raise GraphError naming the first problem found."""
        nt = len(self.tensors)
        seen_producer: dict[int, int] = {}
        most = input_limits().block_bytes
        for i, t in enumerate(self.tensors):
            if t.id != i:
                raise GraphError(f"tensor at index {i} has id {t.id}; ids must be 0..n-1 in order")
            if not 0 <= t.size <= most:
                raise GraphError(f"tensor {t.name!r} has size {t.size}: sizes must be in 0..{most:,} "
                                 "bytes (waterwave.set_input_limits(block_bytes=...) raises the "
                                 "limit)")
        for i, n in enumerate(self.nodes):
            if n.id != i:
                raise GraphError(f"node at index {i} has id {n.id}; ids must be 0..n-1 in order")
            for t in n.inputs + n.outputs + n.mutates + n.inplace_ok:
                if not 0 <= t < nt:
                    raise GraphError(f"node {n.name!r} refers to tensor {t}, which does not exist")
            for t in n.outputs:
                if t in seen_producer:
                    raise GraphError(f"tensor {self.tensors[t].name!r} is produced by two nodes")
                if self.tensors[t].persistent or self.tensors[t].kind == "input":
                    raise GraphError(f"{self.tensors[t].kind} tensor {self.tensors[t].name!r} "
                                     f"cannot be produced inside the step")
                seen_producer[t] = i
            for t in n.mutates:
                if t not in n.inputs:
                    raise GraphError(f"node {n.name!r} mutates tensor {t} without reading it")
            for d in n.deps:
                if not 0 <= d < len(self.nodes):
                    raise GraphError(f"node {n.name!r} depends on node {d}, which does not exist")
        for t in self.tensors:
            if t.id not in seen_producer and not t.persistent and t.kind != "input":
                raise GraphError(f"tensor {t.name!r} is neither produced, an input, nor persistent")
        if self.topological_order() is None:
            raise GraphError(f"graph {self.name!r} has a cycle")

    def topological_order(self) -> list[int] | None:
        """A topological order (program order where possible), or None on a cycle."""
        indeg = [len(self.preds(v)) for v in range(len(self.nodes))]
        import heapq

        ready = [v for v, d in enumerate(indeg) if d == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            v = heapq.heappop(ready)
            out.append(v)
            for s in self.succs(v):
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        return out if len(out) == len(self.nodes) else None

    def is_topological(self, order: list[int]) -> bool:
        if sorted(order) != list(range(len(self.nodes))):
            return False
        pos = {v: i for i, v in enumerate(order)}
        return all(pos[p] < pos[v] for v in order for p in self.preds(v))

    # Serialization ------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "meta": self.meta,
                "tensors": [t.to_dict() for t in self.tensors],
                "nodes": [n.to_dict() for n in self.nodes]}

    def save(self, path: str) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        check_header(d, FORMAT, VERSION, GraphError, "recapture the model")
        g = cls(d.get("name", "graph"), d.get("meta"))
        try:
            for t in d["tensors"]:
                g.tensors.append(Tensor(int(t["id"]), str(t["name"]), int(t["size"]),
                                        str(t.get("kind", "activation")),
                                        bool(t.get("persistent", False))))
            for n in d["nodes"]:
                g.nodes.append(Node(int(n["id"]), str(n["name"]), str(n["op"]),
                                    [int(x) for x in n.get("inputs", [])],
                                    [int(x) for x in n.get("outputs", [])],
                                    [int(x) for x in n.get("mutates", [])],
                                    [int(x) for x in n.get("deps", [])],
                                    [int(x) for x in n.get("inplace_ok", [])],
                                    int(n.get("flops", 0)), dict(n.get("attrs", {}))))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise GraphError(f"graph file is corrupt: {type(e).__name__}: {e}") from None
        for t in g.tensors:
            if t.kind not in KINDS:
                raise GraphError(f"graph file is corrupt: tensor kind {t.kind!r} is unknown")
        g.validate()
        return g

    @classmethod
    def load(cls, path: str) -> "Graph":
        return cls.from_dict(read_json(path, GraphError))

    def __repr__(self) -> str:
        return (f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.tensors)} tensors, "
                f"{self.persistent_bytes() / 2**20:.1f} MiB persistent)")


def _unique(xs: Iterable[int]) -> list[int]:
    out: list[int] = []
    for x in xs:
        if x not in out:
            out.append(int(x))
    return out
