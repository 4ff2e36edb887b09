"""A plan as the allocation sequence a plan allocator serves: slots of
(size, offset) in allocation order, and one arena.

``plan_slots`` takes them from a planned graph; ``plan_from_trace`` packs an
allocation sequence recorded on a GPU (``waterwave.cuda.stop_recording``),
which holds what a graph cannot show (library workspaces).

May import: this package.
"""
from __future__ import annotations

from .graph import Graph
from .lifetimes import allocation_events
from .offsets import Buffer


def plan_slots(graph: Graph, plan) -> tuple[list[tuple[int, int]], int]:
    """The allocation sequence a step makes under ``plan``: the outputs of
    each node in the plan's order (except those written in place into an
    input, which allocate nothing), with their planned offsets (relative to
    the arena of non-persistent tensors, which starts after the persistent
    block)."""
    base = min((plan.offsets[t.id] for t in graph.tensors if not t.persistent and t.size),
               default=0)
    slots = [(graph.tensors[t].size, plan.offsets[t] - base)
             for kind, t in allocation_events(graph, plan.order, plan.inplace) if kind == "alloc"]
    arena = max((o + s for s, o in slots), default=0)
    return slots, arena


def plan_from_trace(trace: list[tuple[int, int, int]], time_limit: float = 5.0
                    ) -> tuple[list[tuple[int, int]], int, dict]:
    """Offsets for a recorded step: the exact packing of its blocks'
    lifetimes (``waterwave.pack``). Returns (slots in allocation order as
    (size, offset), arena bytes, {"bound", "status"})."""
    from . import pack

    end = 1 + max((max(a, f) for _, a, f in trace), default=0)
    buffers = [Buffer(i, a, f if f >= 0 else end, size) for i, (size, a, f) in enumerate(trace)]
    offsets, arena, bound, status = pack(buffers, time_limit=time_limit)
    slots = [(size, offsets[i]) for i, (size, _, _) in enumerate(trace)]
    return slots, arena, {"bound": bound, "status": status}
