"""Why trials sharing a GPU keep large cached blocks whole: the limit a
sharing session on a GPU sets (``TrainingSession.join_sharing``) and the
simulator's sharing schedule sets (``sim/multijob.py``).

Trials sharing a capped GPU free large activations that the next trial's
pass takes. A caching allocator that splits those blocks for smaller
requests (a trial's batches made outside its block, optimizer state) leaves
pieces too small for the next activation, in segments it cannot give back:
on an H200, four resnet50 trials under a 12 GiB cap lost 3 of 8 that way,
with 3 GiB cached in such pieces while the members' counted bytes were under
their budget, and the simulated search of
``bench/fragmentation/sharing_cap.py`` loses 28 of 80 the same way and none
with blocks of 20 MiB or more never split (PyTorch's ``max_split_size_mb``:
such blocks are whole segments, which the allocator gives back and maps
again at the size asked for when the device runs out; the price is about nine
times the segment calls there, unmeasured on a GPU). So the first sharing
block on a GPU sets that limit where Waterwave's allocator serves the device
and the user set none (torch's own allocator is the user's to configure).

May import: nothing of waterwave (it is given the allocator).
"""
from __future__ import annotations


SHARING_MAX_SPLIT_MB = 20  # PyTorch's smallest allowed: its large segment size


def keep_large_blocks_whole(allocator) -> int:
    """Set ``allocator``'s max_split_size to ``SHARING_MAX_SPLIT_MB`` (or its
    large segment size, where that is larger) unless one was chosen (in its
    config, or at run time: no limit included). Returns the limit in force,
    in bytes (-1: none)."""
    if allocator.max_split_size_chosen():
        return allocator.stats()["max_split_size"]
    limit = max(SHARING_MAX_SPLIT_MB << 20, allocator.config.large_segment_size)
    allocator.set_max_split_size(limit)
    return limit
