"""What a job holds between its ``train()`` calls: the memory its thread
allocates there (evaluation, metrics) beside the jobs still training. A
training session keeps that much for the job from its last planned group
on (``JobPlan.after``), so a job evaluating beside others never runs them
out of memory.

How much: the job's ``evaluation_memory`` when set; else, on a GPU under
Waterwave's allocator, what its thread was measured allocating between
calls (a ``ThreadAccount`` tags the thread from the end of one call to the
start of the next; the most any interval rose above its start); until an
interval shows some, the job's training step's own peak above its
persistent bytes, which the graph's tensors of an evaluation of a batch
like training's (no gradients kept) stay under. cuDNN's workspaces are not
in the graph: on an H200, resnet18 evaluating 2 images rose 34.7 MB where
its planned step's peak was 23.8 MB, which is why the interval is
measured. Tensors still live from an interval when the
next call starts (a metric kept on the GPU) count as the job's persistent
bytes while it trains.

Measured only on the thread that calls ``train()``: evaluation run by
another thread is not seen (set ``evaluation_memory`` for it).

May import: waterwave.alloc, waterwave.pipeline.
"""
from __future__ import annotations

from ..alloc.pluggable import is_installed
from ..alloc.thread_account import ThreadAccount
from ..pipeline.pairing import rises_from


def bytes_or_none(value, name: str) -> int | None:
    """A setting in bytes: a whole number, at least 0, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number of bytes, at least 0, or None; "
                         f"got {value!r}")
    return value


class BetweenCalls:
    """One job's memory between its calls (see the module's opening)."""

    def __init__(self, evaluation_memory: int | None = None):
        self.setting = bytes_or_none(evaluation_memory, "evaluation_memory")
        self.account: ThreadAccount | None = None
        self.start = 0           # the account's live bytes when the interval began
        self.rise: int | None = None  # the most an interval rose above its start
        self.kept = 0            # bytes live from earlier intervals at the last call's start
        self._open = False

    @staticmethod
    def measurable(on_cuda: bool) -> bool:
        """Whether a thread account can see the job's allocations: a CUDA job
        under Waterwave's allocator."""
        return on_cuda and is_installed()

    def begin(self, measure: bool) -> None:
        """The job's call returned: tag its thread until the next call."""
        if not measure:
            return
        if self.account is None:
            self.account = ThreadAccount()
        self.account.tag()
        self.account.reset_peak()
        self.start, _ = self.account.usage()
        self._open = True

    def end(self, measure: bool) -> None:
        """A call starts: untag the thread (a thread is one job's between
        calls, and the job's own groups are planned) and read the interval."""
        if not measure:
            return
        ThreadAccount.untag()
        if not self._open:
            return
        self._open = False
        live, peak = self.account.usage()
        rise = max(0, peak - self.start)
        if rise:
            self.rise = max(self.rise or 0, rise)
        self.kept = live

    def reserve(self, groups: list[tuple[int, int]]) -> int:
        """Bytes kept for the job between calls, beside its persistent ones."""
        if self.setting is not None:
            return self.setting
        if self.rise is not None:
            return self.rise
        return rises_from(groups)[0] if groups else 0
