"""Several training jobs on one device, their node groups interleaved so
that memory one job frees serves the next job's allocations (the Waterwave
paper's NodeGroup pipeline, sections 4.3 and 4.4): ``ConcurrentTrainer``
trains a fixed set of ``waterwave.Job``s together (``Job.train`` joins the
device's training session instead, ``session.py``).

Each job's training step is captured once (``step.CapturedStep``) and cut
into node groups (``waterwave.pipeline.nodegroups``). Each job runs on a
worker thread of its own (``workers.py``, ``job_loop.py``), on its own CUDA stream when its
model is on a GPU, group by group; a CounterBarrier
(``pipeline.counter_barrier``) holds each group until the rounds before it
have finished, in the rounds the schedule gives:

- ``waterwave``: ours, the groups paired under a memory budget and kept
  safe (``pairing.memory_rounds``), steps following each other without a
  pause;
- ``waterwave-alg1``: the paper's Algorithm 1 (``pairing.rounds``);
- ``waterwave-s``: each step in two groups, forward and backward, paired by
  Algorithm 1;
- ``lockstep``: no barrier at all.

A run's rounds are planned a window of a few steps at a time, as the jobs
reach them (``pipeline.round_feed``), so ``run(100_000)`` starts at once.

On a GPU the Waterwave allocator (``waterwave.install_allocator()``) serves
every job from one cache, so a block one job frees can serve another's
allocation after an asynchronous stream wait; ``sync_at_barrier`` adds the
paper's SyncAndCoalesce between rounds. Without a memory limit the budget
is what the jobs hold plus what the GPU's allocator can still give (its
cached free blocks, and the driver's free memory within the allocator's
memory fraction), or unlimited on the CPU.

The ``waterwave`` schedule plans from each group's bytes. On the CPU they
are the captured graph's tensors at their footprint in a caching allocator
(``pairing.graph_plan``). On a GPU, kernels also allocate around themselves
(cuDNN's workspaces: 316 MB for one resnet50 convolution at batch 64), which
no graph shows; so each job's first step under the trainer runs alone, one
job after another, and the allocator's counters give each group's net bytes
and rise, workspaces included. That step trains like any other; it resets
the allocator's peak statistics.

A job that raises stops alone: its error is kept (``Job.error``), its
groups leave the barrier, its tensors are dropped, and the others go on.
Ctrl-C reaches the caller of ``run`` as ``KeyboardInterrupt`` within a
tenth of a second of the jobs' current groups ending; every job stops, and
the next run starts clean.

May import: waterwave.pipeline, waterwave.graph, waterwave.cuda, this
package; torch.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

from .. import cuda
from ..pipeline.counter_barrier import CounterBarrier
from ..pipeline.pairing import (
    JobGroups,
    MemoryPairing,
    PeriodicRounds,
    graph_plan,
    step_peak,
)
from ..pipeline.round_feed import RoundFeed
from ..pipeline.schedules import ALGORITHM1, MEMORY
from ..pipeline.schedules import schedule as named_schedule
from .group_runner import GroupRunner
from .job import Job
from .job_loop import Measure, MemoryProbe, run_job, wait_tasks
from .session import whole_steps
from .workers import POOL


class ConcurrentTrainer:
    """Trains ``jobs`` together, their node groups interleaved by
    ``schedule`` (see the module's opening) within ``memory_limit`` bytes.
    ``split_size``: bytes per node group; by default each job's own
    (``nodegroups.auto_split_size``), reported by ``stats()``."""

    def __init__(self, jobs: Sequence[Job], split_size: int | None = None,
                 memory_limit: int | None = None, schedule: str = "waterwave",
                 sync_at_barrier: bool = False, order: str = "bfs"):
        self.plan_schedule = named_schedule(schedule)  # the pipeline's table: a cut and a pairing
        if split_size is not None and split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        if memory_limit is not None and not memory_limit > 0:
            raise ValueError(f"memory_limit must be a positive number of bytes, got "
                             f"{memory_limit!r}; leave it out to plan for the device's free memory")
        self.schedule, self.split_size, self.memory_limit = schedule, split_size, memory_limit
        self.sync_at_barrier, self.order = sync_at_barrier, order
        self.jobs: list[Job] = []
        self.rounds_run = 0
        self.syncs = 0
        self.budget: int | None = None  # bytes the last run planned for (None: no limit)
        for job in jobs:
            self.add(job)

    # Jobs come and go between steps --------------------------------------
    def add(self, job: Job) -> None:
        if job in self.jobs:
            raise ValueError(f"{job!r} is already training here")
        job.partition = self.plan_schedule.partition(job.graph, self.split_size, self.order)
        job.runner = GroupRunner(job.step_fn, job.partition)
        job.plan = graph_plan(0, job.graph, job.partition)
        job.measured = None  # its groups are this trainer's: measure them again
        job.session = None
        self.jobs.append(job)

    def remove(self, job: Job) -> None:
        if job not in self.jobs:
            raise ValueError(f"{job!r} is not training here: this trainer has "
                             f"{', '.join(j.name for j in self.jobs) or 'no jobs'}")
        self.jobs.remove(job)

    @property
    def active(self) -> list[Job]:
        return [j for j in self.jobs if not j.failed]

    # Training -------------------------------------------------------------
    def step(self) -> list[float | None]:
        """One step of every job, together; each job's loss (None for a job
        that failed)."""
        before = {id(j): len(j.losses) for j in self.jobs}
        self._run(1)
        return [j.losses[-1] if len(j.losses) > before[id(j)] else None for j in self.jobs]

    def run(self, steps: int) -> list[list[float]]:
        """``steps`` steps of every job, one step following another without
        a pause, each on its data's next batch; each job's losses (all of
        them since it was made)."""
        self._run(whole_steps(steps))
        return [list(j.losses) for j in self.jobs]

    def _planner(self, jobs: list[Job], steps: int) -> PeriodicRounds | MemoryPairing:
        """The run's rounds, planned a window at a time as the jobs need them
        (``pipeline.round_feed``); job k is ``jobs[k]``."""
        sched = self.plan_schedule
        if sched.pairing == MEMORY:
            limit = self.budget = self._budget(jobs)
            plans = [replace(j.plan, job=k, groups=list(j.measured or j.plan.groups))
                     for k, j in enumerate(jobs)]
            return sched.round_planner(steps, limit, plans=plans)
        if sched.pairing == ALGORITHM1:
            limit = self.budget = self._budget(jobs)
            groups = [JobGroups(k, j.partition.num_angs, len(j.partition.groups),
                                j.persistent_bytes() + j.partition.peak, j.partition.split_size)
                      for k, j in enumerate(jobs)]
            return sched.round_planner(steps, limit, groups=groups)
        return sched.round_planner(steps, None,
                                   group_counts=[len(j.partition.groups) for j in jobs])

    def _check_budget(self, jobs: list[Job]) -> None:
        """A limit below what the jobs hold between steps can never be met."""
        if self.memory_limit is None or self.plan_schedule.pairing not in (MEMORY, ALGORITHM1):
            return
        held = sum(j.plan.persistent for j in jobs)
        if held >= self.memory_limit:
            names = ", ".join(j.name for j in jobs)
            raise ValueError(f"memory_limit {self.memory_limit} bytes does not even hold the jobs' "
                             f"persistent tensors ({held} bytes: parameters, buffers, optimizer "
                             f"state and batches of {names}): raise it, or train fewer jobs "
                             "together")
        for j in jobs:  # a job alone is never held back: one past the limit would train past it
            need = step_peak(j.plan)
            if need > self.memory_limit:
                raise ValueError(f"memory_limit {self.memory_limit:,} bytes is below one step of "
                                 f"job {j.name!r} alone ({need:,} bytes at its peak as planned): "
                                 "raise it, or train a smaller batch or model")

    def _budget(self, jobs: list[Job]) -> int | None:
        """The bytes the jobs may hold together: ``memory_limit``; else, on a
        GPU, what the allocator can still give (``MemoryProbe.available``)
        plus what the jobs hold already; else (the CPU) no limit."""
        if self.memory_limit is not None:
            return self.memory_limit
        probe = self._memory_probe(jobs)
        if probe is None:
            return None
        return probe.available() + sum(j.plan.persistent for j in jobs)

    def _run(self, steps: int) -> None:
        jobs = self.active
        if not jobs:
            return
        for job in jobs:  # on the caller's thread: its train/eval mode, autocast, hooks
            job.check_context()
        for job in jobs:  # every check passed: nothing is touched by a refused run
            job.step_fn.clear_step_outputs()
        self._check_budget(jobs)
        probe = self._memory_probe(jobs) if self.plan_schedule.pairing == MEMORY else None
        if probe is not None and any(j.measured is None for j in jobs):
            # Every job's next step alone, so that all keep the same count.
            for job in jobs:
                self._solo_step(job, probe)
            steps -= 1
            jobs = self.active
            if not steps or not jobs:
                return
        feed = RoundFeed(self._planner(jobs, steps), jobs, CounterBarrier())
        boundary = threading.Lock()
        opened = [0]  # the highest round SyncAndCoalesce has run before

        def enter(round_: int) -> None:
            if self.sync_at_barrier and round_ > opened[0]:
                with boundary:
                    if round_ > opened[0]:
                        self._sync_and_coalesce(jobs)
                        opened[0] = round_

        tasks = [POOL.submit(lambda job=job, k=k: run_job(job, feed, k, enter),
                             f"waterwave job {job.name}") for k, job in enumerate(jobs)]
        try:
            wait_tasks(tasks)
        except BaseException:  # Ctrl-C (or another signal's error) in the caller
            # Every job stops at its next group, its step's tensors dropped;
            # nothing trains on behind the caller's back, and the next run
            # starts clean. The jobs' losses keep the steps they finished.
            feed.barrier.close()
            wait_tasks(tasks, interruptible=False)
            raise
        self.rounds_run += 1 + feed.last_round

    def _solo_step(self, job: Job, probe: MemoryProbe) -> None:
        """One step of ``job`` alone, measuring each group's net bytes and
        rise in the allocator (see the module's opening)."""
        groups = len(job.partition.groups)
        feed = RoundFeed(PeriodicRounds({0: [(0, g) for g in range(groups)]}, 0, 1), [job],
                         CounterBarrier())

        def report(readings):
            if readings is not None and len(readings) == groups:
                job.measured = readings

        run_job(job, feed, 0, measure=Measure(probe, report))

    def _memory_probe(self, jobs: list[Job]) -> MemoryProbe | None:
        """What measures the jobs' groups: the allocator serving their GPU;
        None on the CPU, where the graph's bytes are what is allocated."""
        cuda_jobs = [j for j in jobs if j.step_fn.device == "cuda"]
        return MemoryProbe(cuda_jobs[0].step_fn.params[0].device) if cuda_jobs else None

    def _sync_and_coalesce(self, jobs: list[Job]) -> None:
        if cuda.is_installed() and any(j.step_fn.device == "cuda" for j in jobs):
            cuda.sync_and_coalesce()
            self.syncs += 1

    def stats(self) -> dict:
        """Per job: node groups (and how many allocate), the split size,
        steps run and the error of a job that failed; the bytes the last run
        planned for (``budget``: the memory limit, or on a GPU without one
        what the allocator could give); and the allocator's statistics where
        the Waterwave allocator serves the jobs."""
        out = {"schedule": self.schedule, "memory_limit": self.memory_limit, "budget": self.budget,
               "split_size": self.split_size, "split_size_chosen": self.split_size is None,
               "sync_at_barrier": self.sync_at_barrier, "syncs": self.syncs,
               "rounds_run": self.rounds_run, "jobs": []}
        for j in self.jobs:
            p = j.partition
            out["jobs"].append({"name": j.name, "steps": len(j.losses), "groups": len(p.groups),
                                "allocation_groups": sum(g.kind == "ANG" for g in p.groups),
                                "split_size": p.split_size, "partition": p.how,
                                "measured": j.measured is not None,
                                "error": None if j.error is None else repr(j.error)})
        if cuda.is_installed() and any(j.step_fn.device == "cuda" for j in self.jobs):
            out["allocator"] = cuda.memory_stats()
        return out
