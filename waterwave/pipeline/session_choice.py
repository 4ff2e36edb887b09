"""How a training session runs a set of jobs under a memory budget: the
choice between running them side by side, pairing their node groups, and
taking turns, made from what the session measured of each job. Figures in,
a choice out: the trainer feeds it what a GPU measured, the simulator what
it simulated (``waterwave.sim.schedules.SessionSchedule``).

- FREE (side by side, no barrier) when the bytes each job was measured
  holding alone fit the budget together (beside peaks reserved alone, with
  what the small pool the jobs' streams share may take beyond them,
  ``side_by_side_need``): nothing waits, and every job runs as fast as
  sharing the device lets it.
- Otherwise memory binds, and no figure measured alone says for sure what
  fits beside what: a shared cache lets side by side fit under less than
  the peaks' sum, and blocks one job pins can keep another's step from
  fitting in turn. So the session probes each way for a few steps (side by
  side, whole steps in turn, one job after another, the node groups paired
  under the budget: FREE, TURNS, SEQUENTIAL, MEMORY) and keeps the fastest
  that fitted. Pairing wins where one job's forward overlaps another's
  backward on a device with room for both, or one's host work hides in
  another's kernels; where each job alone keeps the device busy, turns win
  and the barriers between paired rounds only cost.

A trainer on a GPU probes all four too (``exec/concurrent.py``), but the
pairing only where its plan keeps to the budget (``MemoryPairing.fits``).
Side by side could run out of memory halfway through a step, with batch
norm's running statistics already moved and some parameters updated, so
the trainer probes it with the budget set as the allocator's cap and each
job's state kept on the host (``exec/rollback.py``): a job whose step runs
out is put back as it was and trains the probe's steps again alone. Chosen
from its probe, side by side runs guarded so for as long as it runs: its
first ``GUARDED_STEPS`` steps in short chunks (the simulator models those),
then in chunks doubling in length (``guard_chunk``). (The
pairing itself runs its jobs free where their steps' bytes fit beside what
each job's segments held beyond its blocks when it was measured alone,
``JobPlan.segment_spare``; counting 5% of the bytes instead, that ran out
in 13 of 258 simulated draws of tight caps, none since,
bench/concurrent/pairing_fit.py.) On the CPU nothing holds a budget, so a
probe of side by side would always fit: there it runs only where the peaks
fit (``CPU_PROBES``).

May import: this package.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .pairing import FREE_MARGIN, LARGE_SEGMENT, SMALL_SEGMENT, SegmentSpare, shared_small_pool
from .schedules import FREE, MEMORY, SEQUENTIAL, TURNS


@dataclass(frozen=True)
class MeasuredAlone:
    """One job as measured training alone: the most bytes it held (as the
    allocator counts them, its cached blocks included), a steady step's
    time, and the samples a step trains. ``segment_spare``: where ``peak``
    is what the job's segments reserved alone, as Waterwave's allocator
    measures it, what they held beyond its blocks; None where ``peak`` is
    bytes allocated with a margin and segments (``cached_peak``) or, on the
    CPU, bytes allocated."""
    peak: int
    step_seconds: float
    samples: int = 1
    segment_spare: SegmentSpare | None = None

    def __post_init__(self) -> None:
        if self.peak < 0 or not self.step_seconds > 0 or self.samples < 1:
            raise ValueError(f"a job measured alone needs peak >= 0 bytes, a step time > 0 s "
                             f"and samples >= 1, not {self}")


@dataclass(frozen=True)
class Choice:
    """The session's pairing (FREE, MEMORY or TURNS) and why, with the
    rates it compared (samples per second; None where not measured)."""
    pairing: str
    why: str
    turns_rate: float | None = None
    pairing_rate: float | None = None


def cached_peak(allocated: int, large_segment_size: int = LARGE_SEGMENT) -> int:
    """The bytes a job that allocated ``allocated`` bytes at most may hold
    in a caching allocator's segments, running beside others: what a
    trainer on a device counts a job's peak as, from its allocator's
    counters (``FREE_MARGIN`` more, and a part-empty segment of each pool)."""
    return int(allocated / (1 - FREE_MARGIN)) + SMALL_SEGMENT + large_segment_size


def side_by_side_need(jobs: Sequence[MeasuredAlone]) -> int:
    """The bytes the jobs are counted to hold side by side: their peaks
    alone, and where those are bytes reserved, what the small pool they
    share may take beyond them (``shared_small_pool``; ``cached_peak``
    already counts a segment of each pool a job)."""
    return sum(j.peak for j in jobs) + shared_small_pool(j.segment_spare for j in jobs)


def side_by_side_fits(jobs: Sequence[MeasuredAlone], memory_limit: int | None) -> bool:
    """Whether the jobs, held all at once as measured alone
    (``side_by_side_need``), fit ``memory_limit`` bytes (None: no limit)."""
    return memory_limit is None or side_by_side_need(jobs) <= memory_limit


def turns_rate(jobs: Sequence[MeasuredAlone]) -> float:
    """Samples per second taking whole steps in turn: a step of each job,
    each as fast as alone."""
    return sum(j.samples for j in jobs) / sum(j.step_seconds for j in jobs)


# The ways a session probes where memory binds, simplest first: of ways
# within TIE of the fastest, the simplest is kept (a probe of a few steps
# does not tell them apart more finely, and the simpler has fewer barriers
# to lose to on later steps).
PROBED = (FREE, TURNS, SEQUENTIAL, MEMORY)
TIE = 0.01

# Side by side can fit its probe and run out of memory some steps later, as
# blocks cached beside other jobs' fragment the segments: in 9 of 524
# simulated draws of 2-4 MLPs it fitted its 5 steps and ran out by the 20th
# (bench/concurrent/session_fit.py). Chosen from its probe, side by side
# runs guarded for as long as it runs, each job's state kept at each
# chunk's start, as the probe ran; a job whose step runs out is put back,
# and the choice falls to the fastest other probe. Its first GUARDED_STEPS
# steps run GUARD_CHUNK at a time, where a run-out is likeliest (the
# simulator models those); then each chunk is twice the last, up to
# GUARD_CHUNK_MOST, so that keeping the state costs less and less a step
# while a run-out as late as any still loses no trial.
GUARDED_STEPS = 32
GUARD_CHUNK = 8
GUARD_CHUNK_MOST = 1024


def guard_chunk(guarded: int) -> int:
    """The steps of the next guarded chunk, ``guarded`` steps guarded so
    far: ``GUARD_CHUNK`` for the first ``GUARDED_STEPS``, then doubling from
    twice that, at most ``GUARD_CHUNK_MOST``."""
    if guarded < GUARDED_STEPS:
        return GUARD_CHUNK
    chunk, start = 2 * GUARD_CHUNK, GUARDED_STEPS
    while chunk < GUARD_CHUNK_MOST and guarded >= start + chunk:
        start, chunk = start + chunk, 2 * chunk
    return min(chunk, GUARD_CHUNK_MOST)

# What a trainer on the CPU probes where memory binds: the ways that hold no
# more than a job's step beside the others' state (one after another holds
# what turns hold there: a job's parameters stay while the trainer has it,
# but it hands the cache from job to job once a run, not once a step).
CPU_PROBES = (TURNS, SEQUENTIAL, MEMORY)


def choose(jobs: Sequence[MeasuredAlone], memory_limit: int | None,
           probes: dict[str, float | None] | None = None) -> Choice:
    """The session's pairing for ``jobs`` under ``memory_limit`` bytes.
    Where side by side does not surely fit, ``probes`` are what a few steps
    of each of ``PROBED`` trained (samples per second; None where it ran out
    of memory, or was not run: a pairing that could not keep to its budget,
    ``MemoryPairing.fits``); without them the answer is MEMORY with the reason "probe":
    run the probes, then ask again. Where none fitted, one job after
    another is all that is left."""
    if not jobs:
        raise ValueError("a session's choice needs at least one job")
    if side_by_side_fits(jobs, memory_limit):
        return Choice(FREE, f"side by side fits: {side_by_side_need(jobs):,} bytes held "
                            f"alone in all, under {_limit(memory_limit)}")
    turns = turns_rate(jobs)
    if probes is None:
        return Choice(MEMORY, "probe", turns)
    unknown = set(probes) - set(PROBED)
    if unknown:
        raise ValueError(f"unknown probes {sorted(unknown)}: a session probes {', '.join(PROBED)}")
    fitted = {p: probes[p] for p in PROBED if probes.get(p) is not None}
    pairing_rate = probes.get(MEMORY)
    said = ", ".join(f"{p} {'did not fit' if r is None else f'{r:,.0f}'}"
                     for p, r in probes.items())
    if not fitted:
        return Choice(SEQUENTIAL, f"no probe fitted the limit ({said}): one job after another",
                      turns, pairing_rate)
    best = max(fitted.values())
    chosen = next(p for p in PROBED if p in fitted and fitted[p] >= best * (1 - TIE))
    return Choice(chosen, f"fastest of the probes (per second: {said})", turns, pairing_rate)


def _limit(memory_limit: int | None) -> str:
    return "no limit" if memory_limit is None else f"the limit of {memory_limit:,} bytes"
