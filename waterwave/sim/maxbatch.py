"""The largest batch per job that trains without running out of memory, by
bisection, as bench/data/gpu-snapshots/probe.py searches it on a GPU: batch
sizes in steps of ``step``, grown by doubling from 64 until one fails, then
bisected; a batch counts when ``steps`` steps of every job finish. And
``simulate_models``: models, one job each, at one batch under a schedule.

May import: this package.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .gpus import GPU
from .gpus import gpu as named_gpu
from .jobs import JobModel
from .kernels import NONE, KernelModel
from .multijob import SimResult, simulate
from .schedules import ALLOCATORS
from .schedules import schedule as named_schedule
from .trace import Trace


@dataclass
class MaxBatch:
    max_batch: int                      # 0: not even `step` fits
    trials: list[tuple[int, bool]] = field(default_factory=list)  # (batch, fits)
    result: SimResult | None = None     # the run at max_batch


def search(fits: Callable[[int], SimResult], step: int = 8, start: int = 64,
           limit: int = 4096, on_trial: Callable[[int, bool], None] | None = None) -> MaxBatch:
    """The largest multiple of ``step`` for which ``fits(batch).ok``;
    ``on_trial(batch, fits)`` hears of each trial."""
    out = MaxBatch(0)
    good, bad, batch = 0, None, max(step, start // step * step)
    while True:
        r = fits(batch)
        out.trials.append((batch, r.ok))
        if on_trial:
            on_trial(batch, r.ok)
        if r.ok:
            good, out.result = batch, r
            if bad is None:
                if batch * 2 > limit:
                    break
                batch *= 2
                continue
        else:
            bad = batch
        if bad - good <= step:
            break
        batch = max(step, (good + bad) // 2 // step * step)
        if batch <= good:
            break
    out.max_batch = good
    return out


def max_batch(models: list[JobModel], gpu: GPU | str, memory_limit: int | None,
              schedule="lockstep", policy: str = "pytorch", kernels: KernelModel | None = None,
              steps: int = 3, step: int = 8, on_trial=None, split_size: int | None = None,
              **kwargs) -> MaxBatch:
    """The largest batch (the same for every job) at which ``models``, one
    job each, train together under ``schedule`` and ``policy``. A node-group
    schedule cuts each job's step with its own partition."""

    ws = kernels or NONE
    spec = named_gpu(gpu) if isinstance(gpu, str) else gpu
    sched = named_schedule(schedule, memory_limit or spec.memory, split_size)
    cut = getattr(sched, "partition", None)

    def fits(batch: int) -> SimResult:
        jobs = [m.trace_at(batch, gpu, ws, partition=cut) for m in models]
        return simulate(jobs, gpu, memory_limit, sched, policy, steps, record=False, **kwargs)

    return search(fits, step, on_trial=on_trial)


# The operator orders a node-group schedule that leaves its order open may
# run its groups in (pipeline/nodegroups.py).
ORDERS = ("bfs", "program")


def simulate_models(models: list[JobModel], batch: int, gpu: GPU | str, schedule: str = "lockstep",
                    memory_limit: int | None = None, kernels: KernelModel | None = None,
                    steps: int = 3, policy: str | None = None, config: str | None = None,
                    split_size: int | None = None, order: str | None = None,
                    **kwargs) -> tuple[SimResult, list[Trace]]:
    """``models``, one job each, at ``batch`` under the named ``schedule`` (a
    node-group schedule cuts each job's step with its partition), on the
    schedule's own allocator (``schedules.ALLOCATORS``) unless ``policy`` or
    ``config`` is given; ``kwargs`` go to ``simulate``. Returns the result
    and the jobs' traces.

    ``order``: the operator order of a node-group schedule that leaves it
    open (``waterwave``, ``waterwave-alg1``). None: BFS, or, with kernels of
    different jobs at once (``concurrent_kernels=True``), whichever of BFS
    and program order gives the higher throughput, as the pipeline chooses
    by throughput: how the jobs' kernels overlap depends on the order (in
    program order, jobs that run free are exactly lockstep's), and a run
    that fits beats one out of memory. ``result.order`` says which ran.

    With kernels at once and no ``policy`` or ``config`` given, a node-group
    schedule that leaves its order open also runs each order under PyTorch's
    policy and keeps that where it trains faster: the waterwave policy
    reuses a block freed on another stream behind an asynchronous wait,
    where PyTorch's reserves a new segment, and with memory to spare the
    wait is what costs (up to 0.22% in bench/concurrent/throughput.py).
    ``result.policy`` says which ran; on a GPU it is the one to install
    (``waterwave.install_allocator(policy=...)``)."""
    spec = named_gpu(gpu) if isinstance(gpu, str) else gpu
    sched = named_schedule(schedule, memory_limit or spec.memory, split_size)
    open_order = getattr(sched, "spec", None) is not None and sched.spec.order is None
    if order is not None and not open_order:
        raise ValueError(f"the {schedule} schedule sets its own operator order; order= applies "
                         "to a node-group schedule that leaves it open (waterwave, waterwave-alg1)")
    if order is not None and order not in ORDERS:
        raise ValueError(f"unknown order {order!r}: choose one of {', '.join(ORDERS)}")
    orders = [order] if order else (list(ORDERS) if open_order and kwargs.get("concurrent_kernels")
                                    else [ORDERS[0]])
    own_policy, own_config = ALLOCATORS[schedule]
    allocators = [(policy or own_policy, own_config if config is None else config)]
    if (policy is None and config is None and open_order and kwargs.get("concurrent_kernels")
            and own_policy != "pytorch"):
        allocators.append(ALLOCATORS["lockstep"])  # PyTorch's policy, as PyTorch runs jobs
    best: tuple[SimResult, list[Trace]] | None = None
    for candidate in orders:
        if open_order:
            sched = replace(sched, order=candidate)
        traces = [m.trace_at(batch, gpu, kernels or NONE,
                             partition=getattr(sched, "partition", None)) for m in models]
        for run_policy, run_config in allocators:
            result = simulate(traces, gpu, memory_limit, sched, run_policy, steps,
                              config=run_config, **kwargs)
            result.order = candidate if open_order else None
            if best is None or _faster(result, best[0]):
                best = (result, traces)
    return best


def _faster(a: SimResult, b: SimResult) -> bool:
    """Whether run ``a`` beats ``b``: it fits where ``b`` does not, or both
    fit and ``a`` trains more samples a second."""
    if a.ok != b.ok:
        return a.ok
    return (a.throughput or 0.0) > (b.throughput or 0.0)
