"""CP-SAT in a child process (waterwave/planner/cpsat_child.py): answers as
OR-Tools gives them in process, and a solver that crashes costs one solve,
never the caller's process."""
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from planner_graphs import random_graphs

cp_model = pytest.importorskip("ortools.sat.python.cp_model")

from test_planner import chain  # noqa: E402

from waterwave.planner import check_plan, cpsat_child, plan  # noqa: E402
from waterwave.planner.cpsat import solve_order  # noqa: E402

# What OR-Tools 9.15 did to the suite's process: a native abort mid-solve.
ABORTS_ON_ITS_FIRST_REQUEST = "import os, sys; sys.stdin.buffer.read(8); os.abort()"


def tiny_model():
    m = cp_model.CpModel()
    x, y = m.NewIntVar(0, 10, "x"), m.NewIntVar(0, 10, "y")
    m.Add(x + y >= 7)
    m.Add(x >= 3)
    m.Minimize(2 * x + y)
    return m, x, y


def test_the_child_answers_as_cp_sat_does_in_process():
    m, x, y = tiny_model()
    answer = cpsat_child.solve(m, 5.0, 2)
    solver = cp_model.CpSolver()
    assert solver.Solve(m) == cp_model.OPTIMAL
    assert answer.status == "OPTIMAL" and answer.bound == solver.BestObjectiveBound() == 10
    assert answer.values[x.Index()] == solver.Value(x) == 3
    assert answer.values[y.Index()] == solver.Value(y) == 4


def install_crashing_child():
    """The next solve meets a child that aborts, as OR-Tools' did."""
    child = cpsat_child._child
    with child.lock:
        child._reap()
        child.proc = subprocess.Popen([sys.executable, "-c", ABORTS_ON_ITS_FIRST_REQUEST],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
    return child


@pytest.fixture
def crashing_child():
    return install_crashing_child()


def test_a_crashed_solve_is_no_answer_and_the_next_starts_a_fresh_child(crashing_child):
    before = cpsat_child.crashes()
    m, x, _ = tiny_model()
    assert cpsat_child.solve(m, 5.0, 2) is None
    assert cpsat_child.crashes() == before + 1
    answer = cpsat_child.solve(m, 5.0, 2)
    assert answer.status == "OPTIMAL" and answer.values[x.Index()] == 3


def test_a_crashed_solve_gives_the_order_search_no_solution(crashing_child):
    g = chain()
    hint = g.topological_order()
    before = cpsat_child.crashes()
    assert solve_order(g, hint, time_limit=5.0) is None  # the crash: no solution
    assert cpsat_child.crashes() == before + 1


def test_the_model_planner_survives_crashes_on_random_graphs():
    """Each plan's first solve crashes: every plan still passes the checker
    and is never worse than its greedy warm start."""
    crashed = []

    @given(random_graphs())
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def run(g):
        install_crashing_child()
        before = cpsat_child.crashes()
        p = plan(g, "model", time_limit=2.0)
        check_plan(g, p)
        assert p.arena_size <= plan(g, "greedy").arena_size
        crashed.append(cpsat_child.crashes() - before)

    run()
    assert sum(crashed) > 0, "no plan called the solver: the test proves nothing"


def test_without_an_interpreter_to_start_the_solve_runs_in_process(monkeypatch):
    """Embedded Python (no interpreter on disk): the solve still answers."""
    child = cpsat_child._child
    with child.lock:
        child._reap()
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    m, x, y = tiny_model()
    answer = cpsat_child.solve(m, 5.0, 1)
    assert answer.status == "OPTIMAL" and answer.values[x.Index()] == 3
    assert child.proc is None
