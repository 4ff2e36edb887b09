"""Jobs made on a GPU that have not trained yet: what they already hold
there (their model, their batches put on the GPU), which a training session
counts as taken until the job first trains, when it counts the job's own
figures instead.

Why: without a ``memory_limit``, a session's budget on a GPU is measured
when its first job starts training, and not again while any job trains.
A new trial's model and batches land on the GPU before its job trains, and
its capture takes seconds in between; a budget measured before them counts
their memory as free all that while (on an H200, a search of resnet50
trials, four at a time under a 12 GiB ``per_process_memory_fraction``,
lost 6 of 8 trials to out of memory through ``job.train``). Counted from
the job's making, that memory is taken from the budget the moment the job
exists; measured after it, the budget counts it as taken and adds it back
as the job's, as it does a training job's between its calls.

A registry keyed weakly by job: a job dropped before it trains (a pruned
trial) leaves it with its memory.

May import: nothing of waterwave.
"""
from __future__ import annotations

import threading
import weakref

_LOCK = threading.Lock()
_AWAITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # job -> (device, bytes)


def expect(job, device: str, nbytes: int) -> None:
    """``job`` holds ``nbytes`` on ``device`` (a session's device key) and
    has not trained yet."""
    with _LOCK:
        _AWAITING[job] = (device, max(0, int(nbytes)))


def trained(job) -> None:
    """``job`` trains in a session now, which counts it from here on."""
    with _LOCK:
        _AWAITING.pop(job, None)


def held_on(device: str) -> int:
    """What the jobs awaiting their first step on ``device`` hold."""
    if not _AWAITING:  # the common case, read at every sharing block's start and end
        return 0
    with _LOCK:
        return sum(nbytes for where, nbytes in list(_AWAITING.values()) if where == device)
