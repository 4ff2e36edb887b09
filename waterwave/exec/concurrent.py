"""Several training jobs on one device, their node groups interleaved so
that memory one job frees serves the next job's allocations (the Waterwave
paper's NodeGroup pipeline, sections 4.3 and 4.4): ``waterwave.Job`` and
``waterwave.ConcurrentTrainer``.

Each job's training step is captured once (``step.CapturedStep``) and cut
into node groups (``waterwave.pipeline.nodegroups``). Each job runs on a
worker thread of its own (``workers.py``), on its own CUDA stream when its
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

May import: waterwave.pipeline, waterwave.capturing, waterwave.graph,
waterwave.planner, waterwave.cuda, this package; torch.
"""
from __future__ import annotations

import contextlib
import operator
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import cuda
from ..capturing.optimizers import GradClip
from ..pipeline.counter_barrier import BarrierAborted, CounterBarrier
from ..pipeline.nodegroups import Partition
from ..pipeline.pairing import (
    JobGroups,
    JobPlan,
    MemoryPairing,
    PeriodicRounds,
    graph_plan,
)
from ..pipeline.round_feed import RoundFeed
from ..pipeline.schedules import ALGORITHM1, MEMORY
from ..pipeline.schedules import schedule as named_schedule
from .batches import BatchFeed
from .step import CapturedStep
from .workers import POOL, Task

LOSSES_IN_FLIGHT = 2  # steps whose loss a job reads later (see _job_thread)


class Job:
    """One training job: a model, its loss and its optimizer, and what it
    trains on: ``data``, any re-iterable of ``(inputs..., targets...)``
    batches (a ``DataLoader``, a list), drawn a batch a step and iterated
    again each epoch, the first ``n_inputs`` items of a batch being the
    model's inputs; or, without data, ``example_inputs`` (and ``targets``),
    the batch every step trains on. The loss is
    ``loss_fn(model(*inputs), *targets)``. The step is captured on
    ``example_inputs``, else on the data's first batch (which is then trained
    on first); every batch must have its shapes. ``clip_grad_norm`` and
    ``clip_grad_value`` clip the gradients before each update, as
    ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over the
    model's parameters would."""

    def __init__(self, model, example_inputs: Sequence[Any] | None = None,
                 loss_fn: Callable | None = None, optimizer=None, targets=None,
                 name: str | None = None, data=None, n_inputs: int = 1,
                 clip_grad_norm: float | None = None, clip_grad_value: float | None = None):
        if optimizer is None:
            raise ValueError("a Job needs the optimizer that trains the model")
        device = next((p.device for p in model.parameters()), None)
        self.batches = None if data is None else BatchFeed(data, n_inputs, device)
        if example_inputs is None:
            if self.batches is None:
                raise ValueError("a Job needs data (batches to train on) or example_inputs")
            example_inputs, targets = self.batches.peek()
            targets = targets or None
        self.name = name or type(model).__name__
        clip = GradClip(clip_grad_norm, max_value=clip_grad_value)
        self.step_fn = CapturedStep(model, example_inputs, loss_fn, optimizer, targets, self.name,
                                    clip)
        self.graph = self.step_fn.graph
        self.losses: list[float] = []
        self.error: BaseException | None = None
        self.runner: _GroupRunner | None = None
        self.partition: Partition | None = None
        self.plan: JobPlan | None = None  # its groups' bytes from the graph, for the pairing
        self.measured: list[tuple[int, int]] | None = None  # each group's (net, rise) on a GPU
        self._stream = None

    @property
    def model(self):
        return self.step_fn.model

    @property
    def failed(self) -> bool:
        return self.error is not None

    def stream(self):
        """The job's own CUDA stream (created once), or None on the CPU."""
        if self.step_fn.device != "cuda":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.step_fn.params[0].device)
        return self._stream

    def next_batch(self) -> tuple[tuple, Any]:
        """The inputs and targets of the job's next step: its data's next
        batch, or nothing (the example batch) without data."""
        if self.batches is None:
            return (), None
        inputs, targets = self.batches.next()
        return inputs, targets or None

    def persistent_bytes(self) -> int:
        return sum(t.size for t in self.graph.tensors if t.persistent or t.kind == "input")

    def __repr__(self) -> str:
        state = f"failed: {self.error!r}" if self.failed else f"{len(self.losses)} steps"
        return f"Job({self.name!r}, {state})"


@dataclass
class _Stage:
    """A group's FX nodes and the values to drop once it has run."""
    nodes: list
    drop_after: dict  # node -> values whose last use it is


class _GroupRunner:
    """Runs a captured step's FX graph group by group, in the partition's
    order, dropping each value after its last use (as eager PyTorch frees)."""

    def __init__(self, step: CapturedStep, part: Partition):
        g = step.graph
        # Run node by node (run_group), so a new hyperparameter needs no recompile.
        self.module = step.reorder([g.nodes[v].name for v in part.order], compiled=False)
        group_of = {g.nodes[v].name: k for k, grp in enumerate(part.groups) for v in grp.nodes}
        fx_graph = self.module.graph
        self.placeholders = [n for n in fx_graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in fx_graph.nodes if n.op == "output")
        calls = [n for n in fx_graph.nodes if n.op not in ("placeholder", "output")]
        # Nodes the planner's graph dropped (views) join the group of the
        # next node it kept, the one that needs them.
        assignment, pending = [], []
        for n in calls:
            pending.append(n)
            if n.name in group_of:
                assignment += [(m, group_of[n.name]) for m in pending]
                pending = []
        assignment += [(m, len(part.groups) - 1) for m in pending]
        last_use = {}
        for pos, (n, _) in enumerate(assignment):
            for a in n.all_input_nodes:
                last_use[a] = pos
        kept = set(self.placeholders) | set(self.output.all_input_nodes)
        drops: dict = {}
        for value, pos in last_use.items():
            if value not in kept:
                drops.setdefault(assignment[pos][0], []).append(value)
        self.stages = [_Stage([], {}) for _ in part.groups]
        for n, k in assignment:
            self.stages[k].nodes.append(n)
            if n in drops:
                self.stages[k].drop_after[n] = drops[n]

    def start(self, flat: list) -> dict:
        if len(flat) != len(self.placeholders):
            raise ValueError(f"the step takes {len(self.placeholders)} inputs, got {len(flat)}")
        return dict(zip(self.placeholders, flat))

    def run_group(self, k: int, env: dict) -> None:
        from torch import fx

        for n in self.stages[k].nodes:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = self._call(n, args, kwargs)
            for value in self.stages[k].drop_after.get(n, ()):
                env.pop(value, None)

    def _call(self, n, args, kwargs):
        """One FX node, as ``torch.fx.Interpreter`` runs it. A capture is
        mostly ``call_function`` (aten operators); tensors a loss closes
        over (the targets of ``models.build``'s losses) are ``get_attr``."""
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "get_attr":
            obj = self.module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.module.get_submodule(n.target)(*args, **kwargs)
        raise ValueError(f"the captured step has an FX node {n.name!r} of kind {n.op!r}, "
                         "which the trainer cannot run")

    def finish(self, env: dict):
        from torch import fx

        return fx.node.map_arg(self.output.args[0], env.__getitem__)


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
        job.runner = _GroupRunner(job.step_fn, job.partition)
        job.plan = graph_plan(0, job.graph, job.partition)
        job.measured = None  # its groups are this trainer's: measure them again
        self.jobs.append(job)

    def remove(self, job: Job) -> None:
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
        a pause; each job's losses (all of them since it was made)."""
        try:
            whole = None if isinstance(steps, bool) else operator.index(steps)
        except TypeError:
            whole = None
        if whole is None or whole < 1:
            raise ValueError(f"steps must be a whole number of steps, at least 1; got {steps!r}")
        self._run(whole)
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

    def _budget(self, jobs: list[Job]) -> int | None:
        """The bytes the jobs may hold together: ``memory_limit``; else, on a
        GPU, what the allocator can still give (``_MemoryProbe.available``)
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
            job.step_fn.check_context()
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

        tasks = [POOL.submit(lambda job=job, k=k: self._job_thread(job, feed, k, enter),
                             f"waterwave job {job.name}") for k, job in enumerate(jobs)]
        try:
            _wait(tasks)
        except BaseException:  # Ctrl-C (or another signal's error) in the caller
            # Every job stops at its next group, its step's tensors dropped;
            # nothing trains on behind the caller's back, and the next run
            # starts clean. The jobs' losses keep the steps they finished.
            feed.barrier.close()
            _wait(tasks, interruptible=False)
            raise
        self.rounds_run += 1 + feed.last_round

    def _solo_step(self, job: Job, probe: _MemoryProbe) -> None:
        """One step of ``job`` alone, measuring each group's net bytes and
        rise in the allocator (see the module's opening)."""
        groups = len(job.partition.groups)
        feed = RoundFeed(PeriodicRounds({0: [(0, g) for g in range(groups)]}, 0, 1), [job],
                         CounterBarrier())
        readings: list[tuple[int, int]] = []
        self._job_thread(job, feed, 0, lambda r: None, measure=(probe, readings))
        if not job.failed and len(readings) == groups:
            job.measured = readings

    def _memory_probe(self, jobs: list[Job]) -> _MemoryProbe | None:
        """What measures the jobs' groups: the allocator serving their GPU;
        None on the CPU, where the graph's bytes are what is allocated."""
        cuda_jobs = [j for j in jobs if j.step_fn.device == "cuda"]
        return _MemoryProbe(cuda_jobs[0].step_fn.params[0].device) if cuda_jobs else None

    def _job_thread(self, job: Job, feed: RoundFeed, k: int, enter,
                    measure: tuple[_MemoryProbe, list] | None = None) -> None:
        import torch

        env, step_no = None, -1
        # Each step's loss, read a few steps later: reading a GPU tensor
        # waits for its stream, and the host should stay ahead of the GPU
        # (its queue holds about one step), as the simulator's host does.
        pending: list = []
        stream = job.stream()
        try:
            if stream is not None:  # the model and batch were made on the default stream
                stream.wait_stream(torch.cuda.default_stream(stream.device))
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None
                                   else contextlib.nullcontext()):
                for round_, step, group in feed.entries(k):
                    if step != step_no:
                        flat = job.step_fn.flat_inputs(*job.next_batch())
                        env, step_no = job.runner.start(flat), step
                    feed.barrier.wait(job, round_)
                    enter(round_)
                    if measure is None:
                        job.runner.run_group(group, env)
                    else:
                        probe, readings = measure
                        start = probe.start()
                        job.runner.run_group(group, env)
                        readings.append(probe.since(start))
                    if group == len(job.partition.groups) - 1:
                        pending.append(job.runner.finish(env).detach())
                        env = None
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
        finally:
            env = None  # its tensors go back to the allocator
            try:
                job.losses += [float(x) for x in pending]  # the steps it finished
                if stream is not None:  # the caller reads the parameters on the default stream
                    torch.cuda.default_stream(stream.device).wait_stream(stream)
            except BaseException as e:
                job.error = job.error or e
            feed.leave(k)

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


def _wait(tasks: list[Task], interruptible: bool = True) -> None:
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


class _MemoryProbe:
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

    def since(self, start: int) -> tuple[int, int]:
        """(net bytes, most bytes above ``start``) since ``start()``."""
        now = self.stats.memory_allocated(self.device)
        return now - start, max(0, self.stats.max_memory_allocated(self.device) - start)

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
