"""Tensor lifetimes under an operator order, and the peak they imply.

A tensor is live from the step its producer runs (step 0 for graph inputs,
the whole step for persistent tensors) through the step of its last user,
inclusive: a node's inputs and outputs coexist while it runs. Tensors nobody
uses die at the step they are made, unless the graph lists them as outputs
(``meta["outputs"]``: kept to the end, like the loss).
"""
from __future__ import annotations

from .graph import Graph


def lifetimes(g: Graph, order: list[int]) -> list[tuple[int, int]]:
    n = len(order)
    pos = [0] * len(g.nodes)
    for i, v in enumerate(order):
        pos[v] = i
    keep = set(g.meta.get("outputs", []))
    out = []
    for t in g.tensors:
        if t.persistent:
            out.append((0, max(n - 1, 0)))
            continue
        p = g.producer(t.id)
        start = 0 if p is None else pos[p]
        users = g.consumers(t.id)
        end = max((pos[c] for c in users), default=start)
        if t.id in keep:
            end = max(n - 1, start)
        out.append((start, end))
    return out


def live_profile(g: Graph, order: list[int], inplace=()) -> list[int]:
    """Bytes live at each step of ``order``. An in-place pair (out, inp)
    shares memory at the step where out is made from inp: counted once."""
    n = max(len(order), 1)
    diff = [0] * (n + 1)
    spans = lifetimes(g, order)
    for t, (s, e) in zip(g.tensors, spans):
        diff[s] += t.size
        diff[e + 1] -= t.size
    for out, inp in inplace:
        s = spans[out][0]
        diff[s] -= g.tensors[inp].size
        diff[s + 1] += g.tensors[inp].size
    prof, acc = [], 0
    for i in range(n):
        acc += diff[i]
        prof.append(acc)
    return prof


def order_peak(g: Graph, order: list[int], inplace=()) -> int:
    """The peak of ``order`` with no fragmentation: its lower bound on any layout."""
    return max(live_profile(g, order, inplace), default=0)


def node_lower_bound(g: Graph) -> int:
    """A bound no order can beat: persistent memory plus, for some node, the
    non-persistent tensors it touches (they coexist while it runs)."""
    persistent = g.persistent_bytes()
    best = 0
    for n in g.nodes:
        ts = set(n.inputs) | set(n.outputs)
        best = max(best, sum(g.tensors[t].size for t in ts if not g.tensors[t].persistent))
    return persistent + best


# The reachability matrices take n^2 bytes each: above this many nodes (256
# MiB a matrix) they are not built, and the bounds that need them fall back
# to what a node's own tensors prove (must_live_bound) or to one node's
# ancestors and descendants at a time (cut_bound.py).
REACHABILITY_MAX_NODES = 16384
# What building the two matrices costs per cell (measured: 16,384 nodes, 5 s
# on this project's CPU): a caller with a deadline builds them only when
# they fit in the time left.
REACHABILITY_SECONDS_PER_CELL = 2e-8


def reachability_affordable(g: Graph, seconds_left: float) -> bool:
    """Whether the reachability matrices of ``g`` may be built: few enough
    nodes, and time for them."""
    n = len(g.nodes)
    return n <= REACHABILITY_MAX_NODES and n * n * REACHABILITY_SECONDS_PER_CELL <= seconds_left


def related(g: Graph, v: int, forward: bool):
    """v and its descendants (``forward``) or its ancestors, as a sorted
    int32 array: one row of ``reachability`` without the matrix."""
    import numpy as np

    seen, stack = {v}, [v]
    step = g.succs if forward else g.preds
    while stack:
        for w in step(stack.pop()):
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return np.array(sorted(seen), dtype=np.int32)


def reachability(g: Graph):
    """Two n x n boolean matrices: ``reach[u, v]`` when v == u or v depends
    on u (a descendant), and its transpose ``ancestors[c, v]`` when v == c
    or c depends on v."""
    import numpy as np

    n = len(g.nodes)
    reach = np.zeros((n, n), dtype=bool)
    for u in reversed(g.topological_order()):
        row = reach[u]
        row[u] = True
        for s in g.succs(u):
            row |= reach[s]
    return reach, np.ascontiguousarray(reach.T)


def must_live_bound(g: Graph, matrices=None) -> int:
    """A bound no order can beat, often tight for training graphs: while a
    node v runs, every tensor made by v or an ancestor of v and used by v or
    a descendant of v is live in *every* topological order (at the loss,
    that is all the activations saved for backward). Persistent memory plus
    the largest such sum over nodes; never below ``node_lower_bound``, which
    it is on graphs of more than ``REACHABILITY_MAX_NODES`` nodes.
    ``matrices``: ``reachability(g)``, when the caller has them already."""
    import numpy as np

    n = len(g.nodes)
    if n == 0:
        return g.persistent_bytes()
    if n > REACHABILITY_MAX_NODES:
        return node_lower_bound(g)
    reach, ancestors = reachability(g) if matrices is None else matrices
    keep = set(g.meta.get("outputs", []))
    live = np.zeros(n, dtype=np.int64)
    for t in g.tensors:
        if t.persistent or t.size == 0:
            continue
        p = g.producer(t.id)
        users = g.consumers(t.id)
        if t.id in keep:
            before_last_use = None  # live to the end of the step
        elif not users:
            if p is None:
                continue
            live[p] += t.size  # made and dropped by one node
            continue
        else:
            before_last_use = np.logical_or.reduce(ancestors[users], axis=0)
        after_made = reach[p] if p is not None else None
        if after_made is None and before_last_use is None:
            live += t.size
        elif after_made is None:
            live[before_last_use] += t.size
        elif before_last_use is None:
            live[after_made] += t.size
        else:
            live[after_made & before_last_use] += t.size
    return max(g.persistent_bytes() + int(live.max()), node_lower_bound(g))


def share_roots(inplace) -> dict[int, int]:
    """For in-place pairs (out, inp) in the order they were made: each
    out's chain root, the first tensor of the chain whose memory it shares."""
    root: dict[int, int] = {}
    for out, inp in inplace:  # inp's root is known by the time out is made
        root[out] = root.get(inp, inp)
    return root


def allocation_events(g: Graph, order: list[int], inplace=()):
    """The allocations and frees one step makes under ``order``, as an eager
    framework makes them: ("alloc", t) for each output when its node runs,
    then ("free", t) for every tensor whose last user just ran (unused
    outputs at once). An in-place pair (out, inp) allocates nothing: out
    takes over inp's memory, reported as ("inplace", out) (``inp`` is then
    never freed itself). Graph outputs, inputs and persistent tensors are not
    allocated or freed here."""
    keep = set(g.meta.get("outputs", []))
    remaining = [len(g.consumers(t.id)) for t in g.tensors]
    into = dict(inplace)  # out -> the input whose memory it takes
    handed_over = set(into.values())
    root = share_roots(inplace)
    for v in order:
        node = g.nodes[v]
        for t in node.outputs:
            if g.tensors[t].size:
                yield ("inplace" if t in into else "alloc"), t
        dead = []
        for t in node.inputs:
            remaining[t] -= 1
            if remaining[t] == 0:
                dead.append(t)
        dead += [t for t in node.outputs if remaining[t] == 0]
        for t in dead:
            tensor = g.tensors[t]
            owner = g.tensors[root.get(t, t)]
            if (tensor.size and t not in keep and not tensor.persistent and owner.kind != "input"
                    and t not in handed_over):
                yield "free", t
