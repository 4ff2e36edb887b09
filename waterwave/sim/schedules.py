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
- ``waterwave``, ``waterwave-alg1`` and ``waterwave-s``: the NodeGroup
  pipeline (``NodeGroupSchedule``): each job's step cut into node groups
  (``waterwave.exec.nodegroups``) and paired over rounds
  (``waterwave.exec.pairing``): under a memory budget, kept safe (ours,
  ``waterwave``), or by the paper's Algorithm 1 (``waterwave-alg1``);
  ``waterwave-s`` cuts a step in two, after its forward pass, and pairs the
  halves by Algorithm 1. Their traces must be built with their
  ``partition``, which records the groups in them.
- any callable ``schedule(jobs, steps) -> list[list[Segment]]``.

May import: waterwave.exec (node groups and pairing), this package.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..exec.nodegroups import Partition, auto_split_size, partition, two_groups
from ..exec.pairing import JobGroups, JobPlan, footprint, memory_rounds, rounds
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


@dataclass
class NodeGroupSchedule:
    """The NodeGroup pipeline: build each job's trace with ``partition``,
    then the schedule pairs their groups over rounds."""
    name: str = "waterwave"
    split_size: int | None = None    # bytes; None: auto_split_size of each job
    memory_limit: int | None = None  # what Algorithm 1 plans for
    order: str = "bfs"
    cut: str | None = None           # two groups: "forward" or "peak" (waterwave-s)
    overlap: bool = True             # a job's next step starts as soon as it can
    pairing: str = "algorithm1"      # or "memory" (exec/pairing.memory_rounds)
    groups: int = 8                  # without a split_size: each job's peak over this many

    @property
    def __name__(self) -> str:
        return self.name

    def partition(self, g) -> Partition:
        if self.cut:
            return two_groups(g, self.cut)
        return partition(g, self.split_size or auto_split_size(g, self.groups), self.order)

    def __call__(self, jobs: list[Trace], steps: int) -> list[list[Segment]]:
        for t in jobs:
            if "groups" not in t.meta:
                raise ValueError(f"the {self.name} schedule needs traces built with its "
                                 f"partition; trace {t.name!r} has no node groups")
        if self.pairing == "memory":
            if self.memory_limit is None:
                raise ValueError(f"the {self.name} schedule pairs groups under a memory limit: "
                                 "give one")
            plans = [JobPlan(j, sum(footprint(p[1]) for p in t.persistent), group_rises(t))
                     for j, t in enumerate(jobs)]
            where = memory_rounds(plans, self.memory_limit, steps)
        else:
            groups = []
            for j, t in enumerate(jobs):
                kinds = [d >= 0 for _, _, d in t.meta["groups"]]
                num_angs = kinds.index(False) if False in kinds else len(kinds)
                groups.append(JobGroups(j, num_angs, len(kinds), t.peak_live(),
                                        t.meta["partition"]["split_size"]))
            where = rounds(groups, self.memory_limit, steps, self.overlap)
        out = []
        for j, t in enumerate(jobs):
            spans = t.meta["groups"]
            out.append([Segment(r, s, spans[g][0], spans[g][1]) for r, s, g in where[j]])
        return out


def group_rises(t: Trace) -> list[tuple[int, int]]:
    """Each node group's (net bytes, rise) in a steady step: the rise is the
    most bytes live above the group's start while it runs, workspaces
    included, each tensor at its ``footprint`` in the allocator: what the
    trainer measures in a job's first step on a GPU (exec/concurrent.py)."""
    size = {b: footprint(n) for op in t.ops for b, n in op.alloc}
    out = []
    for first, end, _ in t.meta["groups"]:
        acc = rise = 0
        for op in t.ops[first:end]:
            acc += sum(size[b] for b, _ in op.alloc)
            rise = max(rise, acc)
            acc -= sum(size[b] for b in op.free)
        out.append((acc, rise))
    return out


SCHEDULES: dict[str, Schedule] = {"lockstep": lockstep, "phased": phased}
NODE_GROUP_SCHEDULES = {
    "waterwave": dict(pairing="memory"),
    "waterwave-alg1": dict(),
    "waterwave-s": dict(cut="forward", order="program"),
}
NAMES = (*SCHEDULES, *NODE_GROUP_SCHEDULES)
# Each schedule's allocator (policy, config), as the benchmarks and the demo
# run it: PyTorch's jobs under PyTorch's policy; the NodeGroup pipeline under
# the waterwave policy, blocks over 128 MiB never split (the paper's setting).
ALLOCATORS: dict[str, tuple[str, str]] = {
    "lockstep": ("pytorch", ""),
    "phased": ("pytorch", ""),
    "waterwave": ("waterwave", "max_split_size_mb:128"),
    "waterwave-alg1": ("waterwave", "max_split_size_mb:128"),
    "waterwave-s": ("waterwave", ""),
}


def schedule(name_or_fn: str | Schedule, memory_limit: int | None = None,
             split_size: int | None = None) -> Schedule:
    """A schedule by name (node-group schedules plan for ``memory_limit``,
    with ``split_size`` or their own choice), or the callable itself."""
    if callable(name_or_fn):
        return name_or_fn
    if name_or_fn in NODE_GROUP_SCHEDULES:
        return NodeGroupSchedule(name_or_fn, split_size, memory_limit,
                                 **NODE_GROUP_SCHEDULES[name_or_fn])
    try:
        return SCHEDULES[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown schedule {name_or_fn!r}: choose one of {', '.join(NAMES)}, "
                         "or pass a callable") from None
