"""Training sessions: every job training on a device at the same time,
whoever called it and from which thread, in one NodeGroup pipeline.

``Job.train(steps)`` joins its device's session (``training_session``) for
``steps`` steps and leaves when they are done: a trial of a hyperparameter
search is an ordinary loop (train an epoch, step a scheduler, evaluate,
report), and trials running in other threads (Optuna's ``n_jobs``) train
beside it. The calling thread runs its own job's groups; the session only
plans: one round feed (``pipeline.round_feed``) over one memory-aware
pairing (``pipeline.pairing.MemoryPairing``) while anyone trains, which
jobs join (their rounds begin after every round planned so far, at most a
window of the others' steps later) and leave (their persistent bytes, the
parameters and optimizer state kept between calls, stay counted against
the budget, and so does what it allocates between calls, evaluating: see
``between_calls.py``). When the last job leaves, the next one starts a
fresh feed.

A ``ConcurrentTrainer`` (``concurrent.py``) is the session's fixed set of
jobs: it plans its own rounds, by any schedule, and the session counts
what its jobs hold against the same budget (the run's budget while it
runs, what they keep between runs), and leaves its runs the rest: one
budget per device, whichever way jobs train there.

How a job's steps run (``captures``): by default (``capture=False``)
eagerly on the calling thread (``job_loop.run_free``), each call one
``waterwave.sharing`` block where the session has a budget, so its memory
is counted and gated with every other member's, and its results are its
eager loop's because it is its eager loop. On an H200 (``docs/results.md``)
eager members trained an Optuna search's small trials at 1.95x the rate of
captured steps, and all of its memory-bound ones where captured steps lost
6 of 8. With ``capture=True`` and a budget, a job's step is captured when
it first trains, planned, cut into node groups and paired under the budget:
the paper's pipeline.

The budget: ``memory_limit`` bytes when set; else, on a GPU, what the
allocator can give plus what the session's jobs and members hold (for a
captured feed, measured when it starts; for members, at their blocks' and
passes' starts); else (the CPU) none: the session plans nothing
(``plans``) and counts nothing. On a GPU a captured job's first step in a
session runs alone, group by group, and the allocator's counters give each
group's bytes (cuDNN's workspaces included), as ``ConcurrentTrainer``
measures.

Ctrl-C: from the first job or member that trains here on, a SIGINT also
stops every session (``interrupt_all``, arranged by ``ctrl_c.watch``
where the process's handler is Python's own): each job's thread leaves at
its next group with ``KeyboardInterrupt``, the main thread gets its
``KeyboardInterrupt`` as before, and the next ``train`` call starts a
fresh feed.

May import: waterwave.pipeline, this package; torch (lazily).
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from dataclasses import dataclass, replace

from .. import _C
from .. import cuda
from ..alloc import cache_splits, cpu_allocator
from ..alloc.torch_bridge import BridgeUnavailable
from ..pipeline.counter_barrier import CounterBarrier
from ..pipeline.pairing import MemoryPairing
from ..pipeline.pass_profile import GPU_MARGIN, FirstPasses
from ..pipeline.round_feed import RoundFeed
from ..pipeline.schedules import FREE, MEMORY
from . import awaiting_jobs, ctrl_c
from .between_calls import BetweenCalls
from .device_segments import segment_slack
from .job_loop import Measure, MemoryProbe, raise_outcome, run_free, run_job
from .pipeline_settings import (PipelineSettings, SettingsView, checked_capture, session_settings,
                                whole_steps)
from .pipelined_job import PipelinedJob, refuse_past_limit

_UNSET = object()
# A probe of a GPU's free memory collects garbage first at most this often:
# a full collection in a process holding torch takes 0.2-0.4 s (2 cores,
# 2026-11-27), and sharing probes at every block's start.
COLLECT_EVERY_S = 10.0
# Members' passes measure the GPU's budget at most this often: a measure
# costs about 30 us of Python (32 us over the fake driver on the CPU), which
# a small model's pass of a fraction of a millisecond would feel.
PASS_PROBE_EVERY_S = 0.005


class TrainingSession(SettingsView):
    """The jobs training on one device now (see the module's opening).
    ``memory_limit``: bytes the jobs may hold together (None: the GPU's
    free memory, no limit on the CPU); ``capture``: whether jobs' steps are
    captured and pipelined under the budget (False: each runs eagerly, a
    sharing member); for captured steps, ``schedule``: ``waterwave`` (groups
    paired under the budget) or ``lockstep`` (no barrier), and
    ``split_size``: bytes per node group (default: each job's step peak
    over 8)."""

    def __init__(self, device, memory_limit: int | None = None, schedule: str = "waterwave",
                 split_size: int | None = None, order: str = "bfs", capture: bool = False):
        self.device = device
        self.capture = checked_capture(capture)
        self._lock = threading.Lock()
        self._feed: RoundFeed | None = None
        self._members: dict[int, tuple[PipelinedJob, RoundFeed]] = {}  # k -> training now
        # k -> (a job training eagerly now, the event that stops it): a
        # session that plans nothing (``plans``)
        self._free: dict[int, tuple[object, threading.Event]] = {}
        # Each job that trained here, cut into this session's groups (until
        # the settings change), for its next call; and what it holds
        # between calls is counted against the budget.
        self._pipelined: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._sharing: dict[int, object] = {}  # id -> waterwave.sharing members in blocks now
        # The first passes its members measured, by model structure: a new
        # member's first pass of a kind seen asks for that, not to run alone.
        self.first_passes = FirstPasses()
        # Each ConcurrentTrainer whose jobs are on this device -> what they
        # hold here (TrainerHold): its fixed set is one more member.
        self._trainers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_k = 0
        self._capacity: int | None = None  # the GPU budget, probed when a feed starts
        self._collected_at = -COLLECT_EVERY_S  # when a probe last collected garbage
        self._pass_probed_at = -PASS_PROBE_EVERY_S  # when a pass last measured the budget
        self._blocks_kept_whole = False  # cache_splits: set at the first block on a GPU
        self.steps_run = 0
        self.put_back = 0  # sharing jobs' steps undone and run again alone (run_free)
        self.most_training = 0  # the most jobs that trained here at once
        self.settings = session_settings(PipelineSettings(schedule, memory_limit, split_size,
                                                           order))
        with _LIVE_LOCK:
            _LIVE.add(self)

    def configure(self, memory_limit=_UNSET, schedule=_UNSET, split_size=_UNSET,
                  order=_UNSET, capture=_UNSET) -> TrainingSession:
        """Change the settings given; only while no job trains here."""
        with self._lock:
            running = len(self._members) + len(self._free) + len(self._sharing) + sum(
                hold.running for hold in list(self._trainers.values()))
            if running:
                raise RuntimeError(f"{running} job(s) train in "
                                   f"the session of {self.device} now: change its settings "
                                   "between trainings")
            now = self.settings
            self.settings = session_settings(PipelineSettings(
                now.schedule if schedule is _UNSET else schedule,
                now.memory_limit if memory_limit is _UNSET else memory_limit,
                now.split_size if split_size is _UNSET else split_size,
                now.order if order is _UNSET else order))
            if capture is not _UNSET:
                self.capture = checked_capture(capture)
            # Jobs are cut again, by the new settings, at their next call;
            # what they hold between calls stays counted until then.
            for member in self._pipelined.values():
                member.stale = True
        return self

    @property
    def plans(self) -> bool:
        """Whether it plans its jobs' steps: where it has a budget to plan
        them under (a GPU's, or ``memory_limit``). A session that plans
        nothing (the CPU without a limit) trains each job's steps eagerly,
        each as the job's own loop would, and captures nothing: the capture
        is what a plan is made from, and costs a short trial more than its
        steps."""
        return self.memory_limit is not None or self.device != "cpu"

    @property
    def captures(self) -> bool:
        """Whether it captures its jobs' steps and pipelines them: where it
        plans, with ``capture=True``. Otherwise each job's steps run eagerly,
        as members of ``waterwave.sharing`` where it plans."""
        return self.plans and self.capture

    # One job's call ---------------------------------------------------------
    def train(self, job, steps: int) -> None:
        """``steps`` steps of ``job`` on the calling thread, beside the others."""
        steps = whole_steps(steps)
        ctrl_c.watch()
        if not self.captures:
            self._train_free(job, steps)
            return
        job.check_context()  # its train/eval mode, autocast, hooks: the caller's
        job.step_fn.clear_step_outputs()
        on_cuda = job.step_fn.device == "cuda"
        probe = MemoryProbe(job.device) if on_cuda else None
        measure_between = BetweenCalls.measurable(on_cuda)
        with self._lock:
            self._refuse_training_twice_locked(job)
            job.between.end(measure_between)
            member = self._pipelined.get(job)
            if member is None or not member.current:
                member = self._pipelined[job] = PipelinedJob(job, self.settings, self)
                awaiting_jobs.trained(job)  # counted as the session's job from here on
            if self.plan_schedule.pairing == MEMORY:
                refuse_past_limit(self.memory_limit, [member])
            feed = self._feed
            if feed is None:
                feed = self._feed = RoundFeed(
                    MemoryPairing([], None, 0, segment_slack=segment_slack([member])), [],
                    CounterBarrier())
                self._capacity = self._probe_capacity(probe)
            k = self._next_k
            self._next_k += 1
            self._members[k] = (member, feed)
            self._count_training_locked()
            solo = (probe is not None and member.measured is None
                    and self.plan_schedule.pairing == MEMORY)
            plan = member.pairing_plan(k)
            plan = replace(plan, persistent=plan.persistent + member.beside(),
                           after=job.between.reserve(plan.groups))
            feed.join(k, job, plan, steps, solo_first=solo)
            feed.set_limit(*self._budget(feed))
            self._share_budget_locked()
        measure = None
        if solo:
            def report(readings, spare, member=member, feed=feed, k=k):
                if readings is not None and len(readings) == len(member.partition.groups):
                    member.measured, member.segment_spare = readings, spare
                    feed.measured(k, readings, spare)
                else:
                    feed.measured(k, None)
            measure = Measure(probe, report)
        before = len(job.losses)
        try:
            run_job(member, feed, k, measure=measure)
        finally:
            with self._lock:
                del self._members[k]
                self.steps_run += len(job.losses) - before
                if self._feed is feed:
                    if any(f is feed for _, f in self._members.values()):
                        feed.set_limit(*self._budget(feed))
                    else:
                        self._feed = None  # the next job starts a fresh feed
                self._share_budget_locked()
            job.between.begin(measure_between)
        raise_outcome(job, len(job.losses) - before, steps, feed.barrier.closed)

    def _train_free(self, job, steps: int) -> None:
        """``train`` where nothing is captured: the job's steps run eagerly on
        the calling thread (``run_free``), beside whatever else trains; where
        the session plans, in one ``waterwave.sharing`` block."""
        stop = threading.Event()
        with self._lock:
            self._refuse_training_twice_locked(job)
            k = self._next_k
            self._next_k += 1
            self._free[k] = (job, stop)
            self._count_training_locked()
        before = len(job.losses)
        try:
            run_free(job, steps, stop.is_set, self if self.plans else None)
        finally:
            with self._lock:
                del self._free[k]
                self.steps_run += len(job.losses) - before
        raise_outcome(job, len(job.losses) - before, steps, stop.is_set())

    def _refuse_training_twice_locked(self, job) -> None:
        if any(member.job is job for member, _ in self._members.values()) or any(
                other is job for other, _ in self._free.values()):
            raise RuntimeError(f"{job!r} is already training: call train() on a job from "
                               "one thread at a time")

    def _probe_capacity(self, probe: MemoryProbe | None, collect: bool = True) -> int | None:
        """On a GPU without a limit: what the allocator can still give plus
        what the session's jobs hold (they are all between steps now), what
        trainers' jobs hold and what its sharing members' accounts hold (in
        their blocks or out): the budget counts those as taken again, so
        they are not taken twice. ``collect``: garbage may be collected
        first (not where a member's pass waits for it)."""
        if probe is None or self.memory_limit is not None:
            return None
        # Jobs of finished trials can outlive them in reference cycles (the
        # first optimizer a process makes is held by torch's import frames):
        # give their tensors back before measuring what is free. Not at every
        # probe (COLLECT_EVERY_S): memory a cycle still holds only counts as
        # taken until a later probe.
        now = time.monotonic()
        if collect and now - self._collected_at >= COLLECT_EVERY_S:
            gc.collect()
            self._collected_at = time.monotonic()
        # Members allocate and free while this reads: their bytes are read
        # before and after the allocator's, the fewer kept. An allocation in
        # between is gone from what the allocator can give and missing from
        # the fewer: the budget comes out smaller by it. A free in between is
        # in both: exact. Never larger than the truth.
        ledger = self.ledger()
        before = ledger.share_stats()["members_live"]
        available = probe.available()
        members = min(before, ledger.share_stats()["members_live"])
        return (available + sum(m.held() for m in list(self._pipelined.values()))
                + sum(hold.bytes for hold in list(self._trainers.values())) + members
                + awaiting_jobs.held_on(self.device))

    def _limit(self) -> int | None:
        if self.plan_schedule.pairing == FREE:
            return None
        return self.memory_limit if self.memory_limit is not None else self._capacity

    def _budget(self, feed: RoundFeed) -> tuple[int | None, int]:
        """(the budget, the bytes held outside the feed: what the session's
        jobs not training in it now hold between their calls, and what the
        sharing members may hold). While members share, the captured jobs
        keep room for their steps side by side and the members share the
        rest; otherwise members that left their blocks hold what they hold."""
        limit = self._limit()
        if limit is None:
            return None, 0
        outside = self._between_calls(feed)
        if self._sharing:
            return limit, max(outside, limit - self._feed_peaks(feed))
        return limit, outside + self.ledger().share_stats()["members_live"]

    def _feed_peaks(self, feed: RoundFeed | None) -> int:
        """The most the jobs training in ``feed`` hold at once side by side."""
        return sum(member.step_peak() for member, f in self._members.values() if f is feed)

    # waterwave.sharing's members (sharing.py) ------------------------------
    def ledger(self) -> _C.ThreadAccounts:
        """The device's thread accounts: its members' bytes and their budget."""
        return _C.cpu_accounts() if self.device == "cpu" else _C.cuda_accounts()

    def join_sharing(self, member, base: int) -> int:
        """A member's block starts (``base``: its model's bytes); returns the
        budget it shares (0: none)."""
        ctrl_c.watch()
        with self._lock:
            if self.device == "cpu":
                self._count_cpu_memory()
                self._sharing[id(member)] = member
            else:
                self._claim_cuda_ledger(member)
                if not self._blocks_kept_whole and cuda.is_installed():
                    cache_splits.keep_large_blocks_whole(cuda.allocator(self.device))
                    self._blocks_kept_whole = True
            self.ledger().join(member.account.id, base)
            if self.device != "cpu" and self.memory_limit is None and self._feed is None:
                # On a GPU with no limit: what the allocator can still give
                # now (the joining member's model counted in the ledger), as a
                # feed's start probes it, at every block's start and not only
                # the first. What threads took outside the members' blocks
                # since (a new trial's model and data, an evaluation) is in no
                # account: a budget probed before it would count that memory
                # as free. (While a feed trains, its jobs' activations are in
                # no account either: the feed's probe stands.)
                self._capacity = self._probe_capacity(MemoryProbe(self.device))
            self._count_training_locked()
            budget = self._share_budget_locked()
            if self._feed is not None:
                self._feed.set_limit(*self._budget(self._feed))
            return budget

    def _claim_cuda_ledger(self, member) -> None:
        """``member`` joins, unless another CUDA device's members share now:
        the CUDA runtime keeps one ledger of thread accounts for every
        device, with one budget, so they would be gated by each other's
        budget. Refused, naming the fix."""
        with _LIVE_LOCK:
            other = next((s for s in list(_LIVE) if s is not self and s.device != "cpu"
                          and s.device != self.device and s._sharing), None)
            if other is not None:
                raise RuntimeError(
                    f"waterwave.sharing on {self.device} while trials share {other.device}: "
                    "Waterwave's thread accounts keep one budget for every CUDA device, so "
                    "sharing runs on one CUDA device of a process at a time; run a process "
                    "per GPU (CUDA_VISIBLE_DEVICES), or train the other device's trials with "
                    "job.train")
            self._sharing[id(member)] = member

    def job_made(self, job, nbytes: int) -> None:
        """``job`` was made on this GPU and holds ``nbytes`` there before its
        first step: counted as taken until it trains (``awaiting_jobs``)."""
        awaiting_jobs.expect(job, self.device, nbytes)
        with self._lock:
            if self._feed is not None:
                self._feed.set_limit(*self._budget(self._feed))
            self._share_budget_locked()

    def probe_sharing_budget(self) -> None:
        """A member's pass starts: on a GPU without a limit, the members'
        budget is probed again. Memory a thread takes outside every block (a
        new trial's model and data, an evaluation) is in no account; probed
        only when blocks start, the budget counted it as free until the next
        block, for an epoch of every member's passes (4 resnet50 trials
        under a 12 GiB cap on an H200 lost 4 of 8 that way with a probe at
        each block's start). At most every ``PASS_PROBE_EVERY_S``. Elsewhere
        (a limit, the CPU, a feed training, whose own probe stands) nothing
        changes."""
        if self.device == "cpu" or self.memory_limit is not None or self._feed is not None:
            return
        now = time.monotonic()
        if now - self._pass_probed_at < PASS_PROBE_EVERY_S:
            return
        with self._lock:
            if self._feed is not None or not self._sharing:
                return
            self._pass_probed_at = now
            self._capacity = self._probe_capacity(MemoryProbe(self.device), collect=False)
            self._share_budget_locked()

    def leave_sharing(self, member) -> None:
        with self._lock:
            self._sharing.pop(id(member), None)
            self.ledger().leave(member.account.id)
            self._share_budget_locked()
            if self._feed is not None:
                self._feed.set_limit(*self._budget(self._feed))

    def _count_cpu_memory(self) -> None:
        """Waterwave's CPU allocator counts the members' CPU tensors; a budget
        needs it."""
        try:
            cpu_allocator.install()
        except BridgeUnavailable as e:
            if self._limit() is not None:
                raise RuntimeError(f"the session of cpu has memory_limit={self.memory_limit}, "
                                   f"which needs Waterwave's CPU allocator to count each "
                                   f"trial's memory, and it is unavailable: {e}") from None

    def _share_budget_locked(self) -> int:
        """The members' budget in the ledger: the session's, less what the
        captured jobs keep (their steps side by side, and what they hold
        between calls). 0: none."""
        limit = self._limit()
        ledger = self.ledger()
        if self.device != "cpu" and not self._sharing and _another_device_shares(self):
            return 0  # the ledger's budget is that device's (_claim_cuda_ledger)
        if limit is None:
            ledger.set_budget(0, 0)
            return 0
        if self.device != "cpu":  # the caching allocator's fragmentation (pass_profile)
            limit = int(limit * (1 - GPU_MARGIN))
        # Without a memory_limit the budget is measured, an estimate of the
        # device's room: a tie lets an allocation ask the device itself.
        ledger.set_budget(limit, self._feed_peaks(self._feed) + self._between_calls(self._feed),
                          measured=self.memory_limit is None)
        return limit

    def _between_calls(self, feed: RoundFeed | None, trainer=None) -> int:
        """What the session's jobs not training in ``feed`` hold between their
        calls, with what the trainers other than ``trainer`` hold."""
        if not self._pipelined and not self._trainers:  # sharing members alone: each block's
            return awaiting_jobs.held_on(self.device)   # start and end reads this
        inside = {id(m) for m, f in self._members.values() if f is feed}
        return sum(m.held() + m.reserve() for m in list(self._pipelined.values())
                   if id(m) not in inside) + sum(
            hold.bytes for t, hold in list(self._trainers.items()) if t is not trainer) + (
            awaiting_jobs.held_on(self.device))

    def _count_training_locked(self) -> None:
        running = sum(hold.running for hold in list(self._trainers.values()))
        self.most_training = max(self.most_training, len(self._members) + len(self._free)
                                 + len(self._other_members_locked()) + running)

    def _other_members_locked(self) -> list:
        """The sharing members that are not a job training here eagerly
        (``_train_free`` makes each of those a member too: one trial, once)."""
        free = {id(job.model) for job, _ in self._free.values()}
        return [m for m in self._sharing.values()
                if getattr(m, "model_ref", None) is None or id(m.model_ref()) not in free]

    # ConcurrentTrainer's fixed sets of jobs (concurrent.py) -----------------
    def hold_for_trainer(self, trainer, held: int, running: int = 0) -> None:
        """``trainer``'s jobs hold ``held`` bytes on this device, ``running``
        of them training now: while it runs, the budget its run plans for;
        between runs, what its jobs keep. Counted against the session's budget
        as what a job keeps between its calls is; 0 bytes: nothing."""
        with self._lock:
            if held > 0:
                self._trainers[trainer] = TrainerHold(held, running)
            else:
                self._trainers.pop(trainer, None)
            self._count_training_locked()
            self._share_budget_locked()
            if self._feed is not None:
                self._feed.set_limit(*self._budget(self._feed))

    def room_for_trainer(self, trainer) -> tuple[int, int] | None:
        """(bytes ``trainer``'s run may hold here, bytes everything else
        here holds): the session's ``memory_limit`` less the jobs training
        in its feed at their step peaks, what the others keep between calls
        (other trainers' jobs among them) and what sharing members hold.
        None where the session sets no limit."""
        with self._lock:
            if self.memory_limit is None:
                return None
            others = (self._feed_peaks(self._feed) + self._between_calls(self._feed, trainer)
                      + self.ledger().share_stats()["members_live"])
            return self.memory_limit - others, others

    def others_training(self, trainer) -> bool:
        """Whether anything trains here now beside ``trainer``: a job, a
        sharing member, another trainer's run."""
        with self._lock:
            return bool(self._members or self._free or self._other_members_locked() or any(
                hold.running for t, hold in list(self._trainers.items()) if t is not trainer))

    def member(self, job) -> PipelinedJob:
        """How this session runs ``job``: its groups, runners and
        measurements, kept from its last call here."""
        with self._lock:
            found = self._pipelined.get(job)
        if found is None:
            raise ValueError(f"{job!r} has not trained in {self!r}")
        return found

    # The whole session ------------------------------------------------------
    def interrupt(self) -> None:
        """Stop every job training here at its next group (Ctrl-C), and every
        sharing member at its next gate or waiting allocation."""
        with self._lock:
            if self._feed is not None:
                self._feed.barrier.close()
                self._feed = None
            for _, stop in self._free.values():
                stop.set()
            if self._sharing:
                self.ledger().interrupt()

    @property
    def training(self) -> list:
        """The jobs training here now (``Job`` objects, and the names of
        sharing members)."""
        with self._lock:
            return [member.job for member, _ in self._members.values()] + [
                job for job, _ in self._free.values()] + [
                m.name for m in self._other_members_locked()]

    def count_put_back(self) -> None:
        """A sharing job's step ran out of memory before its update and was
        undone, to run again alone (``job_loop.run_free``)."""
        with self._lock:
            self.put_back += 1

    def reset_peak(self) -> None:
        """``stats()["peak_bytes"]`` starts again from the members' bytes now."""
        self.ledger().reset_share_peak()

    def stats(self) -> dict:
        with self._lock:
            feed = self._feed
            share = self.ledger().share_stats()
            return {"device": str(self.device), "schedule": self.schedule,
                    "capture": self.capture,
                    "memory_limit": self.memory_limit, "budget": self._capacity
                    if self.memory_limit is None else self.memory_limit,
                    "training": [member.name for member, _ in self._members.values()]
                    + [job.name for job, _ in self._free.values()],
                    "sharing": [m.name for m in self._sharing.values()],
                    "peak_bytes": share["peak"], "members_bytes": share["members_live"],
                    "waits": {k: share[k] for k in ("gate_waits", "allocation_waits",
                                                    "device_waits", "overshoots", "forced",
                                                    "failed", "overdrawn")},
                    "jobs_known": len(self._pipelined), "steps_run": self.steps_run,
                    "put_back": self.put_back,
                    "held_between_calls": self._between_calls(feed),
                    "trainers": [{"training": hold.running, "bytes": hold.bytes}
                                 for hold in list(self._trainers.values())],
                    "most_training": self.most_training,
                    "rounds_planned": None if feed is None else feed.last_round + 1}

    def __repr__(self) -> str:
        return (f"TrainingSession({str(self.device)!r}, schedule={self.schedule!r}, "
                f"memory_limit={self.memory_limit!r}, capture={self.capture!r}, "
                f"training={len(self._members) + len(self._free)})")


@dataclass(frozen=True)
class TrainerHold:
    """What a ``ConcurrentTrainer``'s jobs hold on a session's device."""
    bytes: int
    running: int  # its jobs training now (0 between runs)


# Every session alive, whoever made it: sharing's CUDA ledger is one for all
# devices (TrainingSession._claim_cuda_ledger).
_LIVE: weakref.WeakSet = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _another_device_shares(session: TrainingSession) -> bool:
    with _LIVE_LOCK:
        return any(s is not session and s.device not in ("cpu", session.device) and s._sharing
                   for s in list(_LIVE))


_SESSIONS: dict[str, TrainingSession] = {}
_SESSIONS_LOCK = threading.Lock()


def training_session(device=None, *, memory_limit=_UNSET, schedule=_UNSET, split_size=_UNSET,
                     order=_UNSET, capture=_UNSET) -> TrainingSession:
    """The training session of ``device`` (a ``torch.device`` or its name;
    default: the current CUDA device, else the CPU), made on first use;
    the settings given configure it (see ``TrainingSession``)."""
    key = _device_key(device)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            session = _SESSIONS[key] = TrainingSession(key)
    settings = {name: value for name, value in (("memory_limit", memory_limit),
                                                 ("schedule", schedule), ("split_size", split_size),
                                                 ("order", order), ("capture", capture))
                if value is not _UNSET}
    return session.configure(**settings) if settings else session


def _device_key(device) -> str:
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"not a device: {device!r} ({e}); name one as torch does, e.g. "
                         "'cuda:0' or 'cpu'") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available()
                              else 0)
    return str(device)


def interrupt_all() -> None:
    """Stop every session's jobs at their next group: the devices' sessions
    and any made directly (``TrainingSession(...)``, passed to ``train``)."""
    with _LIVE_LOCK:
        sessions = list(_LIVE)
    for session in sessions:
        session.interrupt()
