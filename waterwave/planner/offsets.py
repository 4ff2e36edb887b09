"""Offsets for tensors with fixed lifetimes (dynamic storage allocation).

Greedy best fit in two visiting orders, as TFLite and XLA do:
``by size`` (largest first, the spatial order) and ``by time`` (earliest
first, the temporal order). Each tensor goes into the smallest gap between
already placed, time-overlapping tensors that fits it, else on top.
``greedy_pack`` keeps the better of them, and ``exact_pack`` improves on it
with a complete search (csrc/planner/offset_search.h): first at the max-live
bound, where any layout found is optimal, then, if the bound is proven out of
reach, by bisection between the proven bound and the best layout found.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .. import _C

# Sizes, offsets and steps are 64-bit signed in the search (csrc/planner):
# a buffer of more than 2^62 bytes (4 EiB) is refused, so sums of two fit.
MAX_VALUE = 1 << 62
MAX_SECONDS = 1e9  # "no limit", as a finite number the C++ clock can add


@dataclass(frozen=True)
class Buffer:
    """A buffer live on the half-open step range [lower, upper)."""
    id: int | str
    lower: int
    upper: int
    size: int


def max_live(buffers: list[Buffer]) -> int:
    """The most bytes live at once: no layout can use less."""
    events = []
    for b in buffers:
        events.append((b.lower, b.size))
        events.append((b.upper, -b.size))
    events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at a step
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def best_fit(buffers: list[Buffer], visit: list[int], seconds: float = math.inf) -> dict[int, int]:
    """Place buffers (indices into ``buffers``) in the visiting order given,
    each in the smallest gap between placed buffers overlapping it in time
    (csrc/planner/best_fit.h). Past ``seconds``, the rest are stacked on top:
    still a valid layout, so a time limit holds on any input size."""
    return _best_fit(buffers, visit, seconds)[0]


def _best_fit(buffers: list[Buffer], visit: list[int], seconds: float) -> tuple[dict[int, int], int]:
    offsets, arena, _ = _C.best_fit([b.lower for b in buffers], [b.upper for b in buffers],
                                    [b.size for b in buffers], visit, min(seconds, MAX_SECONDS))
    return dict(enumerate(offsets)), arena


def greedy_pack(buffers: list[Buffer], seconds: float = math.inf) -> tuple[dict[int, int], int, str]:
    """The best of best fit by size, by time and by length: (offsets by
    index, arena, order name). The first order always runs (cut short past
    ``seconds``); the others only while time is left."""
    deadline = time.monotonic() + min(seconds, MAX_SECONDS)
    orders = {
        "by_size": lambda: sorted(range(len(buffers)),
                                  key=lambda i: (-buffers[i].size, -(buffers[i].upper - buffers[i].lower),
                                                 buffers[i].lower)),
        "by_time": lambda: sorted(range(len(buffers)), key=lambda i: (buffers[i].lower, -buffers[i].size)),
        "by_length": lambda: sorted(range(len(buffers)),
                                    key=lambda i: (-(buffers[i].upper - buffers[i].lower), -buffers[i].size)),
    }
    best = None
    for name, visit in orders.items():
        left = deadline - time.monotonic()
        if best is not None and left <= 0:
            break
        offs, arena = _best_fit(buffers, visit(), left)
        if best is None or arena < best[1]:
            best = (offs, arena, name)
    return best


def validate_buffers(buffers: list[Buffer]) -> None:
    seen = set()
    for b in buffers:
        if b.id in seen:
            raise ValueError(f"buffer id {b.id!r} appears twice")
        seen.add(b.id)
        if b.size < 0:
            raise ValueError(f"buffer {b.id!r} has a negative size ({b.size})")
        if max(b.size, abs(b.lower), abs(b.upper)) > MAX_VALUE:
            raise ValueError(f"buffer {b.id!r}: size, lower and upper must be within 2^62 "
                             f"(got {b.size}, {b.lower}, {b.upper})")
        if b.upper <= b.lower:
            raise ValueError(f"buffer {b.id!r} has an empty lifetime [{b.lower}, {b.upper}): "
                             "upper must be greater than lower (ranges are half-open)")


def exact_pack(buffers: list[Buffer], time_limit: float = 10.0):
    """Offsets minimizing the arena: (offsets by index, arena, proven lower
    bound, status) with status ``optimal`` when arena == bound, else
    ``heuristic`` (the best layout found in time)."""

    deadline = time.monotonic() + time_limit
    offs, arena, _ = greedy_pack(buffers, time_limit)
    bound = max_live(buffers)
    if arena == bound:
        return offs, arena, bound, "optimal"
    live = [i for i, b in enumerate(buffers) if b.size > 0]
    unit = 0
    for i in live:
        unit = math.gcd(unit, buffers[i].size)
    lower = [buffers[i].lower for i in live]
    upper = [buffers[i].upper for i in live]
    size = [buffers[i].size // unit for i in live]
    lo, hi = bound // unit, arena // unit  # the answer lies in [lo, hi]
    capacity = lo  # zero slack first: most instances reach the bound
    while lo < hi:
        left = deadline - time.monotonic()
        if left <= 0.01:
            break
        # The bound first, with most of the time (a layout there is usually
        # found, if not at once then after a long search: zero-slack
        # tilings); then half the time left to each question, so a hard one
        # cannot starve the roomier capacities after it.
        share = 0.6 if capacity * unit == bound else 0.5
        status, found, _ = _C.search_offsets(lower, upper, size, capacity, left * share)
        if status == "found":
            hi = capacity
            offs = {i: 0 for i, b in enumerate(buffers) if b.size == 0}
            offs.update({i: o * unit for i, o in zip(live, found)})
        elif status == "infeasible":
            lo = capacity + 1
        else:  # unsettled: try a roomier capacity, keeping the proven bound;
            # well towards the best layout found, where a layout comes easier
            if capacity + 1 >= hi:
                break
            capacity += max(1, (hi - capacity) * 3 // 4)
            continue
        capacity = (lo + hi) // 2
    return offs, hi * unit, lo * unit, "optimal" if lo == hi else "heuristic"
