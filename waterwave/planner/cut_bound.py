"""The cut bound: the least memory any order can have live while a node runs.

Every order runs every node, so the largest such least value over nodes is a
lower bound on the peak of every order (without in-place sharing, as for
``must_live_bound``). It is never below the must-live bound and is often
higher: a backward operator that needs only a forward tensor (GPT-2's GELU
derivative takes ``x ** 2`` of the layer's input) may run before the loss,
but then its own output is live in the input's place. The must-live bound
counts neither; here the cheaper of the two is counted.

For a node v, the nodes that run before v form a down-closed set S holding
v's ancestors and none of its descendants. A tensor other than v's own inputs
and outputs is live while v runs when its producer is in S and one of its
users is not. Minimising that sum over S is a minimum cut (a closure
problem), solved with OR-Tools' max-flow:

- an infinite arc u -> p for every dependency p -> u keeps S down-closed;
- the source holds v and its ancestors, the sink v's descendants;
- a tensor t gets a node a_t, an arc producer -> a_t of capacity size(t) and
  infinite arcs a_t -> user: a_t may join S, leaving the arc uncut, only when
  all of t's users are in S (a tensor with no producer hangs off the source;
  a graph output, live to the end, is an arc producer -> sink).

With in-place sharing (an operator writing its output into an input that
dies there), memory is saved only at that operator's step, and by no more
than the inputs it may overwrite: taking that off each node's least gives a
bound for every order, layout and sharing.
"""
from __future__ import annotations

import math
import time

from ..graph import Graph
from .inplace import inplace_pairs
from ..graph.lifetimes import (
    REACHABILITY_MAX_NODES,
    live_profile,
    must_live_bound,
    node_lower_bound,
    reachability,
    reachability_affordable,
    related,
)


class _CutNetwork:
    """The arcs shared by every node's cut; ``least_live(v)`` adds v's."""

    def __init__(self, g: Graph, matrices=None):
        import numpy as np

        n = len(g.nodes)
        keep = set(g.meta.get("outputs", []))
        tensors = [t for t in g.tensors if not t.persistent and t.size > 0]
        self.source, self.sink = n + len(tensors), n + len(tensors) + 1
        self.infinite = sum(t.size for t in tensors) + 1
        tails, heads, caps = [], [], []

        def arc(tail: int, head: int, cap: int) -> int:
            tails.append(tail), heads.append(head), caps.append(cap)
            return len(caps) - 1

        for v in range(n):
            for p in g.preds(v):
                arc(v, p, self.infinite)
        # Per node: the tensors it makes or uses, live while it runs whatever
        # the order, each with its capacity arc (zeroed for that node's cut).
        self.touching: list[list[tuple[int, int | None]]] = [[] for _ in range(n)]
        self.always = 0  # graph outputs nobody makes: live all step
        for k, t in enumerate(tensors):
            p = g.producer(t.id)
            users = g.consumers(t.id)
            if t.id in keep:
                if p is None:
                    self.always += t.size
                    continue
                cut_arc = arc(p, self.sink, t.size)
            elif users:
                aux = n + k
                cut_arc = arc(self.source if p is None else p, aux, t.size)
                for u in users:
                    arc(aux, u, self.infinite)
            else:
                cut_arc = None  # made and dropped by p: live only while p runs
            for v in set(users) | ({p} if p is not None else set()):
                self.touching[v].append((t.size, cut_arc))
        self.tails = np.asarray(tails, dtype=np.int32)
        self.heads = np.asarray(heads, dtype=np.int32)
        self.caps = np.asarray(caps, dtype=np.int64)
        self.g = g
        # Without the matrices (too many nodes, or no time to build them),
        # each cut finds its node's ancestors and descendants itself.
        self.reach, self.ancestors = matrices if matrices is not None else (None, None)

    def least_live(self, v: int) -> int:
        """The fewest non-persistent bytes live while v runs, over all orders."""
        import numpy as np
        from ortools.graph.python import max_flow

        caps = self.caps.copy()
        touching = 0
        for size, cut_arc in self.touching[v]:
            touching += size
            if cut_arc is not None:
                caps[cut_arc] = 0
        if self.reach is None:  # too many nodes for the matrices
            before, after = related(self.g, v, forward=False), related(self.g, v, forward=True)
        else:
            before = np.flatnonzero(self.ancestors[v]).astype(np.int32)  # v included
            after = np.flatnonzero(self.reach[v]).astype(np.int32)
        after = after[after != v]
        flow = max_flow.SimpleMaxFlow()
        flow.add_arcs_with_capacity(self.tails, self.heads, caps)
        flow.add_arcs_with_capacity(np.full(len(before), self.source, dtype=np.int32), before,
                                    np.full(len(before), self.infinite, dtype=np.int64))
        flow.add_arcs_with_capacity(after, np.full(len(after), self.sink, dtype=np.int32),
                                    np.full(len(after), self.infinite, dtype=np.int64))
        status = flow.solve(self.source, self.sink)
        if status != flow.OPTIMAL:
            raise RuntimeError(f"max-flow for the cut bound failed at node {v} (status {status})")
        return self.always + touching + flow.optimal_flow()


def _most_shared_at(g: Graph, v: int, keep: set[int]) -> int:
    """The most bytes in-place sharing can save at node v's step, under any
    planner's rule (inplace.py, classic.py): each input v may overwrite
    counted once, where it matches an output's size and is neither kept nor
    persistent."""
    sizes = {g.tensors[t].size for t in g.nodes[v].outputs}
    return sum(g.tensors[t].size for t in set(g.nodes[v].inplace_ok)
               if t not in keep and not g.tensors[t].persistent and g.tensors[t].size in sizes
               and g.tensors[t].size > 0)


def least_live(g: Graph, v: int) -> int:
    """The fewest bytes (persistent ones included) that any topological order
    has live while node v runs."""
    matrices = reachability(g) if len(g.nodes) <= REACHABILITY_MAX_NODES else None
    return g.persistent_bytes() + _CutNetwork(g, matrices).least_live(v)


class CutBounds:
    """One graph's bounds, with and without in-place sharing: they share the
    network and the reachability matrices, and each node's least is cut
    once. ``deadline`` (``time.time()``): the matrices and the must-live
    bound are built only when they fit before it (each bound still holds
    without them, weaker: ``node_lower_bound``, one node's relatives at a
    time)."""

    def __init__(self, g: Graph, deadline: float = math.inf):
        self.g = g
        self.deadline = deadline
        self._network: _CutNetwork | None = None
        self._least: dict[int, int] = {}
        self._must_live: int | None = None
        self._matrices = None
        self._matrices_tried = False

    def _reachability(self):
        if not self._matrices_tried:
            self._matrices_tried = True
            if reachability_affordable(self.g, self.deadline - time.time()):
                self._matrices = reachability(self.g)
        return self._matrices

    def must_live(self) -> int:
        if self._must_live is None:
            matrices = self._reachability()
            self._must_live = (node_lower_bound(self.g) if matrices is None
                               else must_live_bound(self.g, matrices))
        return self._must_live

    def _least_live(self, v: int) -> int:
        if v not in self._least:
            if self._network is None:
                self._network = _CutNetwork(self.g, self._reachability())
            self._least[v] = self._network.least_live(v)
        return self._least[v]

    def bound(self, order: list[int] | None = None, time_limit: float = 5.0,
              inplace: bool = False) -> int:
        """A lower bound on every order's peak (persistent bytes included):
        the largest ``least_live`` over nodes, never below ``must_live_bound``.

        With ``inplace``, a bound on every order with in-place sharing too
        (inplace.py): sharing lowers a node's step only, by at most the input
        its output may overwrite, so that is taken off each node's least (the
        must-live bound, which assumes no sharing, is then not a floor).

        Only nodes that could raise the bound are cut: a node's live bytes in
        ``order`` (default: program order; with ``inplace``, sharing along it)
        are at least its least, so nodes are visited from the fullest step of
        ``order`` down and the search stops at the first whose bytes there are
        no more than the bound so far. Past ``time_limit`` seconds it stops
        early; the bound so far still holds."""
        g = self.g
        persistent = g.persistent_bytes()
        best = 0 if inplace else self.must_live() - persistent
        if not g.nodes:
            return persistent + best
        order = g.program_order if order is None else order
        profile = live_profile(g, order, inplace_pairs(g, order) if inplace else ())
        keep = set(g.meta.get("outputs", []))
        deadline = time.monotonic() + time_limit
        for step in sorted(range(len(order)), key=lambda i: -profile[i]):
            if profile[step] - persistent <= best or time.monotonic() > deadline:
                break
            v = order[step]
            least = self._least_live(v)
            if inplace:
                least -= _most_shared_at(g, v, keep)
            best = max(best, least)
        return persistent + best


def cut_bound(g: Graph, order: list[int] | None = None, time_limit: float = 5.0,
              inplace: bool = False) -> int:
    """``CutBounds(g).bound(...)``: see there."""
    return CutBounds(g).bound(order, time_limit, inplace)
