"""The one table of the NodeGroup pipeline's schedules: how each cuts a
job's step into node groups and pairs the groups into rounds, and the
allocator each is benchmarked under. The trainer (``waterwave.exec``) and
the simulator (``waterwave.sim``) both run schedules from here, so the
simulator checks exactly what the trainer runs.

- ``waterwave`` (ours): groups of ``split_size`` bytes in BFS order, paired
  under a memory budget and kept safe (``pairing.MemoryPairing``), steps
  following each other without a pause;
- ``waterwave-alg1``: the same groups, paired by the paper's Algorithm 1
  (``pairing.algorithm1_rounds``);
- ``waterwave-s``: each step in two groups, cut after its forward pass, in
  program order, paired by Algorithm 1 (the paper's Waterwave-s);
- ``lockstep``: groups in program order, no barrier at all: the jobs run
  side by side as PyTorch runs them;
- ``turns``: whole steps in turn, one job a round (job k's step s in round
  s x jobs + k): one job at a time, each as fast as it runs alone, as
  time-slicing a GPU between processes does;
- ``sequential``: each job's steps one after another (job k's step s in
  round k x steps + s): a trial at a time, as a search without sharing runs;
- ``session``: groups in program order, run by whichever of the pairings
  above trains fastest within the budget, as ``session_choice.py`` chooses
  from each job measured alone and probes of a few steps: chosen at run
  time, so its ``round_planner`` is the chosen pairing's.

A memory budget is ``memory_limit`` bytes everywhere; ``None`` is no limit.

May import: waterwave.graph, this package.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from .nodegroups import Partition, auto_split_size, partition, two_groups
from .pairing import (
    JobGroups,
    JobPlan,
    MemoryPairing,
    PeriodicRounds,
    RoundPlanner,
    SEGMENT_SLACK,
    algorithm1_rounds,
)

# How a schedule pairs groups into rounds.
MEMORY, ALGORITHM1, FREE, TURNS, SEQUENTIAL = "memory", "algorithm1", "free", "turns", "sequential"
SESSION = "session"  # one of FREE, TURNS, SEQUENTIAL, MEMORY, chosen as the jobs run


@dataclass(frozen=True)
class Schedule:
    name: str
    summary: str
    pairing: str  # MEMORY, ALGORITHM1, FREE (one round, no barrier), TURNS, SEQUENTIAL, SESSION
    cut: str | None = None   # two groups cut there ("forward"); None: groups of split_size
    order: str | None = None  # the groups' operator order; None: the caller's (bfs by default)
    policy: str = "waterwave"  # the allocator it is benchmarked under
    config: str = ""

    def partition(self, graph: Graph, split_size: int | None = None, order: str = "bfs",
                  groups: int = 8) -> Partition:
        """A job's node groups: ``split_size`` bytes each (default: its
        step's peak over ``groups``), or the schedule's two."""
        if self.cut:
            return two_groups(graph, self.cut)
        return partition(graph, split_size or auto_split_size(graph, groups), self.order or order)

    def round_planner(self, steps: int, memory_limit: int | None, jobs: list[PairingInput],
                      overlap: bool = True,
                      segment_slack: int = SEGMENT_SLACK) -> RoundPlanner:
        """The run's rounds for ``jobs`` (job k is ``jobs[k]``), planned a
        window at a time (``round_feed.py``), by the schedule's pairing:
        MEMORY from each job's plan under ``memory_limit``, ALGORITHM1 from
        its groups (``overlap``: a job's next step starts as soon as it can),
        FREE every group in one round, no limit, TURNS each job's whole step
        in a round of its own, SEQUENTIAL every step of one job before the
        next job's. ``segment_slack``: MEMORY's bytes kept back a job for
        the part-empty segments its blocks sit in."""
        if self.pairing == MEMORY:
            return MemoryPairing([j.plan for j in jobs], memory_limit, steps,
                                 segment_slack=segment_slack)
        if self.pairing == ALGORITHM1:
            return algorithm1_rounds([j.groups for j in jobs], memory_limit, steps, overlap)
        if self.pairing == TURNS:
            return PeriodicRounds({k: [(k, g) for g in range(j.groups.num_groups)]
                                   for k, j in enumerate(jobs)}, max(1, len(jobs)), steps)
        if self.pairing == SEQUENTIAL:  # job k's step s in round k x steps + s
            return PeriodicRounds({k: [(k * steps, g) for g in range(j.groups.num_groups)]
                                   for k, j in enumerate(jobs)}, 1, steps)
        if self.pairing == SESSION:
            raise ValueError("the session schedule chooses its pairing as its jobs run: plan "
                             "with the chosen one (replace(schedule, pairing=...))")
        return PeriodicRounds({k: [(0, g) for g in range(j.groups.num_groups)]
                               for k, j in enumerate(jobs)}, 0, steps)


@dataclass(frozen=True)
class PairingInput:
    """What the pairings read of one job: MEMORY its ``plan`` (persistent
    bytes, each group's net bytes and rise), ALGORITHM1 and FREE its
    ``groups`` (their kinds and count, its peak, its split size)."""
    plan: JobPlan
    groups: JobGroups


# The allocator settings the captured schedules are simulated under: each
# stream keeps to its own large segments until the device is out, as a
# trainer's run sets on a GPU (alloc/own_segments.py); SIM_MAX_SPLIT is the
# simulator's choice alone.
OWN_SEGMENTS = "own_segments_first:True"
SIM_MAX_SPLIT = "max_split_size_mb:128"
TRAINER_CONFIG = f"{SIM_MAX_SPLIT},{OWN_SEGMENTS}"

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("waterwave", "ours: groups paired under the memory budget, kept safe", MEMORY,
             config=TRAINER_CONFIG),
    Schedule("waterwave-alg1", "the paper's Algorithm 1 over the same groups", ALGORITHM1,
             config=TRAINER_CONFIG),
    Schedule("waterwave-s", "each step in two groups (forward, backward), Algorithm 1",
             ALGORITHM1, cut="forward", order="program", config=OWN_SEGMENTS),
    Schedule("lockstep", "no barrier: the jobs side by side, as PyTorch runs them", FREE,
             order="program", policy="pytorch"),
    Schedule("turns", "whole steps in turn, one job at a time", TURNS, order="program",
             policy="pytorch"),
    Schedule("sequential", "each job's steps, one job after another", SEQUENTIAL,
             order="program", policy="pytorch"),
    Schedule("session", "measured, then side by side, in turn or paired: the fastest that fits",
             SESSION, order="program", config=TRAINER_CONFIG),
)}


def schedule(name: str) -> Schedule:
    """The schedule called ``name``; a clear error naming the choices otherwise."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}") from None
