"""Schedules: how several jobs' steps are cut into segments and ordered.

A schedule turns each job's steps into *segments*, each tagged with a round.
The simulator runs round r once every job has scheduled all its segments of
earlier rounds: a barrier between rounds, as a thread barrier does between
halves in ../shared/gpu-snapshots/probe.py, or the NodeGroup executor's
CounterBarrier between node-group pairs. Within a round, jobs run freely.

- ``lockstep``: one segment per job, every step, round 0: jobs start
  together and run free.
- ``phased``: half the jobs (the even ones) run a step's forward while the
  other half run a backward and update, then the other way round, a barrier
  between halves (Waterwave-s of the paper; probe.py's PHASED=1). The odd
  jobs run one forward first, and one more at the end.
- any callable ``schedule(jobs, steps) -> list[list[Segment]]``: the hook
  the NodeGroup executor's schedules plug into.

May import: this package.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .trace import Trace


@dataclass
class Segment:
    round: int
    step: int    # whose blocks these operators use
    first: int   # operator range [first, last) of the job's trace
    last: int


Schedule = Callable[[list[Trace], int], list[list[Segment]]]


def forward_end(t: Trace) -> int:
    """Index of the first operator after the forward pass."""
    return next((k for k, op in enumerate(t.ops) if op.phase not in ("", "forward")), len(t.ops))


def lockstep(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    return [[Segment(0, s, 0, len(t.ops)) for s in range(steps)] for t in jobs]


def phased(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    out = []
    for j, t in enumerate(jobs):
        f = forward_end(t)
        if f in (0, len(t.ops)):
            raise ValueError(f"the phased schedule needs a forward and a backward phase; trace "
                             f"{t.name!r} has {'no forward' if f == 0 else 'only a forward'}")
        segs = []
        if j % 2 == 0:
            for s in range(steps):
                segs += [Segment(2 * s + 1, s, 0, f), Segment(2 * s + 2, s, f, len(t.ops))]
        else:
            segs.append(Segment(0, 0, 0, f))
            for s in range(steps):
                segs.append(Segment(2 * s + 1, s, f, len(t.ops)))
                segs.append(Segment(2 * s + 2, s + 1, 0, f))
        out.append(segs)
    return out


SCHEDULES: dict[str, Schedule] = {"lockstep": lockstep, "phased": phased}


def schedule(name_or_fn: str | Schedule) -> Schedule:
    """A schedule by name, or the callable itself."""
    if callable(name_or_fn):
        return name_or_fn
    try:
        return SCHEDULES[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown schedule {name_or_fn!r}: choose one of "
                         f"{', '.join(SCHEDULES)}, or pass a callable") from None
