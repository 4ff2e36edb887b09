"""Several training jobs on one simulated GPU, each on its own stream: the
instrument every concurrent schedule is developed and checked on.

The host is modelled as PyTorch runs it (Waterwave paper, section 3):

- Each job has a Python thread for its forward and optimizer operators.
  Threads take the GIL in turns, as PyTorch's do: only for an operator's
  Python glue (``GIL_US``), since PyTorch's bindings release it around the
  operator itself; so jobs' operators interleave finely, as the H100
  snapshot of two lockstep jobs shows. Backward operators run on the
  autograd engine's device thread, one for the whole GPU, shared by all
  jobs, without the GIL: one job's backward runs beside another's forward.
- A library kernel's first call in a host thread costs milliseconds
  (``Op.first_us``; cuDNN caches its plans per thread).
- The host schedules ahead of the GPU: a kernel is queued when its operator
  runs on the host, and memory is allocated and freed then, at scheduling
  time. A stream holds at most ``queue_depth`` unfinished kernels; a launch
  into a full queue blocks the host until the oldest kernel ends.
- The GPU runs one kernel at a time, in launch order across streams
  (``SimDevice(shared_compute=True)``): the kernels of a training step each
  fill the GPU. With ``concurrent_kernels``, kernels of different streams
  run at once while their SM and bandwidth shares (``Op.sm``, ``Op.bw``)
  fit (``SimDevice.set_concurrent_kernels``); the busy share then weighs
  each kernel's time by its SM share.

Policies: ``pytorch`` (stream-private pools; out of memory releases cached
segments after synchronizing, and retries, as native PyTorch does),
``waterwave``, and ``free-at-completion`` (what Zico does: a tensor is freed
when the kernels that used it have finished, under the waterwave policy).
Out of memory is a result (``ok`` false, ``oom`` says where), not an error.

May import: waterwave._C, waterwave.alloc, waterwave.pipeline, this package.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import asdict, dataclass, field

from .. import _C
from ..alloc import POLICIES, Allocator, AllocatorConfig, cache_splits, fraction_allowing
from .gpus import GPU
from .gpus import gpu as named_gpu
from ..pipeline.pass_profile import ALONE_PASSES, GPU_MARGIN, with_slack
from .schedules import GatedSegment, Segment, SegmentSchedule, SessionSchedule
from .schedules import schedule as named_schedule
from .trace import Op, Trace

# The allocator's policies, and one the simulator adds over the waterwave
# policy: a tensor is freed when its last kernel completes.
FREE_AT_COMPLETION = "free-at-completion"
SIMULATED_POLICIES = (*POLICIES, FREE_AT_COMPLETION)
GIL_US = 3.0        # Python glue per operator, under the GIL
QUEUE_DEPTH = 1024  # kernels a stream holds before a launch blocks
GIL, ENGINE = 0, 1  # where an operator runs: its job's thread, or the autograd engine
MIN_WINDOW_US = 1.0  # the shortest steady window a throughput is measured over


@dataclass
class SimResult:
    ok: bool
    policy: str
    schedule: str
    gpu: str
    memory_limit: int | None
    jobs: list[str]
    batch_sizes: list[int | None]
    steps: int
    oom: dict | None = None
    peak_reserved: int = 0
    peak_allocated: int = 0
    step_time_us: list[float | None] = field(default_factory=list)  # per job
    throughput: float | None = None  # samples per second, all jobs, in steady steps
    # When the last job's last step ended on the device (the simulated clock
    # from the start): the whole run's length, first steps and the jobs'
    # unequal ends included.
    elapsed_us: float | None = None
    first_step_us: list[float | None] = field(default_factory=list)  # when each job's first ended
    gpu_busy: float | None = None    # the GPU's busy share over the same time
    syncs: int = 0
    stream_waits: int = 0
    hazards: int = 0
    # Of the schedule's rounds, the fraction in which two jobs or more run:
    # 1 when jobs run side by side throughout, 0 when they take turns.
    shared_rounds: float = 1.0
    concurrent_kernels: bool = False  # kernels of different jobs ran at once where they fit
    order: str | None = None  # a node-group schedule's operator order (bfs, program), if it chose
    config: str = ""  # the allocator settings it ran under, as given
    # The sharing schedule's budget figures: the most its members held at
    # once as counted, gate waits, ties broken (csrc/runtime/shared_budget.cpp).
    sharing: dict | None = None
    # The session schedule's choice: its pairing, why, and the rates compared.
    session: dict | None = None
    stats: dict = field(default_factory=dict)
    # Memory over time: host time, reserved bytes, and each job's allocated bytes.
    time_us: list[float] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    per_job: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict:
        """Everything but the memory timeline, for JSON and tables."""
        return {k: v for k, v in self.__dict__.items()
                if k not in ("time_us", "reserved", "per_job", "stats")}


@dataclass
class _Thread:
    """A job's host thread: where it is in its segments."""
    job: int
    stream: int
    segments: list[Segment]
    seg: int = 0
    op: int = 0      # next operator within the segment
    ready: float = 0.0
    done: bool = False

    def segment(self) -> Segment | None:
        return self.segments[self.seg] if self.seg < len(self.segments) else None


def simulate(jobs: list[Trace], gpu: GPU | str = "H100-80GB", memory_limit: int | None = None,
             schedule: str | SegmentSchedule = "lockstep", policy: str = "pytorch", steps: int = 3,
             config: str | AllocatorConfig = "", sync_at_barrier: bool = False, record: bool = True,
             queue_depth: int = QUEUE_DEPTH, concurrent_kernels: bool = False,
             warm: bool = False, undo_steps: bool = True,
             sharing_margin: float = GPU_MARGIN) -> SimResult:
    """Run ``steps`` steps of each job (a one-step trace, stream 0) on its own
    stream of ``gpu`` under ``policy`` and ``schedule``, within
    ``memory_limit`` bytes (default: the GPU's memory). ``sync_at_barrier``:
    SyncAndCoalesce when a round of the schedule opens. ``concurrent_kernels``:
    the GPU runs kernels of different jobs at once while their shares fit.
    ``warm``: the host threads have made their library kernels' first calls
    before the run (as after a session's first steps), so none pays for
    them. ``undo_steps``: a ``sharing`` job's step that the device refuses
    before its update is undone and runs again alone, as ``job.train``'s
    steps are; False for loops in ``ww.sharing`` blocks, which nothing
    undoes (the job fails). ``sharing_margin``: the share of the budget
    ``sharing`` jobs leave to the allocator's fragmentation (the runtime's
    on a GPU by default; another, to see what it costs or saves)."""
    if not 0 <= sharing_margin < 1:
        raise ValueError(f"sharing_margin {sharing_margin}: a share of the budget, from 0 "
                         "up to (not including) 1")
    if policy not in SIMULATED_POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(SIMULATED_POLICIES)}")
    if not jobs:
        raise ValueError("simulate needs at least one job")
    spec = named_gpu(gpu) if isinstance(gpu, str) else gpu
    sched = named_schedule(schedule, memory_limit or spec.memory)
    # A cap works as on the GPU: per_process_memory_fraction of the whole
    # device, whose free memory is never fragmented (the driver maps pages).
    settings = AllocatorConfig(config) if isinstance(config, str) else config
    if memory_limit is not None:
        if not 0 < memory_limit <= spec.memory:
            raise ValueError(f"memory limit {memory_limit} bytes is not within {spec.name}'s "
                             f"{spec.memory} bytes")
        settings = settings.replace(
            per_process_memory_fraction=fraction_allowing(memory_limit, spec.memory))
    device = _C.SimDevice(spec.memory, 0.0, True)
    device.set_concurrent_kernels(concurrent_kernels)
    alloc = Allocator("pytorch" if policy == "pytorch" else "waterwave", device, settings)
    name = getattr(sched, "__name__", str(schedule))
    choice = None
    if isinstance(sched, SessionSchedule):
        def probe(traces, chosen, n):
            # A session probes once its jobs' first steps have run: their
            # threads have made their library kernels' first calls.
            return simulate(traces, spec, memory_limit, chosen, policy, n, config, sync_at_barrier,
                            False, queue_depth, concurrent_kernels, warm=True)
        sched, choice = sched.decide(jobs, probe)
    segments = sched(jobs, steps)
    _check_order(jobs, segments)
    if any(isinstance(s, GatedSegment) for thread in segments for s in thread):
        # Sharing members: large cached blocks kept whole, as a session on a
        # GPU keeps them (alloc/cache_splits.py), unless the config chose.
        cache_splits.keep_large_blocks_whole(alloc)
    run = _Run(jobs, segments, alloc, device, policy, sync_at_barrier, record, queue_depth,
               budget=memory_limit or spec.memory, warm=warm, undo_steps=undo_steps,
               margin=sharing_margin)
    result = SimResult(True, policy, name, spec.name,
                       memory_limit, [t.name for t in jobs],
                       [t.meta.get("batch_size") for t in jobs], steps,
                       shared_rounds=_shared_rounds(segments),
                       concurrent_kernels=concurrent_kernels,
                       config=config if isinstance(config, str) else str(config),
                       session=None if choice is None else asdict(choice))
    try:
        run.go()
    except _C.OutOfMemoryError as e:
        result.ok = False
        job = run.current
        result.oom = {"job": job, "name": jobs[job].name if job is not None else None,
                      "time_us": device.now(), "message": str(e)}
    run.report(result)
    return result


def _check_order(jobs: list[Trace], segments: list[list[Segment]]) -> None:
    """A schedule runs each job's operators in their order: rounds never go
    back, steps follow each other, and a step's segments follow each other
    within its trace. One that does not would replay frees before their
    allocations: it is refused, naming the first segment out of place."""
    for t, segs in zip(jobs, segments):
        prev = None
        for seg in segs:
            if not 0 <= seg.first <= seg.last <= len(t.ops):
                raise ValueError(f"schedule: job {t.name!r} has a segment {seg} outside its "
                                 f"{len(t.ops)} operators")
            if prev is not None and (seg.round < prev.round or seg.step < prev.step or (
                    seg.step == prev.step and seg.first < prev.last)):
                raise ValueError(f"schedule: job {t.name!r} runs {seg} after {prev}: a job's "
                                 "segments must follow its steps and operators in order")
            prev = seg


def _shared_rounds(segments: list[list[Segment]]) -> float:
    jobs_in: dict[int, set[int]] = {}
    for j, segs in enumerate(segments):
        for seg in segs:
            jobs_in.setdefault(seg.round, set()).add(j)
    if len(segments) < 2 or not jobs_in:
        return 1.0 if len(segments) >= 2 else 0.0
    return sum(len(js) > 1 for js in jobs_in.values()) / len(jobs_in)


class _Run:
    def __init__(self, jobs, segments, alloc, device, policy, sync_at_barrier, record,
                 queue_depth, budget: int = 0, warm: bool = False, undo_steps: bool = True,
                 margin: float = GPU_MARGIN):
        self.jobs, self.alloc, self.device, self.policy = jobs, alloc, device, policy
        self.warm = warm  # first calls paid before the run
        self.sync_at_barrier, self.record, self.queue_depth = sync_at_barrier, record, queue_depth
        self.threads = [_Thread(j, j, segs) for j, segs in enumerate(segments)]
        self.persistent_at = [t.persistent_at() for t in jobs]
        self.ptr: list[dict] = [{} for _ in jobs]  # (step, block) -> address
        self.kept: list[dict] = [{} for _ in jobs]  # persistent block -> address
        self.job_bytes = [0] * len(jobs)
        self.sizes: dict[int, int] = {}            # address -> bytes, for job_bytes
        self.gil_free = 0.0     # when the GIL is next free
        self.engine_free = 0.0  # when the autograd engine thread is next free
        self.queues = [deque() for _ in jobs]      # unfinished kernels' end times, per stream
        # Each job's kernels, in order: end times, and the GPU time of its
        # kernels up to each one: how far a job had come at any moment.
        self.kernel_ends: list[list[float]] = [[] for _ in jobs]
        self.work_by: list[list[float]] = [[] for _ in jobs]
        # work_by weighed by each kernel's SM share: work_by itself when kernels
        # run one at a time (each takes the whole GPU)
        self.concurrent = device.concurrent_kernels
        self.busy_by: list[list[float]] = [[] for _ in jobs] if self.concurrent else self.work_by
        self.deferred: list[tuple[float, int, int]] = []  # (due, job, address)
        self.step_ends: list[dict[int, float]] = [{} for _ in jobs]
        self.called: set = set()  # (host thread, operator) pairs past their first call
        self.round = min((s.round for t in self.threads for s in t.segments), default=0)
        self.current = None
        self.time, self.reserved, self.per_job = [], [], [[] for _ in jobs]
        # Gated segments (the sharing schedule): each job a member of a
        # shared budget of its own, whose gates admit its segments.
        self.ledger = None
        if any(isinstance(s, GatedSegment) for t in self.threads for s in t.segments):
            self.ledger = _C.ThreadAccounts()
            self.ledger.set_budget(int(budget * (1 - margin)))
            self.accounts = [self.ledger.open() for _ in jobs]
            for account in self.accounts:
                self.ledger.join(account, 0)
            self.admitted = [-1] * len(jobs)  # each thread's segment its gate admitted
        # Sharing jobs the device ran out for, as the runtime's members wait
        # for each other's frees (ThreadAccounts::wait_for_frees): job ->
        # (frees seen when it began waiting, the device's error).
        self.frees = 0
        self.device_waiting: dict[int, tuple[int, Exception]] = {}
        # Jobs the device refused and that have not allocated since: while
        # one is and a third job is in the middle of a step, the others'
        # steps do not start (ThreadAccounts holds their boundaries), so
        # that what that step frees comes back to it.
        self.device_refused: set[int] = set()
        self.device_waits = 0
        # Sharing jobs one of whose steps the device ran out for before its
        # update, undone and run again: their next steps run alone, as many
        # as alone_left says, twice as many at each further undo
        # (job_loop.run_free, Member.run_alone; a job's call is the run).
        self.alone: set[int] = set()
        self.alone_left: dict[int, int] = {}
        self.alone_for: dict[int, int] = {}
        self.put_back = 0
        self.undo_steps = undo_steps

    # The event loop --------------------------------------------------------
    def go(self) -> None:
        for j, t in enumerate(self.jobs):
            self.current = j
            for b, n, s in self.persistent_at[j].get(-1, []):
                self.kept[j][b] = self._alloc(j, n)
        self._open_round()
        while True:
            pick = self._next()
            if pick is None and self.ledger is not None and not all(t.done for t in self.threads):
                # Every job waits at a gate: asked again, the budget breaks
                # the tie (one goes on), as it does for threads.
                for _ in range(len(self.threads) + 1):
                    pick = self._next()
                    if pick is not None:
                        break
                if pick is None and self.device_waiting:
                    # Every job waits, one of them for the device: it fails,
                    # as the runtime fails one member when all of them wait;
                    # its step is undone where its update has not begun.
                    job, (_, error) = next(iter(self.device_waiting.items()))
                    if self._put_back(job):
                        continue
                    self.current = job
                    raise error
                if pick is None:
                    raise RuntimeError("every sharing job waits at a gate and none is admitted")
            if pick is None:
                if all(t.done for t in self.threads):
                    return
                # Every thread waits at the barrier: the next round opens when
                # the last one arrives.
                arrived = max(t.ready for t in self.threads)
                for t in self.threads:
                    t.ready = max(t.ready, arrived)
                self.round += 1
                self._open_round()
                continue
            thread, start = pick
            self._step(thread, start)

    def _open_round(self) -> None:
        if self.sync_at_barrier and self.round > 0:
            self.alloc.sync_and_coalesce()
        for t in self.threads:
            self._settle(t)

    def _settle(self, t: _Thread) -> None:
        seg = t.segment()
        while seg is not None and t.op >= seg.last - seg.first:
            t.seg, t.op = t.seg + 1, 0
            seg = t.segment()
        if seg is None and not t.done and self.ledger is not None:
            self.ledger.leave(self.accounts[t.job])
        t.done = seg is None

    def _runnable(self, t: _Thread) -> bool:
        seg = t.segment()
        if seg is None or seg.round > self.round:
            return False
        if t.job in self.device_waiting:  # until another job frees, then it tries again
            if self.device_waiting[t.job][0] == self.frees:
                return False
            del self.device_waiting[t.job]
        if self.ledger is None or t.op or self.admitted[t.job] == t.seg or not seg.gate:
            return True
        if t.job in self.alone:
            if not seg.boundary:
                return True  # a pass alone has no gate inside
            if self.alone_left[t.job] <= 0:
                self.alone.discard(t.job)  # its steps alone are over
        return self._gate(t, seg)

    def _gate(self, t: _Thread, seg: GatedSegment) -> bool:
        """A sharing job at a gate: admitted now, or waiting (asked again
        as the others run)."""
        if seg.boundary and self._held_for_refused(t.job):
            return False  # a pass starts once the job the device refused has its memory
        account = self.accounts[t.job]
        live = self.ledger.usage(account)[0]
        rise, rest, net = seg.rise, seg.rest, seg.net
        borrow = seg.borrow
        if t.job in self.alone:
            rise, rest, net, borrow = None, 0, 0, None
        if rise is None and borrow is not None:
            source = self.threads[borrow.source]
            # Its kind measured (the runtime's relook) and memory plentiful:
            # ask what that first step needed rather than run alone.
            if ((source.done or source.seg >= borrow.source_segments)
                    and 2 * borrow.rise <= self.ledger.room_beside_live(account)):
                rise, rest, net = borrow.rise, with_slack(borrow.rise), borrow.net
        if self.ledger.gate(account, rise, max(0, rest), max(0, live + net), seg.boundary,
                            0) != 0:
            return False
        self.admitted[t.job] = t.seg
        t.ready = max(t.ready, self.device.now())  # it waited until now
        if t.job in self.alone:
            self.alone_left[t.job] -= 1
        return True

    def _put_back(self, j: int) -> bool:
        """Job ``j``'s step, which the device refused in its forward or
        backward while every job waited (or no other could free), undone:
        its blocks freed (and those its first step made to keep), its
        thread back at the step's start, its next ``ALONE_PASSES`` steps
        alone (twice as many at its next undo). False where the step ran
        alone or its update had begun: then it fails."""
        t = self.threads[j]
        seg = t.segment()
        k = seg.first + t.op
        if (self.ledger is None or not self.undo_steps or j in self.alone
                or self.jobs[j].ops[k].phase == "optimizer"):
            return False
        step = seg.step
        for key in [key for key in self.ptr[j] if key[0] == step]:
            self._free(j, self.ptr[j].pop(key), t.stream)
        if step == 0:  # what its first step made to keep, before operator k
            for at, made in self.persistent_at[j].items():
                if 0 <= at < k:
                    for b, _, _ in made:
                        self._free(j, self.kept[j].pop(b), t.stream)
        t.seg = next(i for i, s in enumerate(t.segments) if s.step == step)
        t.op = 0
        self.device_waiting.pop(j, None)
        self.device_refused.discard(j)
        self.admitted[j] = -1
        self.alone.add(j)
        self.alone_left[j] = self.alone_for.get(j, ALONE_PASSES)
        self.alone_for[j] = 2 * self.alone_left[j]
        self.put_back += 1
        return True

    def _held_for_refused(self, job: int) -> bool:
        """Whether ``job``'s next step waits for a job the device refused:
        one does, and a third job is in the middle of a step, whose frees
        should reach it first (``ThreadAccounts::boundary_blocked_locked``)."""
        if not self.device_refused:  # the usual case, at every step's gate
            return False
        refused = self.device_refused - {job}
        return bool(refused) and any(
            o.job != job and o.job not in refused and not o.done
            and (o.op or not o.segment().boundary or self.admitted[o.job] == o.seg)
            for o in self.threads)

    def _resource(self, t: _Thread) -> int:
        seg = t.segment()
        return ENGINE if self.jobs[t.job].ops[seg.first + t.op].phase == "backward" else GIL

    def _next(self) -> tuple[_Thread, float] | None:
        """The thread whose next operator starts first, and when. A Python
        operator needs the GIL for its glue; the autograd engine thread runs
        backward operators one at a time, in the order they became ready."""
        best = None
        for t in self.threads:
            if not self._runnable(t):
                continue
            shared = self.engine_free if self._resource(t) == ENGINE else self.gil_free
            key = (max(t.ready, shared), t.ready, t.job)
            if best is None or key < best[0]:
                best = (key, t)
        return None if best is None else (best[1], best[0][0])

    def _step(self, t: _Thread, start: float) -> None:
        j = t.job
        self.current = j
        seg = t.segment()
        k = seg.first + t.op
        op = self.jobs[j].ops[k]
        res = self._resource(t)
        if start > self.device.now():
            self.device.advance_host(start - self.device.now())
        self._release_due()
        try:
            self._allocate_op(j, seg.step, k, op, t.stream)
        except _C.OutOfMemoryError as e:
            if not self._wait_for_device(t, e) and not self._put_back(j):
                raise
            return
        self.device_refused.discard(j)
        self._run_op(j, seg.step, op, t.stream)
        end = max(start, self.device.now()) + op.cpu_us + self._first_call(t, res, op)
        t.ready = end
        if res == ENGINE:
            self.engine_free = end
        else:
            self.gil_free = max(start, self.device.now()) + min(op.cpu_us, GIL_US)
        if k == len(self.jobs[j].ops) - 1:
            self.step_ends[j][seg.step] = self.device.stream_completion(t.stream)
        t.op += 1
        self._settle(t)
        if self.record:
            self.time.append(start)
            self.reserved.append(self.device.reserved_bytes())
            for i, b in enumerate(self.job_bytes):
                self.per_job[i].append(b)

    def _first_call(self, t: _Thread, res: int, op: Op) -> float:
        """A library kernel's first call costs host time once per host thread
        (cuDNN caches its plans per thread and shape): per job for forward
        operators, once for all jobs on the autograd engine's thread."""
        if not op.first_us or self.warm:
            return 0.0
        key = ("engine" if res == ENGINE else t.job, op.name)
        if key in self.called:
            return 0.0
        self.called.add(key)
        return op.first_us

    # One operator --------------------------------------------------------------
    def _allocate_op(self, j: int, step: int, k: int, op: Op, stream: int) -> None:
        """Operator ``k``'s blocks (and, in the first step, the persistent
        blocks made before it); all or none: on out of memory, those made
        are freed again and the error raised."""
        made = []  # (the dictionary it went into, its key)
        try:
            if step == 0:
                for b, n, _ in self.persistent_at[j].get(k, []):
                    self.kept[j][b] = self._alloc(j, n)
                    made.append((self.kept[j], b))
            for b, n in op.alloc:
                self.ptr[j][(step, b)] = self._alloc(j, n)
                made.append((self.ptr[j], (step, b)))
        except _C.OutOfMemoryError:
            for where, key in reversed(made):
                self._free(j, where.pop(key), stream)
            raise

    def _wait_for_device(self, t: _Thread, error: Exception) -> bool:
        """The device ran out for a sharing job's operator: it waits for
        another job's frees and tries again, where another job could free
        (True); else the error stands (False)."""
        if self.ledger is None:
            return False
        if not any(o is not t and not o.done and o.job not in self.device_waiting
                   for o in self.threads):
            return False
        self.device_waiting[t.job] = (self.frees, error)
        self.device_refused.add(t.job)
        self.device_waits += 1
        return True

    def _run_op(self, j: int, step: int, op: Op, stream: int) -> None:
        ptr = self.ptr[j]
        if op.gpu_us > 0:
            self._wait_for_queue(j)
            uses = [ptr.get((step, b)) or self.kept[j].get(b) for b in (*op.use, *op.free)]
            uses += [ptr[(step, b)] for b, _ in op.alloc]
            self.alloc.launch(stream, op.gpu_us, [p for p in uses if p], op.sm, op.bw)
            end = self.device.stream_completion(stream)
            self.queues[j].append(end)
            work = self.work_by[j]
            self.kernel_ends[j].append(end)
            work.append((work[-1] if work else 0.0) + op.gpu_us)
            if self.concurrent:
                busy = self.busy_by[j]
                busy.append((busy[-1] if busy else 0.0) + op.gpu_us * op.sm)
        for b in op.free:
            self._free(j, ptr.pop((step, b)), stream)

    def _wait_for_queue(self, j: int) -> None:
        q, now = self.queues[j], self.device.now()
        while q and q[0] <= now:
            q.popleft()
        if len(q) >= self.queue_depth:  # the launch blocks until the oldest kernel ends
            self.device.advance_host(q[len(q) - self.queue_depth] - now)
            while q and q[0] <= self.device.now():
                q.popleft()

    def _alloc(self, j: int, n: int) -> int:
        stream = self.threads[j].stream
        while True:
            try:
                p = self.alloc.alloc(n, stream)
                break
            except _C.OutOfMemoryError:
                # Free-at-completion: memory still held for running kernels
                # comes back when they end; wait for the next, then retry.
                if self.policy != FREE_AT_COMPLETION or not self.deferred:
                    raise
                self.device.advance_host(max(0.0, self.deferred[0][0] - self.device.now()))
                self._release_due()
        n = self.alloc.allocation_size(p)
        self.sizes[p] = n
        self.job_bytes[j] += n
        if self.ledger is not None:
            self.ledger.count(self.accounts[j], p, n)
        return p

    def _free(self, j: int, p: int, stream: int) -> None:
        if self.policy == FREE_AT_COMPLETION:
            heapq.heappush(self.deferred, (self.device.stream_completion(stream), j, p))
            return
        self.job_bytes[j] -= self.sizes.pop(p)
        self.alloc.free(p)
        self.frees += 1
        if self.ledger is not None:
            self.ledger.free(p)

    def _release_due(self) -> None:
        now = self.device.now()
        while self.deferred and self.deferred[0][0] <= now:
            _, j, p = heapq.heappop(self.deferred)
            self.job_bytes[j] -= self.sizes.pop(p)
            self.alloc.free(p)
            self.frees += 1
            if self.ledger is not None:
                self.ledger.free(p)

    # Results -------------------------------------------------------------------
    def report(self, r: SimResult) -> None:
        s = self.alloc.stats()
        r.stats = s
        r.peak_reserved = s["reserved_bytes.all.peak"]
        r.peak_allocated = s["allocated_bytes.all.peak"]
        r.syncs = s["num_sync_and_coalesce"] + s["num_host_event_syncs"] + s["num_alloc_retries"]
        r.stream_waits = s["num_stream_waits"]
        r.hazards = len(self.alloc.hazards())
        for ends in self.step_ends:
            done = sorted(ends.items())
            r.step_time_us.append((done[-1][1] - done[0][1]) / (len(done) - 1)
                                  if len(done) >= 2 else None)
            r.first_step_us.append(done[0][1] if done else None)
        if r.ok and all(self.step_ends):
            r.elapsed_us = max(max(ends.values()) for ends in self.step_ends)
        if r.ok and all(x is not None for x in r.step_time_us):
            r.throughput, r.gpu_busy = self._steady_rates(r.batch_sizes)
        r.time_us, r.reserved, r.per_job = self.time, self.reserved, self.per_job
        if self.ledger is not None:
            share = self.ledger.share_stats()
            r.sharing = {k: share[k] for k in ("budget", "peak", "gate_waits", "forced")}
            r.sharing["device_waits"] = self.device_waits
            r.sharing["put_back"] = self.put_back

    def _steady_rates(self, batch_sizes: list[int | None]) -> tuple[float | None, float | None]:
        """Samples per second of all jobs together in steady steps, and the
        share of that time the GPU ran their kernels; None when no moment
        finds every job past its first step and none finished.

        The window opens when the last job ends its first step (the first
        pays for warm-up: cuDNN's plans, and the others waiting on it) and
        closes when the first job ends its last (after it, the others run
        alone). A job's progress in it is the GPU time of the kernels it ran
        there, over its step's: exact at any moment, where counting whole
        steps errs by up to a step at each edge, more than the differences
        between schedules. Summing each job's rate over its own whole run,
        as before, counted the time a job ran alone as if the others ran
        beside it, and overstated a pair whose jobs finish apart. The GPU
        runs one kernel at a time, so the busy share is at most 1: at 1, no
        schedule could be faster at this batch. A window under
        ``MIN_WINDOW_US`` measures nothing: a step lasts far longer, and the
        clock's rounding (times of thousands of microseconds) would then show
        as a busy share over 1."""
        start = max(min(e.values()) for e in self.step_ends)
        stop = min(max(e.values()) for e in self.step_ends)
        if stop - start < MIN_WINDOW_US:
            return self._rates_one_after_another(batch_sizes)
        rate = busy = 0.0
        for j, t in enumerate(self.jobs):
            step_work = sum(op.gpu_us for op in t.ops)
            done = self._work_by(j, stop) - self._work_by(j, start)
            rate += (batch_sizes[j] or 1) * done / step_work
            busy += self._work_by(j, stop, self.busy_by) - self._work_by(j, start, self.busy_by)
        span = stop - start
        return rate / span * 1e6, busy / span

    def _rates_one_after_another(self, batch_sizes) -> tuple[float | None, float | None]:
        """Where no moment has every job in its steady steps (the jobs run one
        after another): each job's steady steps over its own window, the
        samples of all over the sum of their windows, as running them in
        turn would give."""
        samples = busy = span = 0.0
        for j, t in enumerate(self.jobs):
            ends = sorted(self.step_ends[j].values())
            if len(ends) < 2 or ends[-1] - ends[0] < MIN_WINDOW_US:
                return None, None
            start, stop = ends[0], ends[-1]
            step_work = sum(op.gpu_us for op in t.ops)
            samples += (batch_sizes[j] or 1) * (self._work_by(j, stop) - self._work_by(j, start)) \
                / step_work
            busy += self._work_by(j, stop, self.busy_by) - self._work_by(j, start, self.busy_by)
            span += stop - start
        return samples / span * 1e6, busy / span

    def _work_by(self, j: int, t: float, cumulative: list | None = None) -> float:
        """GPU time job j's kernels had run by time ``t`` (``cumulative``:
        ``busy_by``, that time weighed by each kernel's SM share)."""
        ends, times = self.kernel_ends[j], self.work_by[j]
        work = (cumulative or self.work_by)[j]
        k = bisect.bisect_right(ends, t)  # kernels [0, k) had ended
        done = work[k - 1] if k else 0.0
        if k < len(ends):  # the next one may be running: it started at its end less its length
            length = times[k] - (times[k - 1] if k else 0.0)
            ran = min(max(0.0, t - (ends[k] - length)), length)
            if ran > 0:
                done += (work[k] - done) * ran / length
        return done
