"""``plan(graph, strategy=...)`` and ``pack(buffers)``: the planner's entry
points, each strategy run and held to the bounds (see the package's
opening for what each strategy does).

May import: waterwave._C, waterwave.graph and this package's modules.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from ..graph import Graph
from .classic import mxnet_plan, paddle_plan
from .cpsat import solve_joint, solve_order
from .cut_bound import CutBounds
from .inplace import inplace_layout, inplace_pairs
from ..graph.lifetimes import lifetimes, order_peak
from .offsets import (
    Buffer,
    best_fit,
    exact_pack,
    greedy_pack,
    max_live,
    validate_buffers,
)
from .orders import candidate_orders
from .plan import Plan, PlanError

STRATEGIES = ("pytorch", "mxnet", "paddle", "greedy", "model")


def _buffers(g: Graph, order: list[int]) -> list[Buffer]:
    return [Buffer(t.id, s, e + 1, t.size)
            for t, (s, e) in zip(g.tensors, lifetimes(g, order))
            if not t.persistent and t.size > 0]


def _assemble(g: Graph, strategy: str, order, arena_offsets: dict[int, int], t0: float,
              status: str, inplace=(), stats=None) -> Plan:
    """Persistent tensors first, then the planned arena."""
    offsets, sizes, cursor = {}, {}, 0
    for t in g.tensors:
        if t.persistent and t.size:
            offsets[t.id] = cursor
            sizes[t.id] = t.size
            cursor += t.size
    for t in g.tensors:
        if not t.persistent and t.size:
            offsets[t.id] = cursor + arena_offsets[t.id]
            sizes[t.id] = t.size
    arena = max((offsets[i] + sizes[i] for i in offsets), default=0)
    return Plan(g.name, strategy, list(order), offsets, sizes, arena, order_peak(g, order, inplace),
                round(time.time() - t0, 4), status, list(inplace), dict(stats or {}))


def default_workers() -> int:
    """CP-SAT workers when the caller names none: WATERWAVE_CPSAT_WORKERS, else
    2. The test suite runs with 1: a single worker searches deterministically,
    and OR-Tools 9.15's rare native aborts come from its parallel search."""
    text = os.environ.get("WATERWAVE_CPSAT_WORKERS", "").strip()
    if not text:
        return 2
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WATERWAVE_CPSAT_WORKERS must be a positive whole number, got {text!r}")
    return int(text)


def _layout(g: Graph, order: list[int]):
    bufs = _buffers(g, order)
    offs, arena, how = greedy_pack(bufs)
    return {b.id: offs[i] for i, b in enumerate(bufs)}, arena, how


def check_time_limit(time_limit: float) -> None:
    """A time limit is a positive, finite number of seconds (a NaN or a
    negative one would be ignored by every deadline test)."""
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)):
        raise TypeError(f"time_limit must be a number of seconds, got {time_limit!r}")
    if not (math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive, finite number of seconds, got "
                         f"{time_limit!r}")


def plan(g: Graph, strategy: str = "greedy", time_limit: float = 10.0, workers: int | None = None,
         gap_limit: float = 1e-3) -> Plan:
    """Plan one training step. ``model`` skips CP-SAT when the greedy order
    is already within ``gap_limit`` (relative) of a proven lower bound, and
    otherwise searches up to ``time_limit`` seconds with ``workers`` CP-SAT
    workers (default: ``WATERWAVE_CPSAT_WORKERS``, else 2); status
    ``optimal`` means the gap is zero."""
    check_time_limit(time_limit)
    workers = default_workers() if workers is None else workers
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if not 0 <= gap_limit < 1:
        raise ValueError(f"gap_limit must be a fraction in [0, 1), got {gap_limit!r} "
                         "(0.001 stops within 0.1% of the proven bound)")
    g.validate()
    t0 = time.time()
    if strategy == "pytorch":
        order = list(range(len(g.nodes)))
        if not g.is_topological(order):
            raise PlanError("program order is not topological in this graph")
        bufs = _buffers(g, order)
        visit = sorted(range(len(bufs)), key=lambda i: (bufs[i].lower, i))
        offs = best_fit(bufs, visit)
        arena_offsets = {b.id: offs[i] for i, b in enumerate(bufs)}
        return _assemble(g, strategy, order, arena_offsets, t0, "heuristic")
    if strategy in ("mxnet", "paddle"):
        order, offsets, arena, inplace = (mxnet_plan if strategy == "mxnet" else paddle_plan)(g)
        sizes = {t.id: t.size for t in g.tensors if t.size}
        return Plan(g.name, strategy, order, offsets, sizes, arena, order_peak(g, order, inplace),
                    round(time.time() - t0, 4), "heuristic", inplace, {})
    # Every phase watches the deadline: the first candidate order and its
    # layout always run (a plan is owed), the rest only while time is left;
    # for model, while a quarter of it is, the rest being the search's.
    deadline = t0 + time_limit
    best = None
    orders_until = deadline if strategy == "greedy" else t0 + 0.25 * time_limit
    for name, order in candidate_orders(g, orders_until):
        arena_offsets, arena, how = _layout(g, order)
        if best is None or arena < best[2]:
            best = (order, arena_offsets, arena, f"{name}+{how}")
    order, arena_offsets, arena, how = best
    if strategy == "greedy":
        p = _assemble(g, strategy, order, arena_offsets, t0, "heuristic", stats={"heuristic": how})
        if time.time() < deadline:
            p = _share_in_place(g, p, t0)
        if time.time() < deadline:
            p = _best_with_inplace(g, p, t0, deadline)
        return p
    bounds = CutBounds(g, deadline)
    p = _model(g, order, arena_offsets, arena, how, time_limit, workers, t0, gap_limit, bounds)
    # Sharing may favour another order than the one without it: the greedy
    # order with sharing is a candidate too, so model never loses to greedy.
    if time.time() < deadline:
        p = _share_in_place(g, p, t0)
    if p.order != order and time.time() < deadline:
        p = _share_in_place(g, p, t0, order)
    p = _best_with_inplace(g, p, t0, deadline)
    return _bound_with_sharing(p, bounds, time_limit, t0)


def _share_in_place(g: Graph, p: Plan, t0: float, order: list[int] | None = None) -> Plan:
    """``p``, or in-place sharing along ``order`` (default: p's own) where
    it lowers the arena: the pairs' storages packed exactly. The proven bound
    assumes no sharing; it is kept as ``bound_without_inplace``."""
    order = p.order if order is None else order
    pairs = inplace_pairs(g, order)
    if not pairs or order_peak(g, order, pairs) >= p.arena_size:
        return p
    packed = inplace_layout(g, order, pairs, time_limit=PACK_SECONDS_WITHIN_GAP)
    if packed is None or packed[1] + g.persistent_bytes() >= p.arena_size:
        return p
    arena_offsets, _, status = packed
    stats = _sharing_stats(p, layout=f"exact pack of the shared storages ({status})")
    return _assemble(g, p.strategy, order, arena_offsets, t0,
                     "heuristic" if p.strategy == "greedy" else "feasible", pairs, stats)


def _bound_seconds(time_limit: float, t0: float) -> float:
    """What each cut bound may spend: a tenth of the plan's time limit, at
    least half a second, and no more than the time left (so a plan ends
    within its limit and a second or so, whatever the graph's size)."""
    return min(max(0.5, 0.1 * time_limit), max(0.1, t0 + time_limit - time.time()))


def _bound_with_sharing(p: Plan, bounds: CutBounds, time_limit: float, t0: float) -> Plan:
    """Records the cut bound with in-place sharing (``inplace_bound``), which
    holds for every order, layout and sharing; a plan that shares storage
    takes it as its proven bound, with its gap and status."""
    bound = bounds.bound(p.order, _bound_seconds(time_limit, t0), inplace=True)
    p.stats["inplace_bound"] = bound
    if p.inplace:
        p.stats["proven_lower_bound"] = bound
        p.stats["gap"] = 0.0 if p.arena_size == 0 else 1 - bound / p.arena_size
        if p.arena_size == bound:
            p.status = "optimal"
    p.solve_seconds = round(time.time() - t0, 4)
    return p


def _sharing_stats(p: Plan, **extra) -> dict:
    """p's statistics for a plan that replaces it by sharing storage in place:
    the arena and proven bound without sharing are kept under their own names
    (a plan with sharing may go below that bound), the gap dropped."""
    stats = dict(p.stats, **extra)
    if not p.inplace:
        stats["arena_without_inplace"] = p.arena_size
    if "proven_lower_bound" in stats:
        stats["bound_without_inplace"] = stats.pop("proven_lower_bound")
    stats.pop("gap", None)
    return stats


def _best_with_inplace(g: Graph, p: Plan, t0: float, deadline: float = math.inf) -> Plan:
    """The order x offset models cannot share an input's memory with an
    operator's output (in-place). When a classic planner that can does
    better, keep its order and sharing, laid out afresh (the classic planners
    put storages back to back): `greedy` and `model` never lose to a
    baseline."""

    for name, fn in (("mxnet", mxnet_plan), ("paddle", paddle_plan)):
        if time.time() >= deadline:
            break
        order, offsets, arena, inplace = fn(g)
        if arena >= p.arena_size:
            continue
        stats = _sharing_stats(p, heuristic=f"{name} (in-place sharing)", beaten_arena=p.arena_size)
        packed = inplace_layout(g, order, inplace, time_limit=PACK_SECONDS_WITHIN_GAP)
        if packed is not None and packed[1] + g.persistent_bytes() <= arena:
            arena_offsets, _, status = packed
            stats["layout"] = f"exact pack of the shared storages ({status})"
            p = _assemble(g, p.strategy, order, arena_offsets, t0, "heuristic", inplace, stats)
        else:
            sizes = {t.id: t.size for t in g.tensors if t.size}
            p = Plan(g.name, p.strategy, order, offsets, sizes, arena,
                     order_peak(g, order, inplace), round(time.time() - t0, 4), "heuristic",
                     inplace, stats)
    return p


# Above this many operators the joint (time x address) model is too large for
# CP-SAT to improve on its warm start in seconds; the ordering model alone
# (cumulative peak), followed by packing, is used instead.
JOINT_MAX_NODES = 300

# Once a plan is within the gap limit, removing its last fragmentation is
# worth only this much more time.
PACK_SECONDS_WITHIN_GAP = 3.0


def _model(g: Graph, order, arena_offsets, arena, how, time_limit, workers, t0,
           gap_limit, bounds: CutBounds) -> Plan:

    persistent = g.persistent_bytes()
    # Bounds for every order (must_live_bound, and the tighter cut bound
    # that starts from it); on training graphs they often prove the best
    # heuristic order optimal at once.
    cut = bounds.bound(order, _bound_seconds(time_limit, t0))
    bound = cut - persistent
    stats = {"warm_start": how, "warm_start_arena": arena + persistent,
             "must_live_bound": bounds.must_live(), "cut_bound": cut}

    def close_enough(value: int) -> bool:
        return value - bound <= gap_limit * value

    ideal = order_peak(g, order) - persistent  # the current order's own bound
    if not close_enough(ideal):
        left = time_limit - (time.time() - t0)
        if len(g.nodes) <= JOINT_MAX_NODES:
            stats["formulation"] = "joint"
            joint = solve_joint(g, order, arena_offsets, time_limit=left * 0.8, workers=workers)
            if joint is not None:
                bound = max(bound, joint.lower_bound)
                if joint.peak <= arena:
                    order, arena_offsets, arena = joint.order, joint.offsets, joint.peak
                    ideal = order_peak(g, order) - persistent
        else:
            stats["formulation"] = "order+pack"
            ordered = solve_order(g, order, time_limit=left * 0.6, workers=workers)
            if ordered is not None:
                bound = max(bound, ordered.lower_bound)
                if ordered.peak < ideal:
                    o_offsets, o_arena, _ = _layout(g, ordered.order)
                    if o_arena < arena:
                        order, arena_offsets, arena = ordered.order, o_offsets, o_arena
                        ideal = order_peak(g, order) - persistent
    # Offsets for the chosen order: exact packing if the layout wastes any
    # (briefly when the plan is already within the gap limit).
    if arena > ideal:
        left = max(0.2, time_limit - (time.time() - t0))
        if close_enough(arena):
            left = min(left, PACK_SECONDS_WITHIN_GAP)
        bufs = _buffers(g, order)
        offs, packed, _, _ = exact_pack(bufs, time_limit=left)
        if packed < arena:
            arena_offsets, arena = {b.id: offs[i] for i, b in enumerate(bufs)}, packed
    bound = min(bound, arena)
    p = _assemble(g, "model", order, arena_offsets, t0,
                  "optimal" if arena == bound else "feasible", stats=stats)
    p.stats["proven_lower_bound"] = bound + persistent
    p.stats["gap"] = 0.0 if p.arena_size == 0 else 1 - (bound + persistent) / p.arena_size
    return p


@dataclass(frozen=True)
class Packing:
    """``pack``'s answer: each buffer's offset by its id, the arena's bytes,
    a proven lower bound on them, and ``optimal`` when the arena meets it
    (else ``feasible``, or ``heuristic`` from the greedy packer)."""
    offsets: dict[int, int]
    arena_size: int
    lower_bound: int
    status: str


def pack(buffers: list[Buffer], time_limit: float = 10.0, exact: bool = True) -> Packing:
    """Offsets for buffers with fixed half-open lifetimes [lower, upper)
    (a ``Packing``)."""
    check_time_limit(time_limit)
    validate_buffers(buffers)
    if exact:
        offs, arena, lb, status = exact_pack(buffers, time_limit=time_limit)
    else:
        offs, arena, _ = greedy_pack(buffers)
        lb, status = max_live(buffers), "heuristic"
        if arena == lb:
            status = "optimal"
    return Packing({b.id: offs[i] for i, b in enumerate(buffers)}, arena, lb, status)
