"""CP-SAT solves in a child process, so that a native crash in OR-Tools
costs one solve, not the caller's process.

OR-Tools 9.15 (the newest release) aborts now and then inside a CP-SAT
solve (or-tools#5025, fixed on its main branch only); it took the test
suite's whole process down twice, once with a single worker. A planner that
can kill the training script calling it loses everything, so every solve
runs here: one child per process, started at the first solve and kept for
the next (importing OR-Tools costs about half a second). A solve whose
child dies returns None, which the planner treats as "no solution in time"
(it keeps its warm start); the next solve starts a fresh child. Where no
interpreter can be started (embedded Python), the solve runs in process.

Requests and answers are pickles behind an 8-byte length on the child's
stdin and stdout. The model travels in protobuf text format, which the
OR-Tools 9.15 Python proto wrapper writes (``str``) and reads
(``parse_text_format``).

May import: nothing of waterwave (the child runs this file as a script).
"""
from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass

_HEADER = struct.Struct("<Q")


@dataclass
class Answer:
    status: str        # "OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN", ...
    values: list[int]  # every variable's value, by proto index (empty without a solution)
    bound: float       # the best objective bound proven


class _Child:
    """The solver process, and the lock that keeps one request in flight."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.crashes = 0

    def solve(self, text: str, time_limit: float, workers: int) -> Answer | None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                try:
                    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                except OSError:  # no interpreter to start (embedded Python): solve here
                    self.proc = None
                    return Answer(*_solve_text(text, time_limit, workers))
            try:
                _send(self.proc.stdin, (text, time_limit, workers))
                status, values, bound = _receive(self.proc.stdout)
            except (OSError, EOFError):  # the child died: OR-Tools crashed
                self.crashes += 1
                self._reap()
                return None
            return Answer(status, values, bound)

    def _reap(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """At exit: the child ends when its input closes."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_child = _Child()
atexit.register(_child.close)


def solve(model, time_limit: float, workers: int) -> Answer | None:
    """Solve a ``cp_model.CpModel`` in the child; None if the solver crashed."""
    return _child.solve(str(model.Proto()), time_limit, workers)


def crashes() -> int:
    """How many solves in this process lost their child to a crash."""
    return _child.crashes


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the CP-SAT child closed its output")
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the CP-SAT child closed its output mid-answer")
    return pickle.loads(data)


def _solve_text(text: str, time_limit: float, workers: int) -> tuple[str, list[int], float]:
    """One solve of a model in text format: (status, values, bound)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    model.Proto().parse_text_format(text)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    # No relative_gap_limit: the callers check the gap against their own
    # bound before they solve at all.
    status = solver.Solve(model)
    response = solver.ResponseProto()
    return status.name, list(response.solution), float(response.best_objective_bound)


def _serve() -> None:
    """The child: answer requests until the parent closes stdin."""
    # Answers alone on stdout: anything the solver prints goes to stderr.
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            request = _receive(requests)
        except EOFError:
            return
        _send(answers, _solve_text(*request))


if __name__ == "__main__":
    _serve()
