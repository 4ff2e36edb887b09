"""The pytorch policy decides as PyTorch 2.14's CUDACachingAllocator does
(docs/design/pytorch-policy.md), rule by rule."""
import pytest
from conftest import MiB, make

import waterwave as ww


def P(**kw):
    kw.setdefault("capacity", 1024 * MiB)
    return make("pytorch", **kw)


def segs(a):
    return [(s["size"], s["pool"]) for s in a.snapshot()]


@pytest.mark.parametrize(
    "request_bytes, segment, pool",
    [(1, 2 * MiB, "small"), (MiB, 2 * MiB, "small"), (MiB + 1, 20 * MiB, "large"),
     (9 * MiB, 20 * MiB, "large"), (10 * MiB, 10 * MiB, "large"), (15 * MiB + 7, 16 * MiB, "large")],
)
def test_pool_and_segment_size(request_bytes, segment, pool):
    a = P()
    a.alloc(request_bytes, 0)
    assert segs(a) == [(segment, pool)]


def test_blocks_serve_only_their_own_stream():
    a = P()
    p = a.alloc(4096, 0)
    a.free(p)
    q = a.alloc(4096, 1)
    assert q != p
    s = a.stats()
    assert s["num_device_alloc"] == 2
    assert a.alloc(4096, 0) == p


def test_best_fit_picks_the_smallest_block_lowest_address():
    a = P()
    ptrs = [a.alloc(n, 0) for n in (8192, 512, 16384, 512, 4096, 512)]
    for p in ptrs[0::2]:
        a.free(p)  # three holes, kept apart by the 512-byte spacers
    assert a.alloc(3000, 0) == ptrs[4]  # 4096 fits best
    assert a.alloc(5000, 0) == ptrs[0]  # then 8192
    assert a.alloc(9000, 0) == ptrs[2]


def test_small_pool_splits_when_512_bytes_remain():
    a = P()
    a.alloc(2 * MiB - 512, 0)
    assert a.stats()["inactive_split.all.current"] == 1  # 512-byte remainder
    b = P()
    b.alloc(MiB, 0)
    assert b.stats()["inactive_split_bytes.small_pool.current"] == MiB


def test_large_pool_splits_only_when_more_than_1mib_remains():
    a = P()
    a.alloc(19 * MiB, 0)  # remainder exactly 1 MiB: not split
    s = a.stats()
    assert s["allocated_bytes.all.current"] == 20 * MiB
    assert s["requested_bytes.all.current"] == 19 * MiB
    b = P()
    b.alloc(18 * MiB, 0)  # remainder 2 MiB: split
    assert b.stats()["allocated_bytes.all.current"] == 18 * MiB


def test_oversize_rules_with_max_split_size():
    a = P(max_split_size_mb=20)
    big = a.alloc(60 * MiB, 0)
    a.free(big)
    # A request below max_split never takes an oversize block.
    small = a.alloc(12 * MiB, 0)
    assert small != big
    # An oversize request takes an oversize block only within the slack
    # (max_non_split_rounding, 20 MiB): 60 >= 30 + 20, so no.
    other = a.alloc(30 * MiB, 0)
    assert other != big
    # 60 < 45 + 20: taken whole, not split.
    whole = a.alloc(45 * MiB, 0)
    assert whole == big
    assert a.allocation_size(whole) == 60 * MiB
    s = a.stats()
    assert s["oversize_allocations.current"] == 2  # the 60 MiB block and the 30 MiB one
    assert s["oversize_segments.current"] == 2  # 60 and 30 MiB; the 12 MiB one is not


def test_free_merges_with_free_neighbours():
    a = P()
    p = a.alloc(4096, 0)
    q = a.alloc(4096, 0)
    r = a.alloc(4096, 0)
    a.free(p)
    a.free(r)
    assert a.stats()["inactive_split.all.current"] == 2  # p, and r merged with the tail
    a.free(q)
    s = a.stats()
    assert [(b["size"], b["state"]) for b in a.snapshot()[0]["blocks"]] == [(2 * MiB, "free")]
    assert s["inactive_split.all.current"] == 0


def test_record_stream_defers_the_free_until_the_event_completes():
    a = P(overhead=0.0)
    p = a.alloc(4096, 0)
    a.record_stream(p, 1)
    a.record_stream(p, 0)  # its own stream: ignored
    a.launch(1, 100.0, [p])
    a.free(p)
    s = a.stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 4096  # pending free
    assert s["pending_free_bytes"] == 4096
    assert a.snapshot()[0]["blocks"][0]["state"] == "pending_free"
    q = a.alloc(4096, 0)  # event still pending: not reused
    assert q != p
    a.device.advance_host(200.0)
    r = a.alloc(4096, 0)  # process_events at malloc retires it first
    assert r == p
    assert a.hazards() == []


def test_oom_fallback_releases_cached_segments_and_retries():
    a = P(capacity=40 * MiB)
    p = a.alloc(20 * MiB, 0)
    a.free(p)
    q = a.alloc(30 * MiB, 1)  # needs stream 0's cached segment released
    assert q
    s = a.stats()
    assert s["num_alloc_retries"] == 1 and s["num_sync_all_streams"] == 1
    assert s["num_device_free"] == 1
    assert s["served.after_sync"] == 1


def test_release_available_cached_blocks_with_max_split_size():
    a = P(capacity=80 * MiB, max_split_size_mb=20)
    p = a.alloc(60 * MiB, 0)
    a.free(p)
    q = a.alloc(30 * MiB, 0)  # 60 MiB block rejected (>= 30 + 20); it is released instead
    assert q
    s = a.stats()
    assert s["num_device_free"] == 1
    assert s["num_alloc_retries"] == 0  # no full release was needed


def test_release_available_frees_several_oversize_blocks_largest_first():
    a = P(capacity=100 * MiB, max_split_size_mb=20)
    ptrs = [a.alloc(n * MiB, 0) for n in (22, 24, 26)]
    for p in ptrs:
        a.free(p)
    # 60 MiB needed, 28 MiB free on the device: release 26 + 24 (= 50 < 60), then 22.
    q = a.alloc(60 * MiB, 0)
    assert q
    assert a.stats()["num_device_free"] == 3


def test_garbage_collection_frees_old_blocks():
    a = P(capacity=200 * MiB, per_process_memory_fraction=0.5, garbage_collection_threshold=0.5)
    # Allowed 100 MiB, GC threshold 50 MiB. get_free_block calls age blocks.
    old = a.alloc(40 * MiB, 0)  # call 1: miss, new 40 MiB segment
    a.free(old)
    young = a.alloc(30 * MiB, 0)  # call 2: split from the 40 MiB block
    assert young == old
    a.free(young)  # merged back, last touched at call 2
    other = a.alloc(30 * MiB, 1)  # call 3: miss; reserved 40 <= 50, no GC; now 70
    a.free(other)  # touched at call 3
    a.alloc(12 * MiB, 2)  # call 4: miss; GC must reclaim 20 MiB: ages 2 and 1, mean 1.5
    s = a.stats()
    assert s["num_device_free"] == 1  # only the older 40 MiB block
    assert s["reserved_bytes.all.current"] == (30 + 12) * MiB
    assert {(seg["size"], seg["stream"]) for seg in a.snapshot()} == {(30 * MiB, 1), (12 * MiB, 2)}


def test_memory_fraction_limits_reserved_memory():
    a = P(capacity=100 * MiB, per_process_memory_fraction=0.25)
    with pytest.raises(ww.OutOfMemoryError, match="per_process_memory_fraction allows 25.00 MiB"):
        a.alloc(30 * MiB)
    assert a.alloc(20 * MiB)


def test_statistics_have_pytorch_keys_and_pools():
    a = P()
    p = a.alloc(1000, 0)
    a.alloc(3 * MiB, 0)
    s = a.stats()
    for metric in ("allocation", "allocated_bytes", "requested_bytes", "active", "active_bytes",
                   "segment", "reserved_bytes", "inactive_split", "inactive_split_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{metric}.{pool}.{field}" in s
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "max_split_size", "oversize_allocations.current",
                "oversize_segments.peak"):
        assert key in s
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["max_split_size"] == -1
    a.free(p)
    assert a.stats()["allocated_bytes.small_pool.freed"] == 1024


def test_pointer_errors(policy):
    a = make(policy)
    p = a.alloc(4096)
    a.free(p)
    with pytest.raises(ww.PointerError, match="double free"):
        a.free(p)
    with pytest.raises(ww.PointerError):
        a.allocation_size(p)
