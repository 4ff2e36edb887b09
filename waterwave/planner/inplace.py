"""In-place sharing along a chosen operator order: an operator that may
overwrite its input (``Node.inplace_ok``) writes its output into that
input's memory when the input dies there. The order x offset models (MODeL)
cannot express this; applied to the order they choose, it removes the one
step where both would be live. The runtime then runs those operators in
place (``waterwave.exec.trainer``), so the plan is what the program does.
"""
from __future__ import annotations

from ..graph import Graph
from ..graph.lifetimes import lifetimes, share_roots
from .offsets import Buffer, exact_pack


def inplace_pairs(g: Graph, order: list[int]) -> list[tuple[int, int]]:
    """(output, input) pairs for ``order``, as the classic planners choose
    them: the input's last use is the operator making the output, it is the
    same size, and it is neither kept nor persistent. A chain of pairs shares
    one storage."""
    keep = set(g.meta.get("outputs", []))
    remaining = [len(g.consumers(t.id)) for t in g.tensors]
    pairs = []
    for v in order:
        node = g.nodes[v]
        if len(node.outputs) == 1:
            out = node.outputs[0]
            for inp in node.inplace_ok:
                t = g.tensors[inp]
                if (remaining[inp] == 1 and inp not in keep and not t.persistent
                        and t.size == g.tensors[out].size and g.tensors[out].size > 0):
                    pairs.append((out, inp))
                    break
        for inp in node.inputs:
            remaining[inp] -= 1
    return pairs


def inplace_layout(g: Graph, order: list[int], inplace, time_limit: float):
    """Offsets for an order whose in-place pairs share storage: each chain of
    pairs is one buffer from its first tensor's birth to its last one's
    death, packed exactly. Returns (arena offsets by tensor, arena, pack
    status), or None if a pair joins tensors of different sizes."""
    root = share_roots(inplace)
    span: dict[int, list[int]] = {}
    for t, (s, e) in zip(g.tensors, lifetimes(g, order)):
        if t.persistent or not t.size:
            continue
        r = root.get(t.id, t.id)
        if g.tensors[r].size != t.size:
            return None
        lo_hi = span.setdefault(r, [s, e])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], s), max(lo_hi[1], e)
    bufs = [Buffer(r, s, e + 1, g.tensors[r].size) for r, (s, e) in span.items()]
    offs, arena, _, status = exact_pack(bufs, time_limit=time_limit)
    at = {b.id: offs[i] for i, b in enumerate(bufs)}
    return {t.id: at[root.get(t.id, t.id)] for t in g.tensors
            if not t.persistent and t.size}, arena, status
