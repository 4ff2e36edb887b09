"""Several training jobs on one device, their node groups interleaved so
that memory one job frees serves the next job's allocations (the Waterwave
paper's NodeGroup pipeline, sections 4.3 and 4.4): ``ConcurrentTrainer``
trains a fixed set of ``waterwave.Job``s together (``Job.train`` joins the
device's training session instead, ``session.py``). The trainer is that
session's fixed set: its runs may hold the session's ``memory_limit`` less
what the session's other jobs and sharing members hold, or its own
``memory_limit`` where that is less, and the session counts what the
trainer's jobs hold (``TrainingSession.hold_for_trainer``).

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
- ``lockstep``: no barrier at all;
- ``turns``: whole steps in turn, one job at a time;
- ``sequential``: one job's steps after another's;
- ``session``: each job's next step alone, timed (and on a GPU measured
  by the allocator); then side by side where the peaks so measured fit the
  budget together, else the fastest of turns, one job after another and
  the memory pairing, each probed for ``PROBE_STEPS`` steps of every job
  (``pipeline.session_choice``); on a GPU side by side is probed too, for
  ``SIDE_BY_SIDE_PROBE_STEPS``, under the budget set as the allocator's
  cap, a job whose step runs out there put back as it was before the probe
  (``rollback.py``) to train those steps again alone. The choice holds
  until the jobs or the limit change; ``stats()["session"]`` says what ran
  and why.

A run's rounds are planned a window of a few steps at a time, as the jobs
reach them (``pipeline.round_feed``), so ``run(100_000)`` starts at once.

On a GPU the Waterwave allocator (``waterwave.install_allocator()``) serves
every job from one cache, so a block one job frees can serve another's
allocation after an asynchronous stream wait; ``sync_at_barrier`` adds the
paper's SyncAndCoalesce between rounds. A run turns on the allocator's
``own_segments_first`` for its duration unless its settings chose
(``alloc/own_segments.py``): a job takes another's free large-pool memory
only once the GPU (or its cap) is out, so that jobs do not split and pin
one another's segments. Without a memory limit the budget
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
the next run starts clean. A caller off the main thread (a trial of
Optuna's ``n_jobs``) gets it too: Ctrl-C stops every trainer's run
(``interrupt_all``, from ``ctrl_c``), as it stops the training sessions;
``interrupt()`` stops one trainer's.

May import: waterwave.pipeline, waterwave.graph, waterwave.cuda,
waterwave.alloc, this package; torch.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace

from .. import cuda
from ..alloc.own_segments import own_segments_for_run
from ..pipeline.counter_barrier import CounterBarrier
from ..pipeline.pairing import JobGroups, PeriodicRounds, RoundPlanner
from ..pipeline.round_feed import RoundFeed
from ..pipeline.schedules import (
    ALGORITHM1,
    FREE,
    MEMORY,
    SEQUENTIAL,
    SESSION,
    TURNS,
    PairingInput,
    Schedule,
)
from ..pipeline.session_choice import (CPU_PROBES, PROBED, Choice, MeasuredAlone, choose,
                                       guard_chunk)
from . import awaiting_jobs, ctrl_c
from .device_segments import measured_alone, segment_slack
from .job import Job
from .job_loop import Measure, MemoryProbe, run_job, wait_tasks
from .pipeline_settings import PipelineSettings, SettingsView, whole_steps
from .pipelined_job import PipelinedJob, refuse_past_limit
from .rollback import JobCheckpoint, ran_out_of_memory
from .session import training_session
from .workers import POOL

PROBE_STEPS = 2  # steps of every job each way a session probes
# Side by side is probed longer: after a job's step alone made its own
# segments, its blocks are first cached beside the others' in the first
# step, and what fragments shows in the steps after. The simulator's probe
# (sim.schedules.SessionSchedule): 2 steps to settle, 3 timed, from an
# empty cache.
SIDE_BY_SIDE_PROBE_STEPS = 4


class ConcurrentTrainer(SettingsView):
    """Trains ``jobs`` together, their node groups interleaved by
    ``schedule`` (see the module's opening) within ``memory_limit`` bytes.
    ``split_size``: bytes per node group; by default each job's own
    (``nodegroups.auto_split_size``), reported by ``stats()``."""

    def __init__(self, jobs: Sequence[Job], split_size: int | None = None,
                 memory_limit: int | None = None, schedule: str = "waterwave",
                 sync_at_barrier: bool = False, order: str = "bfs"):
        self.settings = PipelineSettings(schedule, memory_limit, split_size, order)
        self.sync_at_barrier = sync_at_barrier
        self.members: list[PipelinedJob] = []  # each job cut into this trainer's groups
        self.rounds_run = 0
        self.syncs = 0
        self.put_back = 0  # jobs put back after their step ran out side by side (rollback.py)
        self.budget: int | None = None  # bytes the last run planned for (None: no limit)
        self._forget_choice()  # the session schedule's choice, until jobs or limit change
        self._running: list[RoundFeed] = []  # the feeds of the run in progress
        self._interrupted = False
        self._running_lock = threading.Lock()
        # What the device's training session leaves this run: (bytes, bytes
        # the others hold there), or None where it sets no limit.
        self._room: tuple[int, int] | None = None
        with _TRAINERS_LOCK:
            _TRAINERS.add(self)
        for job in jobs:
            self.add(job)

    @SettingsView.memory_limit.setter
    def memory_limit(self, value: int | None) -> None:
        """A new limit, for the next run."""
        self.settings = replace(self.settings, memory_limit=value)
        self._forget_choice()

    # Jobs come and go between steps --------------------------------------
    @property
    def jobs(self) -> list[Job]:
        return [m.job for m in self.members]

    def member(self, job: Job) -> PipelinedJob:
        """How this trainer runs ``job``: its groups, runners and measurements."""
        found = next((m for m in self.members if m.job is job), None)
        if found is None:
            raise ValueError(f"{job!r} is not training here: this trainer has "
                             f"{', '.join(m.name for m in self.members) or 'no jobs'}")
        return found

    def add(self, job: Job) -> None:
        if any(m.job is job for m in self.members):
            raise ValueError(f"{job!r} is already training here")
        self.members.append(PipelinedJob(job, self.settings))
        awaiting_jobs.trained(job)  # the trainer's hold counts it from here on
        self._forget_choice()
        self._hold_between_runs()

    def remove(self, job: Job) -> None:
        self.members.remove(self.member(job))
        self._forget_choice()
        self._hold_between_runs()

    # One budget per device: the trainer is its session's fixed set of jobs -
    def _session(self, members: list[PipelinedJob]):
        """The training session of the device the jobs train on (one device:
        jobs on several have no one session's budget to share)."""
        devices = {str(m.job.device) for m in members}
        return training_session(devices.pop()) if len(devices) == 1 else None

    def _hold_between_runs(self) -> None:
        """The device's session counts what the jobs keep between runs."""
        session = self._session(self.members)
        if session is not None:
            session.hold_for_trainer(self, sum(m.held() for m in self.active))

    def _limit(self) -> int | None:
        """The bytes a run may hold: ``memory_limit``, or less where the
        device's session leaves less (``_room``); None: neither limits it."""
        limits = [x for x in (self.memory_limit, None if self._room is None else self._room[0])
                  if x is not None]
        return min(limits) if limits else None

    def _refuse_past_limit(self, members: list[PipelinedJob]) -> None:
        limit = self._limit()
        try:
            refuse_past_limit(limit, members)
        except ValueError as e:
            if self._room is None or limit == self.memory_limit:
                raise
            session = self._session(members)
            raise ValueError(
                f"the training session of {session.device} has memory_limit="
                f"{session.memory_limit:,} bytes, and other jobs and sharing members hold "
                f"{self._room[1]:,} of them, so this trainer may hold {limit:,}: {e}") from None

    @property
    def active(self) -> list[PipelinedJob]:
        return [m for m in self.members if not m.job.failed]

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

    def _planner(self, members: list[PipelinedJob], steps: int,
                 sched: Schedule | None = None) -> RoundPlanner:
        """The run's rounds, planned a window at a time as the jobs need them
        (``pipeline.round_feed``); job k is ``members[k]``. ``sched``: the
        schedule to plan by (the session's chosen pairing), by default the
        trainer's."""
        sched = sched or self.plan_schedule
        limit = self.budget = None if sched.pairing == FREE else self._budget(members)
        jobs = [PairingInput(m.pairing_plan(k),
                             JobGroups(k, m.partition.num_angs, len(m.partition.groups),
                                       m.job.persistent_bytes() + m.partition.peak,
                                       m.partition.split_size))
                for k, m in enumerate(members)]
        return sched.round_planner(steps, limit, jobs, segment_slack=segment_slack(members))

    def _budget(self, members: list[PipelinedJob]) -> int | None:
        """The bytes the jobs may hold together: ``memory_limit``, or what
        the device's session leaves where that is less (``_limit``); else, on
        a GPU, what the allocator can still give (``MemoryProbe.available``)
        plus what the jobs hold already; else (the CPU) no limit."""
        limit = self._limit()
        if limit is not None:
            return limit
        probe = self._memory_probe(members)
        if probe is None:
            return None
        return probe.available() + sum(m.plan.persistent for m in members)

    def _run(self, steps: int) -> None:
        members = self.active
        if not members:
            return
        ctrl_c.watch()
        self._interrupted = False
        for m in members:  # on the caller's thread: its train/eval mode, autocast, hooks
            m.job.check_context()
        for i, m in enumerate(self.members):  # a job trained elsewhere since: cut again
            if not m.current:
                self.members[i] = PipelinedJob(m.job, self.settings)
        members = self.active
        session = self._session(members)
        room = session.room_for_trainer(self) if session is not None else None
        self._room = None if room is None else (max(0, room[0]), room[1])
        if self.plan_schedule.pairing in (MEMORY, ALGORITHM1, TURNS, SEQUENTIAL, SESSION):
            self._refuse_past_limit(members)
        for m in members:  # every check passed: nothing is touched by a refused run
            m.step_fn.clear_step_outputs()
        if session is None:
            self._run_steps(members, steps)
            return
        # The session counts the run's limit, at most every step side by
        # side (all of them where nothing limits the run: a GPU's free
        # memory is probed once, by the planner), while it runs; what the
        # jobs keep after it.
        peaks = sum(m.step_peak() for m in members)
        limit = None if self.plan_schedule.pairing == FREE else self._limit()
        session.hold_for_trainer(self, peaks if limit is None else min(limit, peaks),
                                 len(members))
        try:
            self._run_steps(members, steps)
        finally:
            self._hold_between_runs()

    def _run_steps(self, members: list[PipelinedJob], steps: int) -> None:
        with self._own_segments(members):
            self._run_steps_as_planned(members, steps)

    def _own_segments(self, members: list[PipelinedJob]):
        """For the run: each job's stream keeps to its own large segments
        until the GPU is out, unless the allocator's settings chose
        (``alloc/own_segments.py``)."""
        on_cuda = [m for m in members if m.step_fn.device == "cuda"]
        if not on_cuda or not cuda.is_installed():
            return contextlib.nullcontext(False)
        return own_segments_for_run(cuda.allocator(on_cuda[0].step_fn.params[0].device))

    def _run_steps_as_planned(self, members: list[PipelinedJob], steps: int) -> None:
        if self.plan_schedule.pairing == SESSION:
            self._run_session(members, steps)
            return
        probe = self._memory_probe(members) if self.plan_schedule.pairing == MEMORY else None
        if probe is not None and any(m.measured is None for m in members):
            # Every job's next step alone, so that all keep the same count.
            for m in members:
                self._solo_step(m, probe)
            steps -= 1
            members = self.active
            if not steps or not members:
                return
        self._run_rounds(members, steps)

    def _run_rounds(self, members: list[PipelinedJob], steps: int,
                    sched: Schedule | None = None) -> None:
        """``steps`` steps of every one of ``members``, in the rounds ``sched``
        (by default the trainer's schedule) pairs them into."""
        feed = RoundFeed(self._planner(members, steps, sched), [m.job for m in members],
                         CounterBarrier())
        boundary = threading.Lock()
        opened = [0]  # the highest round SyncAndCoalesce has run before

        def enter(round_: int) -> None:
            if self.sync_at_barrier and round_ > opened[0]:
                with boundary:
                    if round_ > opened[0]:
                        self._sync_and_coalesce(members)
                        opened[0] = round_

        with self._tracked(feed):
            tasks = [POOL.submit(lambda m=m, k=k: run_job(m, feed, k, enter),
                                 f"waterwave job {m.name}") for k, m in enumerate(members)]
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

    @contextlib.contextmanager
    def _tracked(self, feed: RoundFeed):
        """``feed`` runs while the block runs, for ``interrupt()`` to stop;
        after it, a run ``interrupt()`` stopped raises ``KeyboardInterrupt``
        in the caller."""
        with self._running_lock:
            if self._interrupted:
                feed.barrier.close()
            self._running.append(feed)
        try:
            yield
        finally:
            with self._running_lock:
                self._running.remove(feed)
        if self._interrupted:
            raise KeyboardInterrupt("the trainer's run stopped: training was interrupted")

    def interrupt(self) -> None:
        """Stop the run in progress at its jobs' next groups (Ctrl-C): its
        caller gets ``KeyboardInterrupt``, and the next run starts clean."""
        with self._running_lock:
            self._interrupted = True
            for feed in self._running:
                feed.barrier.close()

    def _run_session(self, members: list[PipelinedJob], steps: int) -> None:
        """The session schedule (see the module's opening): measure and
        probe, a run's steps at a time, until a choice holds; then run the
        chosen pairing."""
        limit = self._budget(members) if self.choice is None else None
        while self.choice is None and steps > 0 and members:
            if self._alone is None:  # each job's next step alone, timed
                probe, alone = self._memory_probe(members), []
                for m in members:
                    start = self._clock(members)
                    self._solo_step(m, probe)
                    seconds = self._clock(members) - start
                    alone.append(measured_alone(m, seconds))
                self._alone = alone
                steps -= 1
            else:
                pending = [p for p in self._probed(members) if p not in self._probes]
                if choose(self._alone, limit).pairing == FREE or not pending:
                    self.choice = choose(self._alone, limit, self._probes or None)
                    # Side by side chosen from its probe runs guarded.
                    self._guarding = self.choice.pairing == FREE and FREE in self._probes
                    break
                n = min(SIDE_BY_SIDE_PROBE_STEPS if pending[0] == FREE else PROBE_STEPS, steps)
                if pending[0] == MEMORY and not self._planner(
                        members, n, replace(self.plan_schedule, pairing=MEMORY)).fits:
                    # The budget holds no job's step beside what all hold
                    # (segments counted): the pairing would run past it.
                    self._probes[MEMORY] = None
                    continue
                if pending[0] == FREE:
                    self._probes[FREE] = self._probe_side_by_side(members, n, limit)
                else:
                    start = self._clock(members)
                    self._run_rounds(members, n, replace(self.plan_schedule, pairing=pending[0]))
                    self._probes[pending[0]] = len(members) * n / max(
                        self._clock(members) - start, 1e-9)
                steps -= n
            members = self.active
        if steps > 0 and members and self.choice is not None and self._guarding:
            steps = self._run_guarded(members, steps)
            members = self.active
        if steps > 0 and members and self.choice is not None:
            self._run_rounds(members, steps, replace(self.plan_schedule,
                                                     pairing=self.choice.pairing))

    def _run_guarded(self, members: list[PipelinedJob], steps: int) -> int:
        """Side by side chosen from its probe: its steps run in chunks as
        the probe ran (``_side_by_side_put_back``), ``guard_chunk`` steps
        each: short ones first, then each twice the last. Where a job's step
        runs out, it is put back to its chunk's start and trains the chunk
        again alone; side by side no longer counts as fitting, and the
        choice falls to the fastest of the other probes. Returns the steps
        left (none, unless side by side was dropped)."""
        limit = self._budget(members)
        while steps > 0 and members and self._guarding:
            n = min(guard_chunk(self._guarded), steps)
            ran = self._side_by_side_put_back(members, n, limit)
            steps -= n
            members = self.active
            if ran is None:
                self._probes[FREE] = None
                self.choice = choose(self._alone, limit, self._probes)
                self._guarding = False
                break
            self._guarded += n
        return steps

    def _probed(self, members: list[PipelinedJob]) -> tuple[str, ...]:
        """The ways the session probes where memory binds: every one where
        the jobs train on a GPU, whose allocator holds the budget as its cap
        while side by side is probed; on the CPU nothing holds a budget, so
        side by side runs only where the peaks fit (``CPU_PROBES``). Nor is
        it probed while anything else trains on the device (a sharing
        member, a job, another trainer): the cap counts what the rest of the
        process holds as the probe starts, and what they allocate beyond it
        meanwhile could meet the cap, in a step that cannot be put back."""
        if not all(m.step_fn.device == "cuda" for m in members):
            return CPU_PROBES
        session = self._session(members)
        if session is not None and session.others_training(self):
            return CPU_PROBES
        return PROBED

    def _probe_side_by_side(self, members: list[PipelinedJob], steps: int,
                            limit: int | None) -> float | None:
        """``steps`` steps of every job side by side, timed (samples per
        second; None where a job's step ran out of memory and was put back,
        ``_side_by_side_put_back``)."""
        seconds = self._side_by_side_put_back(members, steps, limit)
        return None if seconds is None else len(members) * steps / max(seconds, 1e-9)

    def _side_by_side_put_back(self, members: list[PipelinedJob], steps: int,
                               limit: int | None) -> float | None:
        """``steps`` steps of every job side by side, the allocator capped
        at ``limit`` bytes for the jobs beside what the rest of the process
        holds (where nothing else trains on the device); their seconds. None
        where a job's step ran out of memory: each such job is put back as
        it was before (``rollback.JobCheckpoint``: its parameters, buffers,
        optimizer state, schedulers and batches) and trains those steps
        again alone, one job after another, as measured alone it fits."""
        self._clock(members)  # the jobs' queued work ends before their state is copied
        kept = [JobCheckpoint(m.job) for m in members]
        try:
            start = self._clock(members)
            with self._capped(members, limit):
                self._run_rounds(members, steps, replace(self.plan_schedule, pairing=FREE))
            seconds = self._clock(members) - start
        except BaseException:  # Ctrl-C: the steps the others finished stand
            self.put_back += len(_put_back_those_out_of_memory(members, kept))
            raise
        ran_out = _put_back_those_out_of_memory(members, kept)
        self.put_back += len(ran_out)
        if not ran_out:
            return seconds
        self._run_rounds(ran_out, steps, replace(self.plan_schedule, pairing=SEQUENTIAL))
        return None

    def _capped(self, members: list[PipelinedJob], limit: int | None):
        """While the block runs, the jobs' allocator reserves at most
        ``limit`` bytes beside what the process holds outside the jobs (all
        it holds less what the jobs hold between steps); no cap where no
        limit is set (the device's own memory bounds the jobs)."""
        probe = self._memory_probe(members)
        session = self._session(members)
        if limit is None or probe is None or (session is not None
                                              and session.others_training(self)):
            return contextlib.nullcontext()
        outside = max(0, probe.stats.memory_allocated(probe.device)
                      - sum(m.held() for m in members))
        return probe.capped_at(outside + limit)

    def _forget_choice(self) -> None:
        """The session schedule measures and chooses again (the jobs or the
        limit changed)."""
        self.choice: Choice | None = None
        self._alone: list[MeasuredAlone] | None = None
        self._probes: dict[str, float | None] = {}
        self._guarding = False  # side by side chosen from its probe: it runs guarded
        self._guarded = 0       # the steps it has run guarded

    def _clock(self, members: list[PipelinedJob]) -> float:
        """Seconds, once the jobs' queued GPU work has ended."""
        devices = {m.step_fn.params[0].device for m in members if m.step_fn.device == "cuda"}
        if devices:
            import torch

            for device in devices:
                torch.cuda.synchronize(device)
        return time.perf_counter()

    def _solo_step(self, member: PipelinedJob, probe: MemoryProbe | None) -> None:
        """One step of a job alone, measuring each group's net bytes and rise
        in the allocator (see the module's opening); on the CPU (no
        ``probe``) the graph's bytes stand."""
        groups = len(member.partition.groups)
        feed = RoundFeed(PeriodicRounds({0: [(0, g) for g in range(groups)]}, 0, 1),
                         [member.job], CounterBarrier())

        def report(readings, spare):
            if readings is not None and len(readings) == groups:
                member.measured, member.segment_spare = readings, spare

        with self._tracked(feed):
            run_job(member, feed, 0, measure=None if probe is None else Measure(probe, report))

    def _memory_probe(self, members: list[PipelinedJob]) -> MemoryProbe | None:
        """What measures the jobs' groups: the allocator serving their GPU;
        None on the CPU, where the graph's bytes are what is allocated."""
        on_cuda = [m for m in members if m.step_fn.device == "cuda"]
        return MemoryProbe(on_cuda[0].step_fn.params[0].device) if on_cuda else None

    def _sync_and_coalesce(self, members: list[PipelinedJob]) -> None:
        if cuda.is_installed() and any(m.step_fn.device == "cuda" for m in members):
            cuda.sync_and_coalesce()
            self.syncs += 1

    def stats(self) -> dict:
        """Per job: node groups (and how many allocate), the split size,
        steps run, whether its step was measured alone and its segment
        spare in bytes, in all and in the small pool (``segment_spare`` and
        ``small_pool_spare``: ``JobPlan.segment_spare``; None where not
        measured), and the
        error of a job that failed; the bytes the last run
        planned for (``budget``: the memory limit, or on a GPU without one
        what the allocator could give); how many times a job whose step ran
        out of memory side by side was put back (``put_back``: in a probe or
        a guarded run of the session schedule); and the allocator's
        statistics where the Waterwave allocator serves the jobs."""
        out = {"schedule": self.schedule, "memory_limit": self.memory_limit, "budget": self.budget,
               "split_size": self.split_size, "split_size_chosen": self.split_size is None,
               "sync_at_barrier": self.sync_at_barrier, "syncs": self.syncs,
               "rounds_run": self.rounds_run, "put_back": self.put_back, "jobs": [],
               "session": None if self.choice is None else {
                   "ran": self.choice.pairing, "why": self.choice.why}}
        for m in self.members:
            j, p = m.job, m.partition
            out["jobs"].append({"name": j.name, "steps": len(j.losses), "groups": len(p.groups),
                                "allocation_groups": sum(g.kind == "ANG" for g in p.groups),
                                "split_size": p.split_size, "partition": p.how,
                                "measured": m.measured is not None,
                                "segment_spare": (None if m.segment_spare is None
                                                  else m.segment_spare.total),
                                "small_pool_spare": (None if m.segment_spare is None
                                                     else m.segment_spare.small_pool),
                                "error": None if j.error is None else repr(j.error)})
        if cuda.is_installed() and any(j.step_fn.device == "cuda" for j in self.jobs):
            out["allocator"] = cuda.memory_stats()
        return out


def _put_back_those_out_of_memory(members: list[PipelinedJob],
                                  kept: list[JobCheckpoint]) -> list[PipelinedJob]:
    """Each job of ``members`` whose step ran out of memory put back from
    its checkpoint in ``kept`` (returned, in order); the others keep their
    steps, and their checkpoints go."""
    ran_out = []
    for m, checkpoint in zip(members, kept):
        if ran_out_of_memory(m.job.error):
            checkpoint.restore()
            ran_out.append(m)
        else:
            checkpoint.release()
    return ran_out


# Every trainer alive, for Ctrl-C to stop (ctrl_c).
_TRAINERS: weakref.WeakSet = weakref.WeakSet()
_TRAINERS_LOCK = threading.Lock()


def interrupt_all() -> None:
    """Stop every trainer's run in progress at its jobs' next groups."""
    with _TRAINERS_LOCK:
        trainers = list(_TRAINERS)
    for trainer in trainers:
        trainer.interrupt()
