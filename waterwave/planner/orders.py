"""Memory-aware topological orders (the cheap heuristics).

Each returns a topological order of the graph; ``best_order`` keeps the one
with the lowest no-fragmentation peak, as XLA's DefaultMemoryScheduler and
Inductor's reorder_for_peak_memory do.
"""
from __future__ import annotations

import heapq
import math
import time
from typing import Iterator

from ..graph import Graph
from ..graph.lifetimes import order_peak


def _frees(g: Graph):
    """Per node: which tensors its run frees (their last user), for a greedy
    that tracks remaining users."""
    keep = set(g.meta.get("outputs", []))
    remaining = [len(g.consumers(t.id)) for t in g.tensors]
    freeable = [not t.persistent and t.id not in keep for t in g.tensors]
    return remaining, freeable


def least_peak_first(g: Graph) -> list[int]:
    """Among ready nodes, run the one that leaves the least memory allocated
    (ties: the least memory while it runs, then program order)."""
    n = len(g.nodes)
    indeg = [len(g.preds(v)) for v in range(n)]
    ready = {v for v in range(n) if indeg[v] == 0}
    remaining, freeable = _frees(g)
    sizes = [t.size for t in g.tensors]
    out = []
    while ready:
        best, best_key = None, None
        for v in ready:
            node = g.nodes[v]
            grow = sum(sizes[t] for t in node.outputs)
            shrink = sum(sizes[t] for t in node.inputs if freeable[t] and remaining[t] == 1)
            # Dead outputs die at once; they still occupy memory while v runs.
            shrink += sum(sizes[t] for t in node.outputs if freeable[t] and remaining[t] == 0)
            key = (grow - shrink, grow, v)
            if best_key is None or key < best_key:
                best, best_key = v, key
        ready.remove(best)
        out.append(best)
        for t in g.nodes[best].inputs:
            remaining[t] -= 1
        for s in g.succs(best):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.add(s)
    return out


def breadth_first(g: Graph) -> list[int]:
    """Ready nodes in the order their earliest predecessor ran (FIFO)."""
    n = len(g.nodes)
    indeg = [len(g.preds(v)) for v in range(n)]
    queue = [(0, v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(queue)
    out, tick = [], 0
    while queue:
        _, v = heapq.heappop(queue)
        out.append(v)
        tick += 1
        for s in g.succs(v):
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(queue, (tick, s))
    return out


def depth_first(g: Graph) -> list[int]:
    """Finish the most recently enabled chain first (LIFO), which frees
    intermediate tensors early on branchy graphs."""
    n = len(g.nodes)
    indeg = [len(g.preds(v)) for v in range(n)]
    stack = [v for v in reversed(range(n)) if indeg[v] == 0]
    out = []
    while stack:
        v = stack.pop()
        out.append(v)
        enabled = []
        for s in g.succs(v):
            indeg[s] -= 1
            if indeg[s] == 0:
                enabled.append(s)
        stack.extend(sorted(enabled, reverse=True))
    return out


HEURISTICS = {
    "program": lambda g: list(range(len(g.nodes))),
    "least_peak": least_peak_first,
    "bfs": breadth_first,
    "dfs": depth_first,
}


def candidate_orders(g: Graph, deadline: float = math.inf) -> Iterator[tuple[str, list[int]]]:
    """Each heuristic's order that is topological (program order may not be,
    for hand-made graphs), in turn; once ``deadline`` (``time.time()``) has
    passed, no more after the first."""
    found = False
    for name, fn in HEURISTICS.items():
        if found and time.time() >= deadline:
            return
        order = fn(g)
        if g.is_topological(order):
            found = True
            yield name, order


def best_order(g: Graph) -> tuple[str, list[int], int]:
    """The heuristic order with the lowest no-fragmentation peak."""
    best = None
    for name, order in candidate_orders(g):
        peak = order_peak(g, order)
        if best is None or peak < best[2]:
            best = (name, order, peak)
    return best
