"""One job's part of a pipelined run: its (round, step, group) entries from
a round feed, each group run once the barrier lets it, each step's batch
drawn as the step begins; a job's steps run eagerly where nothing is
planned (``run_free``); and what measures a job's groups on a GPU.
``ConcurrentTrainer`` runs the pipelined loop on a pool thread per job, a
training session (``session.py``) either loop on the thread that called
``Job.train``.

A job that raises stops alone: its error is kept (``Job.error``), its
groups leave the barrier, its tensors are dropped, and the others go on.

May import: waterwave.pipeline, waterwave.cuda, waterwave.alloc, this package; torch.
"""
from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import cuda
from ..alloc.settings import fraction_allowing
from ..pipeline.counter_barrier import BarrierAborted
from ..pipeline.pairing import SegmentSpare
from ..pipeline.pass_profile import ALONE_PASSES
from ..pipeline.round_feed import RoundFeed
from . import awaiting_jobs
from .rollback import StepStart, ran_out_of_memory
from .step import grad_mode
from .workers import Task

LOSSES_IN_FLIGHT = 2  # steps whose loss a job reads later (see run_job)


class OwnPeaks(NamedTuple):
    """A stream's own segments' peaks since a start (``MemoryProbe.own_peaks``)."""
    reserved: int
    allocated: int
    small_reserved: int
    small_allocated: int


@dataclass
class Measure:
    """Measure each group of a job's first step in the allocator (``probe``);
    ``report`` gets the (net, rise) of every group, or None if the step did
    not run whole, and the step's segment spare (``segment_spare``)."""
    probe: "MemoryProbe"
    report: Callable[[list[tuple[int, int]] | None, SegmentSpare | None], None]
    readings: list = field(default_factory=list)
    own: list = field(default_factory=list)  # each group's own_peaks

    def segment_spare(self) -> SegmentSpare | None:
        """What the job's stream's own segments held beyond its blocks over
        the step, at their peaks, in all and in the small pool
        (``JobPlan.segment_spare``); None where the allocator does not
        tell."""
        if not self.own or None in self.own:
            return None
        return SegmentSpare.from_peaks(*(max(peaks) for peaks in zip(*self.own)))


def run_job(member, feed: RoundFeed, k: int, enter: Callable[[int], None] | None = None,
            measure: Measure | None = None) -> None:
    """Job k's entries of ``feed``, run in order from ``member`` (a
    ``PipelinedJob``); ``enter(round)`` before each group (SyncAndCoalesce
    between rounds). Returns when its entries end, the barrier closes, or
    the job fails (``job.error``); Ctrl-C on this thread is raised. The job
    leaves the feed on the way out."""
    import torch

    job = member.job
    env, step_no, eager, eager_loss = None, -1, None, None
    # Each step's loss, read a few steps later: reading a GPU tensor
    # waits for its stream, and the host should stay ahead of the GPU
    # (its queue holds about one step), as the simulator's host does.
    pending: list = []
    stream = job.stream()
    last_group = len(member.partition.groups) - 1
    measuring_step = None
    fetching = False
    try:
        if stream is not None:  # the model and batch were made on the default stream
            stream.wait_stream(torch.cuda.default_stream(stream.device))
        with grad_mode(), (torch.cuda.stream(stream) if stream is not None
                           else contextlib.nullcontext()):
            for round_, step, group in feed.entries(k):
                if step != step_no:
                    # Fetching the batch (the user's data loader) and finding
                    # its capture touch no model state: an error here leaves
                    # the job between steps, and its next call may go on.
                    fetching = True
                    inputs, targets = job.next_batch()
                    found = member.step_for(inputs, targets)
                    fetching = False
                    step_no = step
                    if found is None:  # no capture trains this batch: the step runs eagerly
                        eager, env = (inputs, targets), None
                    else:
                        eager, (step_fn, runner) = None, found
                        env = runner.start(step_fn.flat_inputs(inputs, targets))
                    if measure is not None and measuring_step is None:
                        measuring_step = step
                feed.barrier.wait(job, round_)
                if enter is not None:
                    enter(round_)
                if eager is not None:
                    # The whole step in its first group's round; its other
                    # groups' rounds pass through (the barrier's count).
                    if measure is not None and step == measuring_step:
                        measure.report(None, None)
                        measure = None
                    if group == 0:
                        eager_loss = member.eager_step(*eager).detach()
                    if group == last_group:
                        pending.append(eager_loss)
                        eager = eager_loss = None
                        job.after_step()
                        if len(pending) > LOSSES_IN_FLIGHT:
                            job.losses.append(float(pending.pop(0)))
                    feed.barrier.done(job, round_)
                    continue
                if measure is not None and step == measuring_step:
                    start = measure.probe.start()
                    runner.run_group(group, env)
                    measure.readings.append(measure.probe.since(start))
                    measure.own.append(measure.probe.own_peaks(stream))
                    if group == last_group:  # before the next entry is planned
                        measure.report(list(measure.readings), measure.segment_spare())
                        measure = None
                else:
                    runner.run_group(group, env)
                if group == last_group:
                    pending.append(runner.finish(env).detach())
                    env = None
                    job.after_step()
                    if len(pending) > LOSSES_IN_FLIGHT:
                        job.losses.append(float(pending.pop(0)))
                feed.barrier.done(job, round_)
    except BarrierAborted:
        pass
    except KeyboardInterrupt:  # only a job run on the caller's thread gets one: the caller's
        raise
    except BaseException as e:  # the job stops alone, with its error
        # The traceback stays, its frames' tensors go back to the allocator.
        traceback.clear_frames(e.__traceback__)
        job.error = e
        job.error_between_steps = fetching
    finally:
        env = None  # its tensors go back to the allocator
        try:
            if measure is not None:
                measure.report(None, None)
            job.losses += [float(x) for x in pending]  # the steps it finished
            if job.error is None:
                job.forget_skipped_state()
            if stream is not None:  # the caller reads the parameters on the default stream
                torch.cuda.default_stream(stream.device).wait_stream(stream)
        except BaseException as e:
            job.error = job.error or e
        feed.leave(k)


def run_free(job, steps: int, stopped: Callable[[], bool], session=None) -> None:
    """``steps`` of ``job``'s steps on the calling thread, each run eagerly
    as its own loop would run it (``Job.eager_step``): what a session that
    captures nothing does. In ``session`` (one with a budget) the steps run
    in one ``waterwave.sharing`` block, counted and gated with the other
    members, and each step frees its gradients, as a captured step does:
    what a job holds between steps and calls is its parameters and
    optimizer state. There a step that runs out of memory before its
    update (beside the others, whose memory the budget admitted) is undone
    (``rollback.StepStart``) and runs again, the member's next passes alone
    (``ALONE_PASSES``, twice as many at each further undo of the call); one
    that runs out alone, or in its update, stops the job. Stops before a
    step once ``stopped()`` (Ctrl-C); a job that raises keeps its error as in ``run_job``, and Ctrl-C on this
    thread is raised. Each loss is read a few steps later, as ``run_job``
    reads them: on a GPU reading one waits for the device."""
    fetching = False
    pending: list = []
    block = (contextlib.nullcontext() if session is None
             else job.sharing_block(session, told=job.steps_plain))
    try:
        with grad_mode(), block as member:
            if session is not None:  # its model is the member's now, counted there
                awaiting_jobs.trained(job)
            keep_grads = session is None
            plain = job.plain_step(keep_grads, member)
            schedulers = bool(job.step_schedulers)
            undo = StepStart(job) if member is not None and member.gating else None
            keeps_buffers = undo is not None and bool(undo.buffers)
            alone_for = ALONE_PASSES  # passes alone after an undo, doubling at each
            # A CPU's loss is read at once: only a GPU's waits for the device.
            on_cpu = job.device is None or job.device.type == "cpu"
            # After its first step, a step that freed its gradients left
            # them None: the next need not zero them.
            grads_none = False
            done = 0
            while done < steps:
                if stopped():
                    return
                fetching = True
                inputs, targets = job.next_batch()
                fetching = False
                if keeps_buffers:
                    undo.take()
                try:
                    if plain is not None:
                        loss = plain(inputs, targets, grads_none)
                    else:
                        loss = job.eager_step(inputs, targets, keep_grads=keep_grads,
                                              grads_none=grads_none)
                except Exception as e:
                    if undo is None or job.updating or member.alone or not ran_out_of_memory(e):
                        raise
                    # Its forward or backward ran out beside the others: the
                    # step's tensors go with the error's frames, and the
                    # step runs again from where it began, alone.
                    traceback.clear_frames(e.__traceback__)
                    del e
                    inputs = targets = None
                    undo.put_back()
                    member.run_alone(alone_for)
                    alone_for *= 2
                    session.count_put_back()
                    grads_none = True
                    continue
                grads_none = not keep_grads
                done += 1
                if schedulers:
                    job.after_step()
                if on_cpu:
                    job.losses.append(loss.item())
                else:
                    pending.append(loss.detach())
                # The step's loss tensor goes before the next step starts, so
                # that each pass of the member starts from the same bytes.
                loss = None
                if len(pending) > LOSSES_IN_FLIGHT:
                    job.losses.append(float(pending.pop(0)))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the job stops alone, with its error
        traceback.clear_frames(e.__traceback__)
        job.error = e
        job.error_between_steps = fetching
    finally:
        job.updating = False
        try:
            job.losses += [float(x) for x in pending]  # the steps it finished
        except BaseException as e:
            job.error = job.error or e


def raise_outcome(job, done: int, steps: int, interrupted: bool) -> None:
    """After a job's call: its error, or Ctrl-C's if it stopped short. The
    job keeps the error without its traceback (``_without_traceback``)."""
    if job.error is not None:
        error = job.error
        job.error = _without_traceback(error)
        try:
            raise error
        finally:  # this frame, in the error's traceback, holds neither
            del error, job
    if done < steps and interrupted:
        raise KeyboardInterrupt(f"job {job.name!r} stopped after {done} of {steps} steps: "
                                "training was interrupted")


def wait_tasks(tasks: list[Task], interruptible: bool = True) -> None:
    """Wait for the jobs' tasks. A wait with a timeout wakes the caller's
    thread every tenth of a second, so Ctrl-C reaches it as
    ``KeyboardInterrupt`` even where the signal landed on another thread.
    ``interruptible=False``: wait them out whatever arrives meanwhile. An
    error a task let escape (a bug: jobs keep their own) is raised here."""
    for task in tasks:
        while not task.done:
            try:
                task.wait(0.1)
            except KeyboardInterrupt:
                if interruptible:
                    raise
    for task in tasks:
        if task.error is not None:
            raise task.error


class MemoryProbe:
    """Bytes allocated on a GPU, from whichever allocator serves PyTorch
    there: Waterwave's counters when it is installed, torch's otherwise.
    Allocators count a tensor when the host asks for it, so the readings
    need no synchronization."""

    def __init__(self, device):
        if cuda.is_installed():
            self.stats = cuda
        else:
            import torch

            self.stats = torch.cuda
        self.device = device

    def start(self) -> int:
        self.stats.reset_peak_memory_stats(self.device)
        return self.stats.memory_allocated(self.device)

    def own_peaks(self, stream) -> OwnPeaks | None:
        """The reserved and allocated peaks of the segments ``stream``
        reserved since ``start()``, in all and in the small pool: Waterwave's
        allocator counts them
        (``cuda.own_segments``). None under torch's, which does not, and
        where streams do not keep to their own segments (a trainer's run
        holds ``own_segments_first``; elsewhere a job's blocks may sit in
        other streams' segments, and its own say nothing of them)."""
        if (self.stats is not cuda or stream is None
                or not cuda.allocator(self.device).config.own_segments_first):
            return None
        own = cuda.own_segments(stream.cuda_stream, self.device)
        return OwnPeaks(own["reserved_bytes.peak"], own["allocated_bytes.peak"],
                        own["reserved_bytes.small_pool.peak"],
                        own["allocated_bytes.small_pool.peak"])

    def since(self, start: int) -> tuple[int, int]:
        """(net bytes, most bytes above ``start``) since ``start()``."""
        now = self.stats.memory_allocated(self.device)
        return now - start, max(0, self.stats.max_memory_allocated(self.device) - start)

    @contextlib.contextmanager
    def capped_at(self, cap: int):
        """While the block runs, the allocator reserves at most ``cap`` bytes
        in all: its ``per_process_memory_fraction`` lowered to allow exactly
        that where it allowed more, and put back after. What a step beyond
        it asks for raises the allocator's out-of-memory error."""
        _, total = self.stats.mem_get_info(self.device)
        before = self.stats.get_per_process_memory_fraction(self.device)
        lowered = 0 < cap < int(before * total)
        if lowered:
            self.stats.set_per_process_memory_fraction(fraction_allowing(cap, total),
                                                       self.device)
        try:
            yield
        finally:
            if lowered:
                self.stats.set_per_process_memory_fraction(before, self.device)

    def available(self) -> int:
        """Bytes new tensors can still take: the allocator's cached free
        blocks, and what it may still reserve from the driver, within its
        ``per_process_memory_fraction``. (The driver's free memory alone
        misses the cache, and a cap the allocator keeps.)"""
        free, total = self.stats.mem_get_info(self.device)
        reserved = self.stats.memory_reserved(self.device)
        cap = int(self.stats.get_per_process_memory_fraction(self.device) * total)
        cached = reserved - self.stats.memory_allocated(self.device)
        return min(free, max(0, cap - reserved)) + cached


def _without_traceback(error: BaseException) -> BaseException:
    """What a failed job keeps of the error raised to its caller: a copy
    without the traceback, the cause or the context. The raised error's
    traceback gathers the frames that trained the job, and they hold the
    job, its model and its optimizer: kept on the job, that cycle would
    keep a failed trial's memory, counted against every other trial's
    budget, until Python's cycle collector ran (four trials under a CPU
    budget for two all failed so, bench/concurrent/state_fit.py). The
    error itself where its type cannot be copied."""
    import copy

    try:
        kept = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception type whose arguments do not rebuild it
        return error
    kept.__traceback__ = kept.__cause__ = kept.__context__ = None
    return kept
