"""A search for offsets that fit a given capacity, on a skyline (in the
spirit of MiniMalloc, Moffitt ASPLOS'23, but not complete).

Buffers are placed bottom-up, so each time section has a floor. At the
lowest, then leftmost, section the search tries each buffer that covers it
and fits within that flat stretch, or gives the stretch up to the lower
neighbour's level. It prunes a node as soon as a section's floor (raised to
where any remaining buffer covering it could start) plus the unplaced bytes
live there exceed the capacity. Identical buffers are tried once.

Giving up a whole stretch at once is the classic skyline restriction: it can
miss packings, so ``None`` proves nothing. A layout it finds is valid, and
one found at the max-live bound is optimal; ``exact_pack`` uses it that way,
before CP-SAT.
"""
from __future__ import annotations

import sys

from .offsets import Buffer


class _Limit(Exception):
    pass


def skyline_pack(buffers: list[Buffer], capacity: int, node_limit: int = 200_000,
                 seconds: float | None = None):
    """Offsets (by index) that fit in ``capacity``, or None when the search
    found none (which does not prove that none exist); raises TimeoutError
    when ``node_limit`` search nodes (or ``seconds``) ran out first."""
    import time

    deadline = None if seconds is None else time.monotonic() + seconds
    live = [i for i, b in enumerate(buffers) if b.size > 0]
    offsets = {i: 0 for i, b in enumerate(buffers) if b.size == 0}
    if not live:
        return offsets
    cuts = sorted({b.lower for b in buffers} | {b.upper for b in buffers})
    index = {c: k for k, c in enumerate(cuts)}
    S = len(cuts) - 1
    span = {i: (index[buffers[i].lower], index[buffers[i].upper]) for i in live}
    floor = [0] * S
    remaining = [0] * S
    covering: list[list[int]] = [[] for _ in range(S)]
    for i in live:
        a, b = span[i]
        for s in range(a, b):
            remaining[s] += buffers[i].size
            covering[s].append(i)
    if any(r > capacity for r in remaining):
        return None
    # Larger, longer buffers first among the candidates at a point.
    for s in range(S):
        covering[s].sort(key=lambda i: (-buffers[i].size, span[i][0] - span[i][1]))
    placed = set()
    nodes = [0]

    def feasible(a, b):
        if any(floor[s] + remaining[s] > capacity for s in range(a, b)):
            return False
        # Unallocated floor: a section's space below the lowest height at
        # which any remaining buffer covering it can start is wasted.
        lowest = [capacity] * S
        for i in live:
            if i in placed:
                continue
            x, y = span[i]
            start = max(floor[x:y])
            for s in range(x, y):
                if start < lowest[s]:
                    lowest[s] = start
        for s in range(S):
            if remaining[s] and max(floor[s], lowest[s]) + remaining[s] > capacity:
                return False
        return True

    def dfs():
        nodes[0] += 1
        if nodes[0] > node_limit or (deadline is not None and nodes[0] % 64 == 0
                                     and time.monotonic() > deadline):
            raise _Limit
        best = None
        for s in range(S):
            if remaining[s] and (best is None or floor[s] < floor[best]):
                best = s
        if best is None:
            return True
        level = floor[best]
        lo = best
        while lo > 0 and floor[lo - 1] == level:
            lo -= 1
        hi = best + 1
        while hi < S and floor[hi] == level:
            hi += 1
        tried = set()
        for i in covering[best]:
            if i in placed:
                continue
            a, b = span[i]
            if a < lo or b > hi or level + buffers[i].size > capacity:
                continue
            # Identical buffers are interchangeable: try one of each kind.
            kind = (a, b, buffers[i].size)
            if kind in tried:
                continue
            tried.add(kind)
            size = buffers[i].size
            placed.add(i)
            offsets[i] = level
            for s in range(a, b):
                floor[s] = level + size
                remaining[s] -= size
            if feasible(a, b) and dfs():
                return True
            for s in range(a, b):
                floor[s] = level
                remaining[s] += size
            placed.discard(i)
            del offsets[i]
        # Waste: raise the flat stretch to its lower neighbour (or the top).
        if lo > 0 and hi < S:
            up = min(floor[lo - 1], floor[hi])
        elif lo > 0:
            up = floor[lo - 1]
        elif hi < S:
            up = floor[hi]
        else:
            up = capacity
        if up <= level:
            up = capacity
        saved = floor[lo:hi]
        for s in range(lo, hi):
            floor[s] = up
        if feasible(lo, hi) and dfs():
            return True
        floor[lo:hi] = saved
        return False

    # The search recurses once per placed buffer.
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 4 * len(live) + 200))
    try:
        found = dfs()
    except _Limit:
        raise TimeoutError(f"no answer within {nodes[0]} search nodes") from None
    finally:
        sys.setrecursionlimit(old_limit)
    return offsets if found else None
