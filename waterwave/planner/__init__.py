"""Offline memory planning (the MODeL paper) and its baselines.

``plan(graph, strategy=..., time_limit=...)`` returns a ``Plan`` (operator
order plus the offset of every tensor). Strategies:

- ``pytorch``: program order, tensors placed online in allocation order (the baseline);
- ``mxnet``: reference-count simulation with in-place reuse and size-matched sharing;
- ``paddle``: liveness analysis with in-place reuse and a reuse pool;
- ``greedy``: the best of several memory-aware orders, each with best-fit
  offsets in spatial and temporal visiting orders;
- ``model``: the MODeL problem solved with CP-SAT (exact sequential peak),
  warm-started from ``greedy``, then exact offsets for the order found; it
  reports a proven lower bound (the larger of CP-SAT's and the cut bound,
  cut_bound.py) and the gap, and stops once the gap is small enough.

``greedy`` and ``model`` then share an input's memory with an operator's
output along their order where that lowers the arena (inplace.py), and take
a classic planner's plan where that is smaller still. A ``model`` plan that
shares is held to the cut bound with sharing (``stats["inplace_bound"]``,
recorded for every ``model`` plan).

``pack(buffers)`` solves offsets alone for fixed lifetimes (a ``Packing``).

This file is the package's face. ``strategies.py`` holds ``plan`` and
``pack``; the baseline every saving is measured against is ``baseline.py``
(a replay through the allocator's ``pytorch`` policy); a plan as the
allocation sequence a plan allocator serves is ``slots.py``, and a recorded
GPU step packed into one is ``trace_plan.py``. The graph it plans is
``waterwave.graph``, made by ``waterwave.capturing``.

May import: waterwave._C, waterwave.graph, waterwave.alloc (the baseline's
replays) and this package; torch lazily.
"""
from .check import check_plan  # noqa: F401
from ..graph.lifetimes import lifetimes, order_peak  # noqa: F401
from .offsets import Buffer  # noqa: F401
from .plan import Plan, PlanError  # noqa: F401
from .slots import plan_slots  # noqa: F401
from .strategies import STRATEGIES, Packing, default_workers, pack, plan  # noqa: F401
from .trace_plan import plan_from_trace  # noqa: F401

__all__ = [
    "STRATEGIES",
    "Buffer",
    "Plan",
    "PlanError",
    "check_plan",
    "lifetimes",
    "order_peak",
    "pack",
    "plan",
    "plan_from_trace",
    "plan_slots",
]
