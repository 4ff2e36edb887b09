"""The MODeL ILP exactly as the paper writes it (equations 1-9), solved by
HiGHS: a cross-check of the CP-SAT formulation on small graphs.

Binary C[e,s] (tensor e created at step s) and P[e,s] (preserved at s) for
every tensor and step; an address A[e]; for every pair of tensors binaries
a, b that order them in memory when they are live together (6, 7a, 7b);
peak >= A + S (8). No span reduction is applied: this is the formulation as
written, for graphs of a dozen nodes. Graph inputs are preserved at step 0
without being created; graph outputs are preserved to the last step;
persistent tensors are constants below the arena. Nodes without outputs are
invisible to this formulation, so graphs with such nodes are rejected.

OR-Tools bundles its own HiGHS, whose symbols clash with highspy's in one
process, so the solve runs in a child process (``python -m
waterwave.planner.ilp``) that reads the graph as JSON on stdin.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from ..graph import Graph


def solve_paper_ilp(g: Graph, time_limit: float = 60.0):
    """Returns (order, offsets of non-persistent tensors, arena of the
    non-persistent tensors, status), or None when no solution was found."""
    if any(not n.outputs for n in g.nodes):
        raise ValueError("the paper's ILP cannot express nodes without outputs (in-place writes)")
    if any(n.deps for n in g.nodes):
        raise ValueError("the paper's ILP has no control edges; use a graph without deps")
    r = subprocess.run([sys.executable, "-m", "waterwave.planner.ilp", str(time_limit)],
                       input=json.dumps(g.to_dict()), capture_output=True, text=True,
                       timeout=time_limit + 60)
    if r.returncode != 0:
        # The head of stderr holds the error (or a fatal error's stack).
        raise RuntimeError(f"the HiGHS ILP solve failed (exit {r.returncode}): "
                           f"{r.stderr.strip()[:3000]}")
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"the HiGHS ILP solve answered no JSON on stdout: "
                           f"{r.stdout.strip()[:3000]!r}") from None
    if out is None:
        return None
    return out["order"], {int(k): v for k, v in out["offsets"].items()}, out["arena"], out["status"]


def _solve_here(g: Graph, time_limit: float):
    import highspy

    n = len(g.nodes)
    steps = range(n + 1)  # step 0 holds the graph inputs
    keep = set(g.meta.get("outputs", []))
    E = [t for t in g.tensors if not t.persistent and t.size > 0]
    gcd = 0
    for t in E:
        gcd = math.gcd(gcd, t.size)
    gcd = gcd or 1
    S = {t.id: t.size // gcd for t in E}
    M = sum(S.values())
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    C = {(e, s): h.addBinary() for e in S for s in steps}
    P = {(e, s): h.addBinary() for e in S for s in steps}
    A = {e: h.addIntegral(lb=0, ub=M) for e in S}
    peak = h.addVariable(lb=0, ub=M)
    producer = {t: g.producer(t) for t in S}
    fanin = {t: [f for f in g.nodes[producer[t]].inputs if f in S] if producer[t] is not None else []
             for t in S}
    for e in S:
        for s in steps:
            h.addConstr(C[e, s] + P[e, s] <= 1)                                   # (1)
            if s > 0:
                h.addConstr(P[e, s] <= P[e, s - 1] + C[e, s - 1])                 # (2)
            for f in fanin[e]:
                h.addConstr(C[e, s] <= P[f, s])                                   # (4)
            if producer[e] is not None:
                for f in g.nodes[producer[e]].outputs:
                    if f in S and f != e:
                        h.addConstr(C[f, s] == C[e, s])                           # (5)
        if producer[e] is None:  # a graph input: there at step 0, never created
            h.addConstr(P[e, 0] == 1)
            for s in steps:
                h.addConstr(C[e, s] == 0)
        else:
            h.addConstr(sum(C[e, s] for s in steps) == 1)                         # (3)
            h.addConstr(C[e, 0] == 0)
            h.addConstr(P[e, 0] == 0)
        if e in keep:
            h.addConstr(P[e, n] + C[e, n] >= 1)
        # Users must find the tensor in memory when they run; (4) covers
        # users that create tensors, which is every node here.
        h.addConstr(A[e] + S[e] <= peak)                                          # (8)
    ids = sorted(S)
    for i, ei in enumerate(ids):
        for ej in ids[i + 1:]:
            a = h.addBinary()
            b = h.addBinary()
            h.addConstr(a + b <= 1)                                               # (6)
            for s in steps:
                h.addConstr(a + b >= C[ei, s] + P[ei, s] + C[ej, s] + P[ej, s] - 1)
            h.addConstr(A[ei] + S[ei] - A[ej] <= (1 - a) * M)                     # (7a)
            h.addConstr(A[ei] - A[ej] - S[ej] >= (b - 1) * M)                     # (7b)
    h.minimize(peak)                                                              # (9)
    status = h.getModelStatus()
    # Read values only when HiGHS holds a feasible solution: after a time
    # limit without one, reading them is undefined (it crashed the process).
    if h.getInfo().primal_solution_status != int(highspy.SolutionStatus.kSolutionStatusFeasible):
        return None
    values = list(h.getSolution().col_value)

    def val(var):
        return values[var.index]

    created = {}
    for e in S:
        for s in steps:
            if val(C[e, s]) > 0.5:
                created[e] = s
    # Function 1 of the paper: the sequence of sources in creation order.
    when = {}
    for e, s in created.items():
        v = producer[e]
        when[v] = min(when.get(v, s), s)
    order = sorted(range(n), key=lambda v: (when.get(v, n + 1), v))
    offsets = {e: int(round(val(A[e]))) * gcd for e in S}
    arena = max((offsets[e] + S[e] * gcd for e in S), default=0)
    return order, offsets, arena, "optimal" if status == highspy.HighsModelStatus.kOptimal else "feasible"


def _main() -> None:
    graph = Graph.from_dict(json.load(sys.stdin))
    # The answer alone goes to stdout: whatever the solver library prints
    # (highspy 1.16 prints its banner before any option can silence it)
    # goes to stderr, at the descriptor, where C's printf writes too.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    res = _solve_here(graph, float(sys.argv[1]))
    if res is None:
        answer.write("null\n")
    else:
        order, offsets, arena, status = res
        answer.write(json.dumps({"order": order, "offsets": offsets, "arena": arena,
                                 "status": status}) + "\n")
    answer.close()


if __name__ == "__main__":
    _main()
