"""A job as a pipelined run holds it: its captured step cut into the run's
node groups, a group runner for each capture it trains from, what the
memory-aware pairing plans it by, and what its first step measured on a
GPU. A training session and a ``ConcurrentTrainer`` make one the same way
for each job they train, and keep it themselves: the user's ``Job`` holds
only its captures, its data and its losses, whichever runs train it.

May import: waterwave.pipeline, this package.
"""
from __future__ import annotations

import weakref
from dataclasses import replace

from ..pipeline.pairing import JobPlan, SegmentSpare, graph_plan, step_peak
from .group_runner import GroupRunner
from .pipeline_settings import PipelineSettings


class PipelinedJob:
    """``job`` cut by ``settings``; ``session``: the training session that
    runs it (its eager steps then join the session as sharing members), or
    None for a ``ConcurrentTrainer``. A session holds the job weakly, so
    that keeping this for the job's next call does not keep the job; a
    trainer holds its jobs."""

    def __init__(self, job, settings: PipelineSettings, session=None):
        self._job = weakref.ref(job)
        self._kept = job if session is None else None
        self.session, self.name, self.between = session, job.name, job.between
        self.step_fn = job.step_fn  # the capture it was cut for (the model's variant)
        self.partition = settings.plan_schedule.partition(job.graph, settings.split_size,
                                                          settings.order)
        self.runner = GroupRunner(job.step_fn, self.partition)
        self.plan: JobPlan = graph_plan(0, job.graph, self.partition)
        self.measured: list[tuple[int, int]] | None = None  # each group's (net, rise) on a GPU
        # What its stream's own segments held beyond its blocks in that step
        # (JobPlan.segment_spare); None where not measured.
        self.segment_spare: SegmentSpare | None = None
        # Its data's batches already on the GPU: held beside every step, and
        # in no step's allocations (on the CPU a dataset in memory is the
        # user's, not the training's).
        on_gpu = job.batches is not None and str(job.device).startswith("cuda")
        self.data_bytes = job.batches.resident_bytes() if on_gpu else 0
        self._runners: dict[int, tuple[object, GroupRunner]] = {}  # other shapes' captures
        self.stale = False  # the run's settings changed: cut it again

    @property
    def job(self):
        """The job (alive while it trains: its caller holds it)."""
        return self._job()

    @property
    def current(self) -> bool:
        """Cut for the job's capture now (a new train/eval mode, frozen
        parameters... make the job capture again, and be cut again) and by
        the run's settings now."""
        return not self.stale and self.step_fn is self.job.step_fn

    def step_for(self, inputs: tuple, targets):
        """(capture, group runner) for a batch, or None where it trains
        eagerly (``Job.capture_for``)."""
        capture = self.job.capture_for(inputs, targets)
        if capture is None:
            return None
        if capture is self.step_fn:
            return capture, self.runner
        found = self._runners.get(id(capture))
        if found is None or found[0] is not capture:
            found = self._runners[id(capture)] = (capture, GroupRunner(capture, self.partition))
        return found

    def eager_step(self, inputs: tuple, targets):
        """A batch no capture can train, run eagerly (``Job.eager_step``)."""
        return self.job.eager_step(inputs, targets, self.session)

    def step_peak(self) -> int:
        """The most it holds over one step alone, as planned, with what it
        holds beside its steps (``beside``)."""
        return step_peak(self.plan) + self.beside()

    def held(self) -> int:
        """What it holds between steps: its persistent bytes, and what it
        holds beside its steps (``beside``)."""
        return self.plan.persistent + self.beside()

    def beside(self) -> int:
        """What it holds beside its steps: what its thread kept from
        evaluating, and its data's batches on the GPU."""
        return self.between.kept + self.data_bytes

    def pairing_plan(self, k: int, **changes) -> JobPlan:
        """What the pairing plans it by as job ``k``: its groups as measured
        where they were, with its segment spare; ``changes`` to the plan."""
        return replace(self.plan, job=k, groups=list(self.measured or self.plan.groups),
                       segment_spare=self.segment_spare if self.measured else None,
                       **changes)

    def reserve(self) -> int:
        """What a session keeps for its evaluation between its calls."""
        return self.between.reserve(self.measured or self.plan.groups)


def refuse_past_limit(memory_limit: int | None, members: list[PipelinedJob]) -> None:
    """Jobs that can never train under ``memory_limit``: what they hold
    between steps together, or one step of any of them alone (a job alone
    is never held back: one past the limit would train past it). A clear
    error naming the bytes, before anything runs."""
    if memory_limit is None:
        return
    held = sum(m.plan.persistent for m in members)
    if len(members) > 1 and held >= memory_limit:  # one job alone: its step says more
        names = ", ".join(m.name for m in members)
        raise ValueError(f"memory_limit={memory_limit:,} bytes does not even hold the jobs' "
                         f"persistent tensors ({held:,} bytes: parameters, buffers, optimizer "
                         f"state and batches of {names}): raise it, or train fewer jobs together")
    for m in members:
        need = m.step_peak()
        if need > memory_limit:
            raise ValueError(f"memory_limit={memory_limit:,} bytes is below one step of job "
                             f"{m.name!r} alone ({need:,} bytes at its peak as planned: "
                             "parameters, optimizer state, the batch and its activations): "
                             "raise memory_limit, or train a smaller batch or model")
