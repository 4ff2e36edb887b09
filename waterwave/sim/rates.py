"""A training rate that every job's steps count in alike: the samples of
some more steps of every job over the time those steps add, taken from two
runs of the same jobs that differ only in their step counts.

``SimResult.throughput`` is the rate within a steady window (from the
moment every job has ended its first step to the moment the first ends its
last), which counts whichever jobs' steps fall in the window: a way of
running jobs that steps the jobs with the most samples per second most often
there looks faster without ending any job sooner. This rate asks what a
search asks: how long every job's next steps take.

May import: nothing of waterwave.
"""
from __future__ import annotations

from typing import Protocol


class Run(Protocol):
    """What the rate reads of a run (``multijob.SimResult``, which imports
    this module through the session schedule)."""
    ok: bool
    jobs: list[str]
    batch_sizes: list[int | None]
    steps: int
    elapsed_us: float | None


def added_steps_rate(short: Run, long: Run) -> float | None:
    """Samples per second of the steps ``long`` ran past ``short`` (the same
    jobs, the same schedule and cap): each job's batch times the added
    steps, over the time by which the last job's last step ended later.
    None where either ran out of memory."""
    if not (short.ok and long.ok):
        return None
    if short.jobs != long.jobs or long.steps <= short.steps:
        raise ValueError(f"an added-steps rate needs two runs of the same jobs, the second "
                         f"longer: {short.jobs} ({short.steps} steps) and {long.jobs} "
                         f"({long.steps} steps)")
    samples = sum(b or 1 for b in long.batch_sizes) * (long.steps - short.steps)
    return samples / max(long.elapsed_us - short.elapsed_us, 1e-3) * 1e6
