"""Slots for a step recorded on a GPU (``waterwave.cuda.stop_recording``):
its allocation sequence packed exactly, which holds what a graph cannot show
(library workspaces).

May import: this package.
"""
from __future__ import annotations

from .offsets import Buffer
from .strategies import pack


def plan_from_trace(trace: list[tuple[int, int, int]], time_limit: float = 5.0
                    ) -> tuple[list[tuple[int, int]], int, dict]:
    """Offsets for a recorded step: the exact packing of its blocks'
    lifetimes (``waterwave.pack``). Returns (slots in allocation order as
    (size, offset), arena bytes, {"bound", "status"})."""
    end = 1 + max((max(a, f) for _, a, f in trace), default=0)
    buffers = [Buffer(i, a, f if f >= 0 else end, size) for i, (size, a, f) in enumerate(trace)]
    packed = pack(buffers, time_limit=time_limit)
    slots = [(size, packed.offsets[i]) for i, (size, _, _) in enumerate(trace)]
    return slots, packed.arena_size, {"bound": packed.lower_bound, "status": packed.status}
