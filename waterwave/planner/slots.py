"""A plan as the allocation sequence a plan allocator serves: slots of
(size, offset) in allocation order, and one arena, taken from a planned
graph (``trace_plan.py`` makes them from a step recorded on a GPU).

May import: waterwave.graph, this package.
"""
from __future__ import annotations

from ..graph import Graph
from .check import check_plan
from ..graph.lifetimes import allocation_events


def plan_slots(graph: Graph, plan) -> tuple[list[tuple[int, int]], int]:
    """The allocation sequence a step makes under ``plan``: the outputs of
    each node in the plan's order (except those written in place into an
    input, which allocate nothing), with their planned offsets (relative to
    the arena of non-persistent tensors, which starts after the persistent
    block). A plan the checker rejects (a file edited, or made for another
    graph) is refused with its PlanError, never renormalised into slots."""
    check_plan(graph, plan)
    base = min((plan.offsets[t.id] for t in graph.tensors if not t.persistent and t.size),
               default=0)
    # An empty tensor never reaches the allocator (an allocation of 0 bytes
    # returns at once and takes no slot), so it has no slot here either:
    # slot k is the k-th allocation the step makes.
    slots = [(graph.tensors[t].size, plan.offsets[t] - base)
             for kind, t in allocation_events(graph, plan.order, plan.inplace)
             if kind == "alloc" and graph.tensors[t].size]
    arena = max((o + s for s, o in slots), default=0)
    return slots, arena
