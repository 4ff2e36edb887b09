"""A captured step's phases: each operator is ``forward`` (up to the loss),
``backward``, or ``optimizer`` (from the first in-place update of a
parameter or optimizer state). Schedules cut steps at these boundaries.

May import: waterwave.graph.
"""
from __future__ import annotations

from ..graph import Graph


def phases(g: Graph) -> list[str]:
    """Each node's phase: forward, backward or optimizer."""
    outputs = g.meta.get("outputs", [])
    producers = [g.producer(t) for t in outputs if g.producer(t) is not None]
    end_forward = min(producers) if producers else len(g.nodes) - 1
    updated = {t.id for t in g.tensors if t.kind in ("param", "optimizer_state")}
    start_update = next((n.id for n in g.nodes if set(n.mutates) & updated), len(g.nodes))
    return ["forward" if v <= end_forward else "optimizer" if v >= start_update else "backward"
            for v in range(len(g.nodes))]
