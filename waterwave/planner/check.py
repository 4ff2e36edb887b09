"""An independent plan checker.

It recomputes lifetimes itself (it shares no code with the planners) and
checks that the order is a topological order of the graph, every tensor has
its size and an offset inside the arena, no two tensors live at the same time
overlap in memory (except declared in-place pairs that are legal), and the
arena size is exactly the highest byte used.
"""
from __future__ import annotations

import bisect

from ..graph import Graph
from .plan_error import PlanError


def check_plan(g: Graph, plan) -> None:
    """Raise PlanError naming the first problem in ``plan`` (a ``Plan``: order,
    offsets, sizes, arena, in-place pairs); return None when it is valid."""
    pos, made_by = _check_order(g, plan)
    spans, last_use = _spans(g, pos)
    _check_sizes(g, plan, spans)
    partner = _legal_inplace(g, plan, made_by, last_use, pos)
    _check_no_overlap(g, plan, spans, partner)


def _check_order(g: Graph, plan) -> tuple[list[int], dict[int, int]]:
    """The order is a topological order. Returns each node's position, and
    each produced tensor's producer."""
    n = len(g.nodes)
    if sorted(plan.order) != list(range(n)):
        raise PlanError(f"order is not a permutation of the graph's {n} nodes")
    pos = [0] * n
    for i, v in enumerate(plan.order):
        pos[v] = i
    made_by = {t: node.id for node in g.nodes for t in node.outputs}
    for node in g.nodes:
        preds = set(node.deps)
        preds.update(made_by[t] for t in node.inputs if t in made_by)
        for p in preds:
            if p != node.id and pos[p] >= pos[node.id]:
                raise PlanError(f"order runs {g.nodes[node.id].name!r} before its predecessor "
                                f"{g.nodes[p].name!r}")
    return pos, made_by


def _spans(g: Graph, pos: list[int]) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """Lifetimes, recomputed here: (first step, last step) per tensor with
    bytes, and each tensor's last use."""
    n = len(g.nodes)
    produced_at, last_use = {}, {}
    for node in g.nodes:
        for t in node.outputs:
            produced_at[t] = pos[node.id]
        for t in node.inputs:
            last_use[t] = max(last_use.get(t, -1), pos[node.id])
    keep = set(g.meta.get("outputs", []))
    spans = {}
    for t in g.tensors:
        if t.size == 0:
            continue
        if t.persistent:
            spans[t.id] = (0, n - 1)
        else:
            s = produced_at.get(t.id, 0)
            e = n - 1 if t.id in keep else max(last_use.get(t.id, s), s)
            spans[t.id] = (s, e)
    return spans, last_use


def _check_sizes(g: Graph, plan, spans) -> None:
    """Every tensor has its size and an offset; the arena ends at the highest byte used."""
    top = 0
    for tid in spans:
        size = g.tensors[tid].size
        if plan.sizes.get(tid) != size:
            raise PlanError(f"tensor {g.tensors[tid].name!r} has size {size} but the plan says "
                            f"{plan.sizes.get(tid)}")
        off = plan.offsets.get(tid)
        if off is None or off < 0:
            raise PlanError(f"tensor {g.tensors[tid].name!r} has no valid offset")
        top = max(top, off + size)
    if top != plan.arena_size:
        raise PlanError(f"arena size {plan.arena_size} is not exact: the highest byte used is {top}")


def _legal_inplace(g: Graph, plan, made_by, last_use, pos) -> dict[int, set[int]]:
    """Legal in-place pairs: out is made by the node that last uses `inp`,
    and that node allows overwriting `inp`. Returns out -> its inputs."""
    keep = set(g.meta.get("outputs", []))
    partner: dict[int, set[int]] = {}
    for out, inp in plan.inplace:
        p = g.nodes[made_by[out]] if out in made_by else None
        if p is None or inp not in p.inplace_ok or last_use.get(inp) != pos[p.id] or inp in keep:
            raise PlanError(f"in-place pair ({out}, {inp}) is not legal: the producer of "
                            f"{out} must be the last user of {inp} and allow overwriting it")
        if g.tensors[inp].persistent:
            raise PlanError(f"in-place pair ({out}, {inp}) overwrites a persistent tensor")
        partner.setdefault(out, set()).add(inp)
    return partner


def _check_no_overlap(g: Graph, plan, spans, partner) -> None:
    """Sweep time, keeping the live set sorted by offset: tensors live
    together never overlap, except a legal in-place pair."""
    starts: dict[int, list[int]] = {}
    by_end: dict[int, list[int]] = {}
    for tid, (s, e) in spans.items():
        starts.setdefault(s, []).append(tid)
        by_end.setdefault(e, []).append(tid)
    live: list[tuple[int, int, int]] = []  # (offset, end_offset, tid) sorted

    def conflicts(tid, pool):
        # The pool is sorted by start offset; intervals starting at or past
        # our end cannot overlap us.
        a0 = plan.offsets[tid]
        a1 = a0 + g.tensors[tid].size
        for b0, b1, other in pool:
            if b0 >= a1:
                break
            if b1 > a0:
                return other
        return None

    for step in range(len(g.nodes)):
        for tid in starts.get(step, []):
            excused = partner.get(tid, set())
            pool = [x for x in live if x[2] not in excused]
            other = conflicts(tid, pool)
            if other is not None:
                raise PlanError(f"tensors {g.tensors[tid].name!r} and {g.tensors[other].name!r} are "
                                f"live together at step {step} but overlap in memory")
            bisect.insort(live, (plan.offsets[tid], plan.offsets[tid] + g.tensors[tid].size, tid))
        for tid in by_end.get(step, []):
            live.remove((plan.offsets[tid], plan.offsets[tid] + g.tensors[tid].size, tid))
