"""Handing a run's rounds to the jobs' threads a window at a time, so that
a long ``run(steps)`` neither waits for its whole plan before the first
group nor holds it: the pairing plans about ``window_steps`` steps at a
time (``pairing.PeriodicRounds`` and ``pairing.MemoryPairing`` both plan in
windows), when the first job has run out of rounds.

A window is registered with the CounterBarrier whole, for every job, before
any job can see an entry of it: a job that waits for round r must find every
group of the rounds before r already counted, or it would pass them. A
planner's windows hold whole rounds, each later than every round before it,
so rounds that were passed never grow.

A job that leaves (it failed, or it finished) is counted off the barrier,
and later windows are not registered for it.

May import: this package.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence

from .counter_barrier import CounterBarrier
from .pairing import JobPlan, RoundPlanner, SegmentSpare

WINDOW_STEPS = 4  # steps of every job planned at a time


class RoundFeed:
    """Job k's entries come from the planner's job k; jobs may also ``join``
    a feed that is running (a training session's members), as the planner's
    job ``k``, between windows."""

    def __init__(self, planner: RoundPlanner, jobs: Sequence[object],
                 barrier: CounterBarrier, window_steps: int | None = None):
        self.planner, self.barrier = planner, barrier
        self.window_steps = window_steps or WINDOW_STEPS
        self.jobs: dict[int, object] = dict(enumerate(jobs))  # the planner's job k is jobs[k]
        self.last_round = -1    # the highest round handed out
        self._lock = threading.Lock()
        self._queues: dict[int, deque] = {k: deque() for k in self.jobs}
        self._left: set[int] = set()

    def join(self, k: int, job: object, plan: JobPlan, steps: int, solo_first: bool = False) -> None:
        """``job`` joins as the planner's job k (a ``MemoryPairing``), for
        ``steps`` steps; its rounds begin after every round planned so far."""
        with self._lock:
            if k in self.jobs:
                raise ValueError(f"job {k} is already in this feed")
            self.planner.join(plan, steps, solo_first)
            self.jobs[k] = job
            self._queues[k] = deque()

    def measured(self, k: int, groups: list[tuple[int, int]] | None,
                 segment_spare: SegmentSpare | None = None) -> None:
        """Job k's groups as measured in its solo step (None: the measure
        failed; it goes on with the bytes it had), and its segment spare
        (``JobPlan.segment_spare``; None: not measured)."""
        with self._lock:
            if groups is None:
                self.planner.resume(k)
            else:
                self.planner.update(k, groups, segment_spare)

    def set_limit(self, memory_limit: int | None, outside: int | None = None) -> None:
        with self._lock:
            self.planner.set_limit(memory_limit, outside)

    def entries(self, k: int) -> Iterator[tuple[int, int, int]]:
        """Job k's (round, step, group) entries, in order, planned as needed.
        Only job k's own thread takes from its queue; others only add."""
        queue = self._queues[k]
        while True:
            if not queue and not self._plan_more(k):
                return
            yield queue.popleft()

    def leave(self, k: int) -> None:
        """Job k runs none of its remaining entries."""
        with self._lock:
            self._left.add(k)
            self._queues[k].clear()
            self.barrier.leave(self.jobs[k])
            self.planner.leave(k)

    def _plan_more(self, k: int) -> bool:
        """Plan windows until job k has an entry; False once job k's part of
        the run is planned."""
        with self._lock:
            while not self._queues[k]:
                if k in self._left or self._planned_all(k):
                    return False
                window = self.planner.window(self.window_steps)
                if not any(window.values()):  # a bug, not a wait: say so rather than spin
                    raise RuntimeError(f"the pairing planned nothing while job {k} has groups "
                                       "left (is it paused for a measurement never given?)")
                for j, entries in window.items():
                    if not entries or j in self._left:
                        continue
                    self.barrier.plan(self.jobs[j], [r for r, _, _ in entries])
                    self.last_round = max(self.last_round, entries[-1][0])
                for j, entries in window.items():  # only once all are counted
                    if j not in self._left:
                        self._queues[j].extend(entries)
            return True

    def _planned_all(self, k: int) -> bool:
        return self.planner.planned_all(k)
