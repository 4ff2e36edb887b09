"""Synthetic workloads for the simulated GPU.

``two_jobs`` is the demo's workload: two training jobs on two streams, each
iteration a forward pass whose activations pile up and a backward pass that
frees them, the second job half an iteration behind the first so that one
job's memory falls while the other's rises (Waterwave paper, section 3).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import _C
from ..alloc import Allocator

MiB = 1024**2


@dataclass
class JobSpec:
    stream: int
    layers: int = 24
    activation_mib: tuple[float, ...] = (24, 48, 32, 64)  # cycled over layers
    workspace_mib: float = 0.75  # a small temporary per layer (small pool)
    kernel_us: float = 120.0     # GPU time per layer and pass
    weights_mib: float = 96.0    # persistent, allocated once


@dataclass
class Trace:
    """Memory over time: one sample per operation."""
    time_us: list[float] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    per_job: list[list[int]] = field(default_factory=lambda: [[], []])  # allocated by job


def _job_ops(job: JobSpec, iterations: int):
    """Yield the job's operations in program order, as (kind, args)."""
    yield ("alloc", "weights", int(job.weights_mib * MiB))
    for it in range(iterations):
        acts = []
        for i in range(job.layers):
            size = int(job.activation_mib[i % len(job.activation_mib)] * MiB)
            name = f"act{it}.{i}"
            acts.append(name)
            yield ("alloc", name, size)
            yield ("alloc", f"ws{it}.{i}", int(job.workspace_mib * MiB))
            yield ("kernel", [name, f"ws{it}.{i}", "weights"], job.kernel_us)
            yield ("free", f"ws{it}.{i}")
        for i in reversed(range(job.layers)):
            grad = f"grad{it}.{i}"
            yield ("alloc", grad, int(job.activation_mib[i % len(job.activation_mib)] * MiB // 2))
            yield ("kernel", [acts[i], grad, "weights"], job.kernel_us)
            yield ("free", acts[i])  # freed at scheduling time, not at completion
            yield ("free", grad)
        yield ("iteration_end",)
    yield ("free", "weights")


def two_jobs(policy: str, capacity: int, iterations: int = 3, launch_overhead_us: float = 5.0,
             config: str = "", jobs: tuple[JobSpec, JobSpec] | None = None, record: bool = True):
    """Run the two-job workload under ``policy``. Returns (allocator, trace, ok).

    ``ok`` is False when the run hit an out-of-memory error (the trace stops there).
    With ``record=False`` no trace is kept (the capacity search needs only ``ok``).
    """
    if jobs is None:
        jobs = (JobSpec(stream=0), JobSpec(stream=1))
    device = _C.SimDevice(capacity, launch_overhead_us)
    a = Allocator(policy, device, config)
    trace = Trace()
    streams = [list(_job_ops(j, iterations)) for j in jobs]
    # The second job starts half an iteration behind: out of phase.
    per_iter = (len(streams[0]) - 2) // iterations
    lag = per_iter // 2
    order = []
    i = j = 0
    while i < len(streams[0]) or j < len(streams[1]):
        if i < len(streams[0]):
            order.append((0, streams[0][i]))
            i += 1
        if i > lag and j < len(streams[1]):
            order.append((1, streams[1][j]))
            j += 1
    live: list[dict[str, int]] = [{}, {}]
    job_bytes = [0, 0]
    try:
        for k, op in order:
            job = jobs[k]
            kind = op[0]
            if kind == "alloc":
                p = live[k][op[1]] = a.alloc(op[2], job.stream)
                job_bytes[k] += a.allocation_size(p)
            elif kind == "free":
                p = live[k].pop(op[1])
                job_bytes[k] -= a.allocation_size(p)
                a.free(p)
            elif kind == "kernel":
                a.launch(job.stream, op[2], [live[k][n] for n in op[1]])
            elif kind == "iteration_end":
                # The training loop reads the loss: the host waits for the GPU,
                # then the executor turns the iteration's frees into synced memory.
                a.synchronize()
                a.sync_and_coalesce()
            if not record:
                continue
            # The jobs' own byte counts are the allocator's allocated bytes, and
            # the device's reserved bytes its reserved: no stats() per operation.
            trace.time_us.append(a.now())
            trace.allocated.append(job_bytes[0] + job_bytes[1])
            trace.reserved.append(device.reserved_bytes())
            trace.per_job[0].append(job_bytes[0])
            trace.per_job[1].append(job_bytes[1])
    except _C.OutOfMemoryError:
        return a, trace, False
    return a, trace, True


def smallest_capacity(policy: str, lo: int, hi: int, step: int = 64 * MiB, **kw) -> int | None:
    """The smallest simulated capacity (a multiple of ``step``) at which the
    workload runs without running out of memory, by bisection."""
    kw["record"] = False
    if not two_jobs(policy, hi, **kw)[2]:
        return None
    lo_k, hi_k = lo // step, hi // step
    while lo_k < hi_k:
        mid = (lo_k + hi_k) // 2
        if two_jobs(policy, mid * step, **kw)[2]:
            hi_k = mid
        else:
            lo_k = mid + 1
    return hi_k * step
