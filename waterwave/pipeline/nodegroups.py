"""Node groups: a job's training step cut into continuous groups of
operators, each allocating or freeing about ``split_size`` bytes (Waterwave
paper, section 4.4).

The step's operators are visited in BFS depth order, then by node id: a
node's depth is its level, one more than its deepest predecessor's, so the
order is a topological order (the paper takes depth from a breadth-first
search; its levels are these when every path from the inputs has the same
length). ``order="program"`` keeps the captured program order instead.
Nodes join the current group until its net (de)allocation reaches
``split_size`` bytes; a group that allocates on balance is an allocation
group (ANG), one that frees a deallocation group (DNG).

A node's bytes: its outputs, less the tensors it uses last (freed when it
has run, as eager PyTorch frees at scheduling time). Persistent tensors and
the batch are neither.

``two_groups`` gives the coarse partitions of the paper's Waterwave-s: the
forward and backward passes, or the step cut at its peak.

May import: waterwave.graph.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from ..graph.lifetimes import lifetimes

ORDERS = ("bfs", "program")


@dataclass
class NodeGroup:
    index: int
    nodes: list[int]  # node ids, in execution order
    delta: int        # bytes allocated less bytes freed
    rise: int         # the most bytes live above the group's start, while it runs

    @property
    def kind(self) -> str:
        return "ANG" if self.delta >= 0 else "DNG"


@dataclass
class Partition:
    order: list[int]        # the step's node order
    groups: list[NodeGroup]
    split_size: int
    how: str = "split_size"  # or "forward/backward", "peak"
    peak: int = 0            # the step's most live bytes above its start

    @property
    def num_angs(self) -> int:
        """Allocation groups before the first deallocation group."""
        return next((g.index for g in self.groups if g.kind == "DNG"), len(self.groups))

    def group_of(self) -> dict[int, int]:
        """Node id -> its group's index."""
        return {v: grp.index for grp in self.groups for v in grp.nodes}


def bfs_order(g: Graph) -> list[int]:
    """Nodes by depth (one more than the deepest predecessor), then id."""
    depth = [0] * len(g.nodes)
    for v in g.program_order:
        depth[v] = max((depth[p] + 1 for p in g.preds(v)), default=0)
    return sorted(range(len(g.nodes)), key=lambda v: (depth[v], v))


def node_order(g: Graph, order: str | list[int]) -> list[int]:
    if isinstance(order, list):
        return order
    if order == "bfs":
        return bfs_order(g)
    if order == "program":
        return list(g.program_order)
    raise ValueError(f"unknown node order {order!r}: choose one of {', '.join(ORDERS)}")


def node_deltas(g: Graph, order: list[int]) -> list[int]:
    """Bytes each node of ``order`` allocates less the bytes it frees."""
    kept = {t.id for t in g.tensors if t.persistent or t.kind == "input"}
    delta = {v: sum(g.tensors[t].size for t in g.nodes[v].outputs) for v in order}
    for t, (_, end) in zip(g.tensors, lifetimes(g, order)):
        if t.id not in kept and t.size:
            delta[order[end]] -= t.size
    return [delta[v] for v in order]


def _group(index: int, nodes: list[int], deltas: list[int]) -> NodeGroup:
    rise, acc = 0, 0
    for d in deltas:
        acc += d
        rise = max(rise, acc)
    return NodeGroup(index, nodes, acc, rise)


def partition(g: Graph, split_size: int, order: str | list[int] = "bfs") -> Partition:
    """Continuous node groups of about ``split_size`` bytes each."""
    if split_size <= 0:
        raise ValueError(f"split_size must be positive, got {split_size}")
    order = node_order(g, order)
    deltas = node_deltas(g, order)
    groups, start, acc = [], 0, 0
    for i, d in enumerate(deltas):
        acc += d
        if abs(acc) >= split_size or i == len(order) - 1:
            groups.append(_group(len(groups), order[start:i + 1], deltas[start:i + 1]))
            start, acc = i + 1, 0
    return Partition(order, groups, split_size, peak=_peak(deltas))


def auto_split_size(g: Graph, groups: int = 8) -> int:
    """The split size when none is given: the step's peak of live bytes over
    ``groups`` (about that many ANGs and as many DNGs), at least the largest
    single node's bytes, so that no group is cut inside a node. Figure 8 of
    the paper: too small costs a barrier per group, too large loses the order
    of allocations and frees."""
    order = bfs_order(g)
    deltas = node_deltas(g, order)
    return max(_peak(deltas) // groups, max((abs(d) for d in deltas), default=1), 1)


def two_groups(g: Graph, at: str = "forward") -> Partition:
    """Waterwave-s: the step in two groups, cut after the forward pass (its
    loss) or at the node where live bytes peak, in program order."""
    order = list(g.program_order)
    deltas = node_deltas(g, order)
    if at == "forward":
        loss = [g.producer(t) for t in g.meta.get("outputs", []) if g.producer(t) is not None]
        cut = order.index(min(loss)) + 1 if loss else len(order) // 2
    elif at == "peak":
        acc, best, cut = 0, -1, 1
        for i, d in enumerate(deltas):
            acc += d
            if acc > best:
                best, cut = acc, i + 1
    else:
        raise ValueError(f"two_groups cuts at 'forward' or 'peak', not {at!r}")
    cut = min(max(cut, 1), len(order) - 1)
    groups = [_group(0, order[:cut], deltas[:cut]), _group(1, order[cut:], deltas[cut:])]
    return Partition(order, groups, max(abs(groups[0].delta), 1), how=at, peak=_peak(deltas))


def _peak(deltas: list[int]) -> int:
    acc = peak = 0
    for d in deltas:
        acc += d
        peak = max(peak, acc)
    return peak
