"""Exact solving with OR-Tools CP-SAT.

``solve_joint``: the MODeL problem (operator order and offsets together) with
an exact sequential peak. Every node gets a distinct position within its
ASAP/ALAP span (MODeL's span reduction); a tensor is live from its
producer's position to the last of its users' (AddMaxEquality); live tensors
must not overlap in (time x address) (AddNoOverlap2D). Persistent tensors
are constants below the arena. Sizes are divided by their GCD. The search is
warm-started from the best heuristic plan, so it never returns worse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph import Graph
from . import cpsat_child


@dataclass
class Solved:
    """What CP-SAT found: an operator order, the peak bytes of the
    non-persistent tensors in it, the proven lower bound on that peak,
    ``optimal`` or ``feasible``; and, from the joint model, each
    non-persistent tensor's offset."""
    order: list[int]
    peak: int
    lower_bound: int
    status: str
    offsets: dict[int, int] | None = None
from ..graph.lifetimes import lifetimes, live_profile


def _cp():
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # pragma: no cover - a dependency
        raise RuntimeError("the exact planners need OR-Tools: pip install 'ortools>=9.10'") from e
    return cp_model


def _gcd(sizes) -> int:
    g = 0
    for s in sizes:
        g = math.gcd(g, s)
    return g or 1


def spans(g: Graph) -> tuple[list[int], list[int]]:
    """ASAP and ALAP positions of each node in a sequential order of n steps."""
    n = len(g.nodes)
    order = g.topological_order()
    depth = [0] * n
    for v in order:
        for p in g.preds(v):
            depth[v] = max(depth[v], depth[p] + 1)
    height = [0] * n
    for v in reversed(order):
        for s in g.succs(v):
            height[v] = max(height[v], height[s] + 1)
    # In a sequential order, v runs after all its ancestors: count them.
    ancestors = [0] * n
    descendants = [0] * n
    anc_sets: list[int] = [0] * n  # bitsets
    for v in order:
        bits = 0
        for p in g.preds(v):
            bits |= anc_sets[p] | (1 << p)
        anc_sets[v] = bits
        ancestors[v] = bin(bits).count("1")
    desc_sets: list[int] = [0] * n
    for v in reversed(order):
        bits = 0
        for s in g.succs(v):
            bits |= desc_sets[s] | (1 << s)
        desc_sets[v] = bits
        descendants[v] = bin(bits).count("1")
    asap = [max(depth[v], ancestors[v]) for v in range(n)]
    alap = [n - 1 - max(height[v], descendants[v]) for v in range(n)]
    return asap, alap


def _ordering_model(m, g: Graph, hint_order: list[int], tensors):
    """Variables shared by the joint and the ordering models: a distinct
    position per node within its ASAP/ALAP span, precedence, and per tensor a
    time interval from its producer to its last user. Hints come from
    ``hint_order``. Returns (positions, time intervals in ``tensors`` order)."""
    n = len(g.nodes)
    asap, alap = spans(g)
    keep = set(g.meta.get("outputs", []))
    pos = [m.NewIntVar(asap[v], alap[v], f"p{v}") for v in range(n)]
    m.AddAllDifferent(pos)
    for v in range(n):
        for p in g.preds(v):
            m.Add(pos[p] < pos[v])
    hpos = [0] * n
    for i, v in enumerate(hint_order):
        hpos[v] = i
    for v in range(n):
        m.AddHint(pos[v], hpos[v])
    hint_life = lifetimes(g, hint_order)
    intervals = []
    for t in tensors:
        prod = g.producer(t.id)
        users = g.consumers(t.id)
        start = pos[prod] if prod is not None else 0
        if t.id in keep:
            end = n - 1
        elif not users:
            end = start
        elif len(users) == 1:
            end = pos[users[0]]
        else:
            end = m.NewIntVar(max(asap[u] for u in users), n - 1, f"e{t.id}")
            m.AddMaxEquality(end, [pos[u] for u in users])
            m.AddHint(end, hint_life[t.id][1])
        dur = m.NewIntVar(1, n, f"d{t.id}")
        m.Add(dur == end - start + 1)
        m.AddHint(dur, hint_life[t.id][1] - hint_life[t.id][0] + 1)
        intervals.append(m.NewIntervalVar(start, dur, end + 1, f"t{t.id}"))
    return pos, intervals


def solve_joint(g: Graph, hint_order: list[int], hint_offsets: dict[int, int],
                time_limit: float = 10.0, workers: int = 2):
    """A ``Solved`` (``offsets`` by tensor id, of the non-persistent ones;
    ``peak``: the bytes of their arena), or None when nothing was found in
    time."""
    cp_model = _cp()
    tensors = [t for t in g.tensors if not t.persistent and t.size > 0]
    unit = _gcd(t.size for t in tensors)
    hint_arena = max((hint_offsets[t.id] + t.size for t in tensors), default=0)
    m = cp_model.CpModel()
    pos, x_iv = _ordering_model(m, g, hint_order, tensors)
    cap = max(hint_arena // unit, 1)
    peak = m.NewIntVar(0, cap, "peak")
    y_iv, off = [], {}
    for t in tensors:
        s = t.size // unit
        o = m.NewIntVar(0, cap - s, f"o{t.id}")
        m.AddHint(o, hint_offsets[t.id] // unit)
        off[t.id] = o
        y_iv.append(m.NewFixedSizeIntervalVar(o, s, f"a{t.id}"))
        m.Add(o + s <= peak)
    m.AddNoOverlap2D(x_iv, y_iv)
    # Redundant but strong: the live bytes at any time fit under the peak.
    m.AddCumulative(x_iv, [t.size // unit for t in tensors], peak)
    m.AddHint(peak, hint_arena // unit)
    result = _minimize_peak(m, peak, pos, unit, time_limit, workers)
    if result is None:
        return None
    value_of, solved = result
    solved.offsets = {t.id: value_of(off[t.id]) * unit for t in tensors}
    return solved


def solve_order(g: Graph, hint_order: list[int], time_limit: float = 10.0, workers: int = 2):
    """The ordering half of MODeL alone: minimize the exact sequential peak of
    live bytes (AddCumulative) over topological orders, without offsets.
    Much lighter than the joint model; offsets are packed afterwards.
    Returns a ``Solved`` (``peak``: of the non-persistent bytes; no
    offsets), or None when nothing was found in time."""
    cp_model = _cp()
    tensors = [t for t in g.tensors if not t.persistent and t.size > 0]
    unit = _gcd(t.size for t in tensors)
    m = cp_model.CpModel()
    pos, ivs = _ordering_model(m, g, hint_order, tensors)
    demands = [t.size // unit for t in tensors]
    hint_peak = max(live_profile(g, hint_order), default=0) - g.persistent_bytes()
    peak = m.NewIntVar(0, max(hint_peak // unit, 1), "peak")
    m.AddCumulative(ivs, demands, peak)
    m.AddHint(peak, hint_peak // unit)
    result = _minimize_peak(m, peak, pos, unit, time_limit, workers)
    if result is None:
        return None
    return result[1]


def _minimize_peak(m, peak, pos, unit: int, time_limit: float, workers: int):
    """Solve (in the child process, ``cpsat_child.py``); returns (the value
    of a variable, the ``Solved``), or None when no solution was found in
    time or the solver crashed."""
    m.Minimize(peak)
    answer = cpsat_child.solve(m, max(0.05, float(time_limit)), workers)
    if answer is None or answer.status not in ("OPTIMAL", "FEASIBLE"):
        return None

    def value(var) -> int:
        return answer.values[var.Index()]

    order = sorted(range(len(pos)), key=lambda v: value(pos[v]))
    bound = int(math.ceil(answer.bound)) * unit
    return value, Solved(order, value(peak) * unit, bound,
                         "optimal" if answer.status == "OPTIMAL" else "feasible")
