"""What PyTorch would reserve for a graph's order: replay its allocations
through the allocator core's ``pytorch`` policy on the simulated device.

Persistent tensors and inputs are allocated first (they exist before the
step); then, node by node, the outputs are allocated and tensors whose last
user ran are freed (unused outputs at once; graph outputs at the end). The
result includes rounding, segment granularity and fragmentation: every
saving is measured against it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..allocator import Allocator
from ..graph import Graph
from .. import _C
from .lifetimes import allocation_events, order_peak


@dataclass
class Replay:
    peak_reserved: int
    peak_allocated: int
    fragmentation: float  # (reserved - allocated) / reserved at peak reserved
    ideal_peak: int       # the order's peak with no fragmentation
    policy: str


def replay(g: Graph, order: list[int] | None = None, policy: str = "pytorch",
           config: str = "", capacity: int = 1 << 50) -> Replay:
    order = list(range(len(g.nodes))) if order is None else order
    a = Allocator(policy, _C.SimDevice(capacity, 0.0), config)
    ptr = {}
    for t in g.tensors:
        if (t.persistent or t.kind == "input") and t.size:
            ptr[t.id] = a.alloc(t.size, 0)
    for kind, t in allocation_events(g, order):
        if kind == "alloc":
            ptr[t] = a.alloc(g.tensors[t].size, 0)
        else:
            a.free(ptr.pop(t))
    s = a.stats()
    return Replay(s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"],
                  s["fragmentation.at_peak_reserved"], order_peak(g, order), policy)
