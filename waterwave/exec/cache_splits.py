"""Why a sharing session on a GPU keeps large cached blocks whole.

Trials sharing a capped GPU free large activations that the next trial's
pass takes. A caching allocator that splits those blocks for smaller
requests (a trial's batches made outside its block, optimizer state) leaves
pieces too small for the next activation, in segments it cannot give back:
on an H200, four resnet50 trials under a 12 GiB cap lost 3 of 8 that way,
with 3 GiB cached in such pieces while the members' counted bytes were under
their budget, and the simulated search of
``bench/fragmentation/sharing_cap.py`` loses 13 of 80 the same way and none
with blocks of 20 MiB or more never split (PyTorch's ``max_split_size_mb``:
such blocks are whole segments, which the allocator gives back and maps
again at the size asked for when the device runs out; the price is about six
times the segment calls there, unmeasured on a GPU). So the first sharing
block on a GPU sets that limit where Waterwave's allocator serves the device
and the user set none.

May import: waterwave.cuda, waterwave.alloc.
"""
from __future__ import annotations

from .. import cuda

SHARING_MAX_SPLIT_MB = 20  # PyTorch's smallest allowed: its large segment size


def keep_large_blocks_whole(allocator) -> int | None:
    """Set ``allocator``'s max_split_size to ``SHARING_MAX_SPLIT_MB`` (or its
    large segment size, where that is larger) unless one is set. Returns the
    limit in force, in bytes (the user's where they set one)."""
    current = allocator.stats()["max_split_size"]
    if current >= 0:
        return current
    limit = max(SHARING_MAX_SPLIT_MB << 20, allocator.config.large_segment_size)
    allocator.set_max_split_size(limit)
    return limit


def keep_large_blocks_whole_on(device) -> int | None:
    """The same on a CUDA device, where Waterwave's allocator serves PyTorch
    (None elsewhere: torch's own allocator is the user's to configure)."""
    if not cuda.is_installed():
        return None
    return keep_large_blocks_whole(cuda.allocator(device))
