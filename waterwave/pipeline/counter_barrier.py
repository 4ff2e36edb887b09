"""The CounterBarrier (Waterwave paper, section 4.3, Figure 6): rounds of
node groups run in order, whichever jobs take part.

Each round has a count of the node groups in it that have not finished. A
job that reaches a group of round r waits until every group of the rounds
before r has finished, then runs it and counts it off. Jobs join (``plan``
a job's rounds) and leave (``leave``: its unfinished groups are counted off
at once) between or during steps, so a job that fails or goes never leaves
the others waiting: the barrier cannot deadlock on it.

A Python condition variable, held only to count and to wait: jobs in the
same round run at the same time. The lowest unfinished round comes from a
heap, so a wait costs O(log rounds) however many steps were planned (a scan
of every planned round made long runs quadratic).

May import: nothing of waterwave.
"""
from __future__ import annotations

import heapq
import threading
from collections import Counter


class BarrierAborted(RuntimeError):
    """The barrier was shut down while a job waited at it."""


class CounterBarrier:
    def __init__(self):
        self._cond = threading.Condition()
        self._left: Counter = Counter()  # round -> groups not yet finished
        self._mine: dict[object, Counter] = {}  # job -> its unfinished groups, by round
        self._rounds: list[int] = []  # a heap of rounds; finished ones are popped lazily
        self._closed = False

    def plan(self, job, rounds: list[int]) -> None:
        """``job`` will run one group in each of ``rounds`` (repeats allowed)."""
        with self._cond:
            mine = self._mine.setdefault(job, Counter())
            for r in rounds:
                if not self._left[r]:
                    heapq.heappush(self._rounds, r)
                self._left[r] += 1
                mine[r] += 1

    def wait(self, job, round_: int) -> None:
        """Block until every group of the rounds before ``round_`` finished."""
        with self._cond:
            while not self._closed and self._lowest() < round_:
                self._cond.wait()
            if self._closed:
                raise BarrierAborted("the concurrent trainer stopped")

    def done(self, job, round_: int) -> None:
        """``job`` finished its group in ``round_``."""
        with self._cond:
            self._count_off(job, round_, 1)
            self._cond.notify_all()

    def leave(self, job) -> None:
        """``job`` runs none of its remaining groups: count them all off."""
        with self._cond:
            for r, n in list(self._mine.get(job, {}).items()):
                self._count_off(job, r, n)
            self._mine.pop(job, None)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> dict[int, int]:
        with self._cond:
            return {r: n for r, n in self._left.items() if n > 0}

    def _lowest(self) -> float:
        """The lowest round with an unfinished group (infinity if none)."""
        while self._rounds and self._rounds[0] not in self._left:
            heapq.heappop(self._rounds)
        return self._rounds[0] if self._rounds else float("inf")

    def _count_off(self, job, round_: int, n: int) -> None:
        mine = self._mine.get(job)
        if mine is None or mine[round_] < n:
            raise ValueError(f"job {job!r} has no unfinished group in round {round_}")
        mine[round_] -= n
        self._left[round_] -= n
        if not self._left[round_]:
            del self._left[round_]
