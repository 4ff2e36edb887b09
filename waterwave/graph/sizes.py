"""Sizes as the caching allocator counts them, by its own rules: the C++
``SizeRules`` (csrc/core/config.h), bound once here, so that a graph, a plan
and the pipeline's memory pairing count the bytes the allocator hands out.
Under PyTorch's default settings a request rounds up to 512-byte blocks, and
one of 10 MiB or more gets a segment of its own, in 2 MiB steps.

May import: waterwave._C.
"""
from __future__ import annotations

from .. import _C
from .input_limits import MAX_LIMIT


def _checked(nbytes: int) -> int:
    # Sizes read from files are bounded long before this (InputLimits.block_bytes);
    # one past 2**62 would wrap in the allocator's arithmetic.
    if nbytes > MAX_LIMIT:
        raise ValueError(f"a size of {nbytes:,} bytes is past what an allocator can hold "
                         f"(2**62)")
    return nbytes


def round_size(nbytes: int) -> int:
    """The block the allocator gives a request of ``nbytes`` (0 stays 0: an
    empty tensor takes no block)."""
    return 0 if nbytes <= 0 else _C.round_size(_checked(nbytes))


def footprint(nbytes: int) -> int:
    """What a tensor of ``nbytes`` costs the cache: its block, or from 10 MiB
    up the segment of its own it gets. The pipeline's plans count this."""
    return 0 if nbytes <= 0 else _C.footprint(_checked(nbytes))
