"""Expandable segments (``expandable_segments:True``) on the simulated device:
the device's virtual memory calls, PyTorch's semantics under the ``pytorch``
policy, and pages moving between streams under the ``waterwave`` policy.
The random runs with invariants after every step are in
test_state_machine.py and the sanitizer runs (``make sanitize``)."""
from pathlib import Path

import pytest

import waterwave as ww
from waterwave.sim.trace import from_snapshot

MiB = 1024**2
EXPANDABLE = "expandable_segments:True"
SNAPSHOTS = Path(__file__).resolve().parent.parent / "bench" / "data" / "gpu-snapshots"


# ---- The simulated device's virtual memory. ----

def test_device_maps_pages_into_reserved_addresses_against_its_capacity():
    d = ww.SimDevice(8 * MiB, 0.0)
    va = d.reserve_address(64 * MiB)  # address space is not memory
    assert d.reserved_bytes() == 0
    assert d.map(va, 4 * MiB) and d.map(va + 4 * MiB, 4 * MiB)
    assert d.mapped_bytes() == 8 * MiB and d.free_memory() == 0
    assert not d.map(va + 8 * MiB, 2 * MiB)  # out of memory: a clean False
    d.remap(va, va + 16 * MiB, 4 * MiB)  # same memory, new address
    assert d.mapped_bytes() == 8 * MiB
    d.unmap(va + 16 * MiB, 4 * MiB)
    assert d.free_memory() == 4 * MiB


@pytest.mark.parametrize("call, message", [
    (lambda d, va: d.map(va + MiB, 2 * MiB), "not whole 2 MiB pages"),
    (lambda d, va: d.map(va + 64 * MiB, 2 * MiB), "outside every reserved address range"),
    (lambda d, va: d.map(va, 2 * MiB), "already mapped"),
    (lambda d, va: d.unmap(va, 4 * MiB), "not whole mappings"),
    (lambda d, va: d.release_address(va, 64 * MiB), "still mapped"),
    (lambda d, va: d.remap(va, va, 2 * MiB), "already mapped"),
])
def test_device_refuses_a_wrong_virtual_memory_call(call, message):
    d = ww.SimDevice(64 * MiB, 0.0)
    va = d.reserve_address(64 * MiB)
    d.map(va, 2 * MiB)
    with pytest.raises(ValueError, match=message):
        call(d, va)


def test_unmapping_pages_a_pending_kernel_touches_is_a_hazard():
    d = ww.SimDevice(64 * MiB, 0.0)
    va = d.reserve_address(8 * MiB)
    d.map(va, 2 * MiB)
    d.map(va + 2 * MiB, 2 * MiB)
    d.launch_ranges(1, 100.0, [(va, 4 * MiB)])
    d.unmap(va, 2 * MiB)  # the kernel may still run
    (h,) = d.hazards()
    assert h["other_stream"] == 1 and "unmapped" in h["message"]
    d.synchronize()
    d.unmap(va + 2 * MiB, 2 * MiB)  # finished: safe
    assert len(d.hazards()) == 1


# ---- Both policies. ----

@pytest.mark.parametrize("policy", ["pytorch", "waterwave"])
def test_a_segment_grows_in_place_and_empty_cache_gives_whole_pages_back(policy):
    a = ww.Allocator(policy, ww.SimDevice(1024 * MiB, 0.0), EXPANDABLE)
    ptrs = [a.alloc(30 * MiB) for _ in range(4)]
    (seg,) = a.snapshot()  # one segment, grown, not four
    assert seg["expandable"] and seg["size"] >= 120 * MiB
    assert ptrs == sorted(ptrs) and ptrs[1] - ptrs[0] == 30 * MiB  # no slivers between
    for p in ptrs[1:]:
        a.free(p)
    a.empty_cache()
    s = a.stats()
    # The live block's pages stay; every other whole page goes back.
    page = 20 * MiB if policy == "pytorch" else 2 * MiB
    assert s["reserved_bytes.all.current"] == -(-30 * MiB // page) * page
    assert a.device.mapped_bytes() == s["reserved_bytes.all.current"]
    assert s["inactive_split.all.current"] == 0  # as PyTorch: not counted in expandable segments
    a.free(ptrs[0])
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0 == a.device.mapped_bytes()
    a.check_invariants()


@pytest.mark.parametrize("policy", ["pytorch", "waterwave"])
def test_a_refused_map_fails_the_request_cleanly(policy):
    # 64 MiB of device memory: the first request maps it all, the second
    # cannot map more, raises, and leaves nothing half done.
    a = ww.Allocator(policy, ww.SimDevice(64 * MiB, 0.0), EXPANDABLE)
    p = a.alloc(60 * MiB)
    with pytest.raises(ww.OutOfMemoryError, match="out of memory"):
        a.alloc(30 * MiB)
    a.check_invariants()
    a.free(p)
    q = a.alloc(30 * MiB)  # the freed pages serve it
    a.free(q)
    a.empty_cache()
    assert a.device.mapped_bytes() == 0
    a.check_invariants()


def test_pytorch_policy_keeps_pages_per_stream_until_out_of_memory():
    """PyTorch's semantics: a segment per stream; a page freed on one stream
    reaches another only when memory runs out and the cache is emptied."""
    a = ww.Allocator("pytorch", ww.SimDevice(100 * MiB, 0.0), EXPANDABLE)
    p = a.alloc(60 * MiB, stream=1)
    a.free(p)
    q = a.alloc(40 * MiB, stream=2)  # 60 + 40 fits: new pages for stream 2
    assert a.stats()["reserved_bytes.all.current"] == 100 * MiB
    a.free(q)
    r = a.alloc(80 * MiB, stream=2)  # does not fit: stream 1's pages are unmapped, then mapped here
    s = a.stats()
    assert s["num_alloc_retries"] == 1 and s["reserved_bytes.all.current"] == 80 * MiB
    assert s["num_page_moves"] == 0
    a.free(r)
    a.check_invariants()


def test_waterwave_policy_moves_idle_pages_to_the_stream_that_grows():
    a = ww.Allocator("waterwave", ww.SimDevice(1024 * MiB, 0.0), EXPANDABLE)
    p = a.alloc(60 * MiB, stream=1)
    a.launch(1, 50.0, [p])
    a.free(p)
    a.synchronize()  # stream 1's work is done: its free pages are idle
    q = a.alloc(40 * MiB, stream=2)  # the idle block itself, where it is
    r = a.alloc(40 * MiB, stream=2)  # stream 2's segment grows with the other 20 MiB of pages
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 80 * MiB  # not 60 + 80
    assert s["num_page_moves"] == 10  # 2 MiB pages
    home = {b["addr"]: g["stream"] for g in a.snapshot() for b in g["blocks"]}
    assert (home[q], home[r]) == (1, 2)
    assert a.hazards() == []
    a.check_invariants()


def test_waterwave_policy_never_moves_pages_a_kernel_may_touch():
    a = ww.Allocator("waterwave", ww.SimDevice(1024 * MiB, 0.0), EXPANDABLE)
    p = a.alloc(60 * MiB, stream=1)
    a.launch(1, 1e6, [p])  # a long kernel still running
    a.free(p)
    q = a.alloc(60 * MiB, stream=2)
    assert a.stats()["num_page_moves"] == 0
    a.launch(2, 10.0, [q])
    assert a.hazards() == []
    a.check_invariants()


def test_waterwave_policy_out_of_memory_moves_only_the_pages_it_needs():
    """Out of memory with expandable segments: after SyncAndCoalesce every
    free page is idle, and growth moves as many as the request needs; none
    is unmapped only to be mapped again (which cost a device call per page
    twice over: 5,933 unmaps for 7,388 maps in a simulated resnet18 pair)."""
    a = ww.Allocator("waterwave", ww.SimDevice(100 * MiB, 0.0), EXPANDABLE)
    p1, p2, p3 = (a.alloc(n * MiB, stream=1) for n in (30, 10, 30))
    a.launch(1, 1e3, [p1, p2, p3])
    a.free(p1)
    a.free(p3)  # 60 MiB free on stream 1, in two pieces, still in use by the GPU
    a.alloc(50 * MiB, stream=2)  # 30 MiB left on the device: only after the sync
    s = a.stats()
    assert s["num_oom_retries"] == 1 and s["num_device_free"] == 0
    assert s["num_page_moves"] == 25  # 50 MiB in 2 MiB pages, all moved, none new
    assert s["num_device_alloc"] == 35  # stream 1's 70 MiB, mapped once
    assert a.hazards() == []
    a.check_invariants()


# ---- The shared H100 snapshots (simulated replays). ----

@pytest.mark.parametrize("name", ["r18_solo", "r18_2jobs", "r50_phased"])
def test_expandable_segments_cut_what_every_snapshot_reserves(name):
    trace = from_snapshot(str(SNAPSHOTS / f"{name}.pickle.gz"))
    reserved = {}
    for policy in ("pytorch", "waterwave"):
        for config in ("", EXPANDABLE):
            s = trace.replay(policy, config=config)
            assert s["hazards"] == []
            reserved[policy, config] = s["reserved_bytes.all.peak"]
    assert reserved["waterwave", ""] <= reserved["pytorch", ""]
    assert reserved["pytorch", EXPANDABLE] < reserved["pytorch", ""]
    assert reserved["waterwave", EXPANDABLE] <= reserved["pytorch", EXPANDABLE]
