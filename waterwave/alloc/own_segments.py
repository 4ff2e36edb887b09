"""Why a trainer of captured jobs keeps each stream to its own large
segments while it runs: the allocator setting its runs make on the GPU's
allocator (``exec/concurrent.py``), and that the simulator's captured
schedules run under (``pipeline/schedules.py``).

The waterwave policy lets a stream take any free block no kernel touches,
whichever stream's segment it lies in. Jobs taking turns, or paired in
rounds, then split one another's large cached blocks for smaller requests,
and a job's long-lived blocks (its optimizer's state, made in its first
step) land in another's segments and pin them. With ``own_segments_first``
a stream's large-pool request takes its own segments' blocks, then a new
segment, and other streams' free memory only once the device is out. In the
simulator, over 24 random MLP mixes under random caps, the captured session
ran out of memory in none of them with it and in 2 without, and over 72
cases of jobs in turn, one after another or side by side it never needed
more memory than PyTorch's policy, where the waterwave policy as it comes
needed more in 21 (``bench/fragmentation/own_segments.py``; all simulated).

Sharing members (``job.train``'s default) keep the policy as it comes: they
take memory at any moment rather than in rounds, and with the setting they
ran slower in the same mixes (15 of 22 within 3% of the best plain schedule
against 17). So a trainer turns the setting on for its run and
back off after, unless the user chose it (in the allocator's settings or
``waterwave.cuda.set_own_segments_first``), or the segments are expandable
(each stream grows its own already). Members training beside a trainer run
with it meanwhile.

May import: nothing of waterwave (it is given the allocator).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def own_segments_for_run(allocator) -> Iterator[bool]:
    """While the block runs, ``allocator`` keeps each stream to its own large
    segments until the device is out, unless its settings chose otherwise
    or its segments are expandable. The count of runs lives with the
    allocator's stack (``hold_own_segments_first``), so runs that overlap
    (trainers on threads, each with its own handle on the device's stack)
    keep it on until the last ends. Yields whether the setting is on."""
    on = allocator.hold_own_segments_first()
    try:
        yield on
    finally:
        allocator.release_own_segments_first()
