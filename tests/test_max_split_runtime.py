"""max_split_size changed while the allocator runs (``set_max_split_size``,
``waterwave.cuda.set_max_split_size_mb``), and why a sharing session on a
GPU sets it: the simulated search of ``bench/fragmentation/sharing_cap.py``,
where cached pieces ran trials out of memory under their budget."""
import sys
from pathlib import Path

import pytest

import waterwave as ww
from waterwave import _C

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def split_big_block(policy: str, capacity: int = 256 * MiB) -> tuple[ww.Allocator, int]:
    """A 100 MiB segment, freed, then split by a 30 MiB request: a free 70
    MiB piece of a split segment stays in the cache."""
    a = ww.Allocator(policy, ww.SimDevice(capacity, 0.0))
    a.free(a.alloc(100 * MiB))
    return a, a.alloc(30 * MiB)


@pytest.mark.parametrize("policy", ["pytorch", "waterwave"])
def test_a_block_is_not_split_once_the_limit_is_set(policy):
    a, small = split_big_block(policy)
    assert a.stats()["segment.all.current"] == 1  # the 30 MiB split the 100 MiB segment
    a.free(small)
    a.sync_and_coalesce()
    a.set_max_split_size(20 * MiB)
    assert a.stats()["max_split_size"] == 20 * MiB
    a.alloc(30 * MiB)
    s = a.stats()
    assert s["segment.all.current"] == 2  # a segment of its own, the 100 MiB kept whole
    assert s["oversize_segments.current"] == 2
    assert s["oversize_allocations.current"] == 1
    a.set_max_split_size(-1)
    assert a.stats()["max_split_size"] == -1
    assert a.stats()["oversize_segments.current"] == 0
    a.check_invariants()


def test_pytorch_policy_out_of_memory_skips_an_oversize_piece_split_before():
    # Before the fix, the oversize release took the split 70 MiB piece for a
    # whole segment and broke the allocator's invariant.
    a, _ = split_big_block("pytorch")
    a.set_max_split_size(20 * MiB)
    with pytest.raises(_C.OutOfMemoryError):
        a.alloc(200 * MiB)  # 156 MiB left on the device; the piece cannot be given back
    a.check_invariants()
    a.alloc(60 * MiB)  # the allocator still serves


@pytest.mark.parametrize("bytes_", [10 * MiB, -2])
def test_a_limit_below_the_segment_size_is_refused_and_changes_nothing(bytes_):
    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "max_split_size_mb:64")
    with pytest.raises(_C.ConfigError, match="max_split_size"):
        a.set_max_split_size(bytes_)
    assert a.stats()["max_split_size"] == 64 * MiB


@pytest.mark.parametrize("mb", [0, -5, True, 1.5, "20", 1 << 44])
def test_cuda_setter_refuses_what_is_no_size(mb):
    with pytest.raises(ValueError, match="max_split_size_mb"):
        ww.cuda.set_max_split_size_mb(mb)


def test_simulated_sharing_under_a_cap_loses_trials_without_the_limit_and_none_with_it():
    sys.path.insert(0, str(ROOT / "bench" / "fragmentation"))
    try:
        import sharing_cap
    finally:
        sys.path.pop(0)
    from waterwave.sim.trace import from_snapshot

    trial = sharing_cap.program(from_snapshot(str(sharing_cap.SNAPSHOT)))
    at_first_pass = "max_split_size_mb:20" + sharing_cap.AT_FIRST_PASS
    plain = [sharing_cap.run("waterwave", "", trial, seed) for seed in (1, 2)]
    assert sum(r["lost"] for r in plain) > 0
    assert all(f["cached_gib"] > 1.0 for r in plain for f in r["refusals"])
    for seed in (1, 2):
        limited = sharing_cap.run("waterwave", at_first_pass, trial, seed)
        assert limited["lost"] == 0 and limited["forced"] == 0


def test_a_sharing_session_keeps_large_blocks_whole_unless_the_user_chose():
    from waterwave.alloc import cache_splits

    a = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    assert cache_splits.keep_large_blocks_whole(a) == 20 * MiB
    assert a.stats()["max_split_size"] == 20 * MiB
    chosen = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0), "max_split_size_mb:64")
    assert cache_splits.keep_large_blocks_whole(chosen) == 64 * MiB
    assert chosen.stats()["max_split_size"] == 64 * MiB
    big = ww.Allocator("pytorch", ww.SimDevice(256 * MiB, 0.0), "large_segment_size_mb:32")
    assert cache_splits.keep_large_blocks_whole(big) == 32 * MiB
    unlimited = ww.Allocator("waterwave", ww.SimDevice(256 * MiB, 0.0))
    unlimited.set_max_split_size(-1)  # chosen at run time: no limit, which stands
    assert cache_splits.keep_large_blocks_whole(unlimited) == -1
    assert unlimited.stats()["max_split_size"] == -1



@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_at_the_sharing_limit_a_freed_large_segment_serves_no_smaller_request(policy):
    """What keeping blocks of 20 MiB or more whole costs: requests of 1-10
    MiB (a pass's activations) are split from 20 MiB segments, and at a
    limit of exactly that size (a sharing session's, PyTorch's smallest) a
    segment whose blocks were all freed is one oversize block that no such
    request may take again, so the next pass's activations make a new
    segment (under a cap: segments given back and made again every step).
    A MiB above it, the segment serves them. The session keeps 20 MiB: over
    simulated convolutional nets near their caps, 21 MiB (with each stream
    kept to its own segments) ran out where 20 trained (docs/results.md)."""
    from waterwave.alloc import cache_splits

    def segments_made(limit: int) -> int:
        a = ww.Allocator(policy, ww.SimDevice(256 * MiB, 0.0))
        a.set_max_split_size(limit)
        for _ in range(3):  # three passes' activations, freed after each
            ptrs = [a.alloc(4 * MiB) for _ in range(4)]
            for p in ptrs:
                a.free(p)
        return a.stats()["segment.all.allocated"]

    session = ww.Allocator(policy, ww.SimDevice(256 * MiB, 0.0))
    assert segments_made(cache_splits.keep_large_blocks_whole(session)) == 3
    assert segments_made(21 * MiB) == 1


def test_a_limit_chosen_on_the_gpu_is_kept_and_known(fake):
    ww.cuda.configure("waterwave", "", driver=fake.path)
    ptr = _C.cuda_malloc(MiB, 0, 0)  # the device's allocator exists
    try:
        assert not ww.cuda.max_split_size_chosen(0)
        ww.cuda.set_max_split_size_mb(None, 0)  # the user's choice: no limit; a session keeps it
        assert ww.cuda.max_split_size_chosen("cuda:0")
        assert ww.cuda.allocator(0).stats()["max_split_size"] == -1
        ww.cuda.set_max_split_size_mb(64, device=0)
        assert ww.cuda.allocator(0).stats()["max_split_size"] == 64 * MiB
    finally:
        _C.cuda_free(ptr, MiB, 0, 0)
