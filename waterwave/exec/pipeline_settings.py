"""The settings of a pipelined run, checked once: what a training session
(``session.py``) and a ``ConcurrentTrainer`` (``concurrent.py``) are made
with, and what their jobs' steps are cut by (``pipelined_job.py``).

May import: waterwave.pipeline.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from ..pipeline.nodegroups import ORDERS
from ..pipeline.schedules import FREE, MEMORY, Schedule
from ..pipeline.schedules import schedule as named_schedule


@dataclass(frozen=True)
class PipelineSettings:
    """``schedule``: a name in ``pipeline.schedules.SCHEDULES``;
    ``memory_limit``: bytes the jobs may hold together (None: the GPU's
    free memory, no limit on the CPU); ``split_size``: bytes per node group
    (None: each job's step peak over 8); ``order``: the order groups are
    cut in (``bfs``, the paper's, or ``program``, the capture's)."""
    schedule: str = "waterwave"
    memory_limit: int | None = None
    split_size: int | None = None
    order: str = "bfs"

    def __post_init__(self):
        named_schedule(self.schedule)  # an unknown one is an error naming those there are
        if self.split_size is not None and not _positive_int(self.split_size):
            raise ValueError(f"split_size must be a positive number of bytes, got "
                             f"{self.split_size!r}")
        if self.order not in ORDERS:
            raise ValueError(f"unknown node order {self.order!r}: choose one of "
                             f"{', '.join(ORDERS)}")
        limit = self.memory_limit
        if limit is not None:
            if (isinstance(limit, bool) or not isinstance(limit, (int, float))
                    or not 0 < limit < float("inf")):
                raise ValueError(f"memory_limit must be a positive number of bytes, got "
                                 f"{limit!r}; None plans for the device's free memory")
            object.__setattr__(self, "memory_limit", int(limit))

    @property
    def plan_schedule(self) -> Schedule:
        """The pipeline's schedule: how steps are cut and groups paired."""
        return named_schedule(self.schedule)


class SettingsView:
    """What a session and a trainer say of their settings, read from
    ``self.settings`` (a ``PipelineSettings``)."""

    settings: PipelineSettings

    @property
    def memory_limit(self) -> int | None:
        return self.settings.memory_limit

    @property
    def schedule(self) -> str:
        return self.settings.schedule

    @property
    def split_size(self) -> int | None:
        return self.settings.split_size

    @property
    def order(self) -> str:
        return self.settings.order

    @property
    def plan_schedule(self) -> Schedule:
        return self.settings.plan_schedule


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def whole_steps(steps) -> int:
    """``steps`` as a whole number of at least 1; a clear error otherwise."""
    try:
        whole = None if isinstance(steps, bool) else operator.index(steps)
    except TypeError:
        whole = None
    if whole is None or whole < 1:
        raise ValueError(f"steps must be a whole number of steps, at least 1; got {steps!r}")
    return whole


def checked_capture(capture) -> bool:
    if not isinstance(capture, bool):
        raise ValueError(f"capture must be True (capture, plan and pipeline each job's step) or "
                         f"False (run each step eagerly, sharing the budget), not {capture!r}")
    return capture


def session_settings(settings: PipelineSettings) -> PipelineSettings:
    """A session pairs whichever jobs train at the time: the schedules that
    pair a fixed set are the trainer's."""
    if settings.plan_schedule.pairing not in (MEMORY, FREE):
        raise ValueError(f"a training session runs the waterwave or lockstep schedule, not "
                         f"{settings.schedule!r} (it pairs, or measures and probes, a fixed set "
                         "of jobs): use ConcurrentTrainer for it")
    return settings
