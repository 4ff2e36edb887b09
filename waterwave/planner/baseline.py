"""What PyTorch would reserve for a graph's order: replay its allocations
through the allocator core's ``pytorch`` policy on the simulated device.
``replay_trace`` does the same for an allocation sequence recorded on a GPU
(``waterwave.cuda.stop_recording``), which holds what a graph cannot show:
cuDNN and cuBLAS workspaces, and eager PyTorch's own timing of frees.

Persistent tensors and inputs are allocated first (they exist before the
step); then, node by node, the outputs are allocated and tensors whose last
user ran are freed (unused outputs at once; graph outputs at the end). The
result includes rounding, segment granularity and fragmentation: every
saving is measured against it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _C
from ..alloc import Allocator
from ..graph import Graph
from ..graph.lifetimes import allocation_events, order_peak


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
    return _result(a, order_peak(g, order), policy)


def replay_trace(trace, policy: str = "pytorch", config: str = "",
                 capacity: int = 1 << 50) -> Replay:
    """Replays recorded blocks ``(size, allocated, freed)``, times counted on
    one clock of allocations and frees, ``freed`` -1 for a block never freed,
    through ``policy`` on the simulated device. ``ideal_peak`` is the most
    bytes live at once."""
    events = []
    for i, (size, allocated, freed) in enumerate(trace):
        if size <= 0 or allocated < 0 or (freed >= 0 and freed <= allocated):
            raise ValueError(f"trace entry {i} is not a block (size, allocated, freed) with "
                             f"size > 0 and freed after allocated, or -1: {(size, allocated, freed)}")
        events.append((allocated, 1, i))
        if freed >= 0:
            events.append((freed, 0, i))
    events.sort()
    a = Allocator(policy, _C.SimDevice(capacity, 0.0), config)
    ptr, live, ideal = {}, 0, 0
    for _, is_alloc, i in events:
        size = trace[i][0]
        if is_alloc:
            ptr[i] = a.alloc(size, 0)
            live += size
            ideal = max(ideal, live)
        else:
            a.free(ptr.pop(i))
            live -= size
    return _result(a, ideal, policy)


def _result(a: Allocator, ideal_peak: int, policy: str) -> Replay:
    s = a.stats()
    return Replay(s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"],
                  s["fragmentation.at_peak_reserved"], ideal_peak, policy)
