"""What a job's device holds in segments beyond the blocks a plan counts:
on a GPU, a caching allocator's part-empty segment of each pool (its small
pool's 2 MiB, and its large pool's shared segment, Waterwave's
``large_segment_size`` where installed, PyTorch's 20 MiB otherwise); on the
CPU, nothing. The trainer counts a job's peak alone with it
(``session_choice.cached_peak``) and the memory pairing keeps it back for
every job (``pairing.SEGMENT_SLACK``). Where Waterwave's allocator serves
the GPU and each stream keeps to its own segments (a trainer's run), a
job's measured step also reads what its stream's segments held beyond its
blocks (``job_loop.MemoryProbe.own_peaks``, ``JobPlan.segment_spare``),
which the trainer counts in its peak and the pairing before running jobs
free. Side by side, the jobs' streams share the small pool: a trainer
counts what it may take beyond peaks measured so (``measured_alone``,
``pairing.shared_small_pool``).

May import: waterwave.cuda, waterwave.pipeline, this package.
"""
from __future__ import annotations

from .. import cuda
from ..pipeline.pairing import LARGE_SEGMENT, SMALL_SEGMENT, step_peak
from ..pipeline.session_choice import MeasuredAlone, cached_peak


def large_segment_size(member) -> int:
    """The large pool's shared segment on a GPU job's device."""
    if cuda.is_installed():
        return cuda.allocator(member.step_fn.params[0].device).config.large_segment_size
    return LARGE_SEGMENT


def segment_slack(members) -> int:
    """Bytes a job of ``members`` (pipelined jobs of one run) may hold in
    part-empty segments: the largest over those on a GPU, 0 on the CPU."""
    on_cuda = [m for m in members if m.step_fn.device == "cuda"]
    return SMALL_SEGMENT + max(map(large_segment_size, on_cuda)) if on_cuda else 0


def peak_alone(member) -> int:
    """The most a pipelined job holds, from its step measured alone, as a
    trainer counts it beside the others: on a GPU, its step's bytes and its
    segment spare (what its stream's own segments reserved beyond its
    blocks), or, where the allocator did not measure that (PyTorch's), its
    bytes with ``cached_peak``'s margin and segments; on the CPU, its bytes."""
    plan = member.pairing_plan(0)
    peak = step_peak(plan)
    if member.step_fn.device != "cuda":
        return peak
    if plan.segment_spare is not None:
        return peak + plan.segment_spare.total
    return cached_peak(peak, large_segment_size(member))


def measured_alone(member, seconds: float) -> MeasuredAlone:
    """A pipelined job as a trainer measured its step alone, in ``seconds``:
    its peak (``peak_alone``), marked as bytes reserved where its segment
    spare was measured, with that spare, so that side by side counts the
    small pool the jobs' streams share (``session_choice.side_by_side_need``)."""
    spare = member.pairing_plan(0).segment_spare if member.step_fn.device == "cuda" else None
    return MeasuredAlone(peak_alone(member), max(seconds, 1e-9), segment_spare=spare)
