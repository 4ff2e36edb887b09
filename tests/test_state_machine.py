"""Hypothesis state machines over random multi-stream sequences (alloc, free,
record_stream, launch, sync, empty_cache, host time, max_split_size and
own_segments_first changed at run time) for both policies, with and without
expandable segments.

After every step: the C++ invariant check; from the snapshot, no two live
blocks overlap, blocks tile their segments, reserved = allocated + cached free
(+ pending frees), every free block is in exactly one state; no hazard; and
the statistics equal a shadow model kept here. After SyncAndCoalesce no two
adjacent free blocks remain in a segment.
"""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import pytest

import waterwave as ww

MiB = 1024**2
STREAMS = st.integers(0, 3)
SIZES = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, MiB),
    st.integers(MiB + 1, 12 * MiB),
    st.integers(12 * MiB, 40 * MiB),
)
CONFIGS = ["", "max_split_size_mb:24", "roundup_power2_divisions:[1:2,16:4,>:8]",
           "per_process_memory_fraction:0.8,garbage_collection_threshold:0.5,max_split_size_mb:20",
           "expandable_segments:True",
           "expandable_segments:True,per_process_memory_fraction:0.7,max_split_size_mb:20",
           "own_segments_first:True",
           "own_segments_first:True,per_process_memory_fraction:0.7,max_split_size_mb:20"]


class AllocatorMachine(RuleBasedStateMachine):
    policy = "waterwave"
    ptrs = Bundle("ptrs")
    freed = Bundle("freed")

    def __init__(self):
        super().__init__()
        self.a = None
        self.live = {}  # ptr -> (requested, stream)
        self.shared = set()  # live ptrs used on another stream (record_stream)
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.just_synced = False
        self.double_frees_rejected = 0
        self.expandable = False

    @initialize(config=st.sampled_from(CONFIGS), capacity_mb=st.sampled_from([48, 96, 256]))
    def setup(self, config, capacity_mb):
        if self.a is None:
            self.a = ww.Allocator(self.policy, ww.SimDevice(capacity_mb * MiB, 1.0), config)
            self.expandable = "expandable_segments:True" in config

    def ready(self):
        if self.a is None:
            self.a = ww.Allocator(self.policy, ww.SimDevice(96 * MiB, 1.0))
        self.just_synced = False
        return self.a

    @rule(target=ptrs, size=SIZES, stream=STREAMS)
    def alloc(self, size, stream):
        a = self.ready()
        try:
            p = a.alloc(size, stream)
        except ww.OutOfMemoryError as e:
            assert "out of memory" in str(e)
            return None
        assert p not in self.live
        assert a.allocation_size(p) >= size
        self.live[p] = (size, stream)
        self.shared.discard(p)
        return p

    @rule(target=freed, p=consumes(ptrs))
    def free(self, p):
        a = self.ready()
        if p is None:
            return None
        a.free(p)
        del self.live[p]
        return p

    @rule(p=freed)
    def double_free_is_rejected(self, p):
        a = self.ready()
        if p is None or p in self.live:  # the address may have been handed out again
            return
        try:
            a.free(p)
        except ww.PointerError:
            self.double_frees_rejected += 1
            return
        raise AssertionError("a double free was accepted")

    @rule(p=ptrs, stream=STREAMS, duration=st.floats(0, 200))
    def use_on_stream(self, p, stream, duration):
        a = self.ready()
        if p is None or p not in self.live:
            return
        a.record_stream(p, stream)
        if stream != self.live[p][1]:
            self.shared.add(p)
        a.launch(stream, duration, [p])

    @rule(stream=STREAMS, duration=st.floats(0, 300), data=st.data())
    def launch(self, stream, duration, data):
        a = self.ready()
        own = sorted(p for p, (_, s) in self.live.items() if s == stream)
        uses = data.draw(st.lists(st.sampled_from(own), max_size=3, unique=True)) if own else []
        a.launch(stream, duration, uses)

    @rule()
    def sync_and_coalesce(self):
        self.ready().sync_and_coalesce()
        self.just_synced = True

    @rule()
    def empty_cache(self):
        self.ready().empty_cache()
        self.just_synced = True

    @rule(mb=st.sampled_from([None, 20, 24, 32]))
    def set_max_split_size(self, mb):
        self.ready().set_max_split_size(-1 if mb is None else mb * MiB)

    @rule(on=st.booleans())
    def set_own_segments_first(self, on):
        a = self.ready()
        if self.expandable and on:  # exclusive: refused, nothing changed
            with pytest.raises(ww.ConfigError, match="expandable_segments"):
                a.set_own_segments_first(on)
            assert not a.config.own_segments_first
            return
        a.set_own_segments_first(on)
        assert a.config.own_segments_first == on

    @rule(us=st.floats(0, 500))
    def advance_host(self, us):
        self.ready().device.advance_host(us)

    @rule()
    def synchronize(self):
        self.ready().synchronize()

    @invariant()
    def consistent(self):
        a = self.a
        if a is None:
            return
        a.check_invariants()
        assert a.hazards() == []
        snap = a.snapshot()
        s = a.stats()
        reserved = allocated = cached = pending = pending_requested = largest = 0
        last_end = 0
        allocated_ptrs = {}
        for seg in snap:
            assert seg["addr"] >= last_end, "segments overlap"
            last_end = seg["addr"] + seg["size"]
            reserved += seg["size"]
            cursor = seg["addr"]
            prev_free = False
            for b in seg["blocks"]:
                assert b["addr"] == cursor, "blocks overlap or leave a gap"
                cursor += b["size"]
                state = b["state"]
                assert state in ("allocated", "unsynced", "synced", "free", "pending_free")
                if state == "allocated":
                    allocated += b["size"]
                    allocated_ptrs[b["addr"]] = b["requested"]
                elif state == "pending_free":
                    pending += b["size"]
                    pending_requested += b["requested"]
                else:
                    cached += b["size"]
                    largest = max(largest, b["size"])
                is_free = state in ("synced", "free", "unsynced", "pending_free")
                if self.just_synced:
                    assert not (is_free and prev_free), "adjacent free blocks after sync"
                prev_free = is_free
            assert cursor == seg["addr"] + seg["size"]
        # Shadow model.
        assert allocated_ptrs == {p: req for p, (req, _) in self.live.items()}
        assert reserved == allocated + cached + pending
        assert s["reserved_bytes.all.current"] == reserved == a.device.reserved_bytes()
        assert s["allocated_bytes.all.current"] == allocated
        assert s["allocation.all.current"] == len(self.live)
        assert s["requested_bytes.all.current"] == sum(r for r, _ in self.live.values()) + pending_requested
        assert s["active_bytes.all.current"] == allocated + pending
        if self.expandable:  # mapped pages, in runs; a segment per stream and pool
            assert all(seg["expandable"] for seg in snap)
            assert a.device.mapped_bytes() == reserved
            pages = sum(seg["size"] // self.page(seg["pool"]) for seg in snap)
            assert s["num_device_alloc"] - s["num_device_free"] == pages
            assert s["segment.all.current"] >= (1 if snap else 0)
        else:
            assert s["segment.all.current"] == len(snap)
            assert s["num_device_alloc"] - s["num_device_free"] == len(snap)
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)
        assert s["allocated_bytes.all.peak"] == self.peak_allocated
        assert s["reserved_bytes.all.peak"] == self.peak_reserved
        free_sets = s["synced_free_bytes"] + s["unsynced_free_bytes"]
        assert free_sets == cached
        if self.policy == "waterwave":  # its free blocks are all in its sets
            assert s["largest_free_block"] == largest
        # Oversize counts follow max_split_size, also after it changed (an
        # expandable segment's pages are counted as they map, not as here).
        limit = s["max_split_size"] if s["max_split_size"] >= 0 else float("inf")
        assert self.expandable or s["oversize_segments.current"] == sum(seg["size"] >= limit for seg in snap)
        assert s["oversize_allocations.current"] == sum(
            b["size"] >= limit for seg in snap for b in seg["blocks"] if b["state"] == "allocated")
        assert 0.0 <= s["fragmentation.at_peak_reserved"] <= 1.0


    def page(self, pool):
        return 2 * MiB if pool == "small" or self.policy == "waterwave" else 20 * MiB


class WaterwaveMachine(AllocatorMachine):
    policy = "waterwave"


class PytorchMachine(AllocatorMachine):
    policy = "pytorch"

    # A private pool restored to a checkpoint (setCheckpointPoolState) hands
    # its blocks out again where they were: a freed block comes back in
    # place; a live one is never handed out twice.
    @rule(p=AllocatorMachine.ptrs)
    def free_and_restore_in_place(self, p):
        a = self.ready()
        if p is None or p not in self.live or p in self.shared:
            return  # a block used on other streams waits on events once freed
        size, (requested, _) = a.allocation_size(p), self.live[p]
        a.free(p)
        assert a._allocate_at(p, size, requested) == p
        assert a.allocation_size(p) == size

    @rule(p=AllocatorMachine.ptrs)
    def restoring_over_a_live_block_is_refused(self, p):
        a = self.ready()
        if p is None or p not in self.live:
            return
        before = a.stats()["allocated_bytes.all.current"]
        try:
            a._allocate_at(p, a.allocation_size(p), 1)
        except ValueError as e:
            assert "not one cached free block" in str(e)
        else:
            raise AssertionError("a live block was handed out twice")
        assert a.stats()["allocated_bytes.all.current"] == before


SETTINGS = settings(max_examples=80, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestWaterwaveMachine = WaterwaveMachine.TestCase
TestWaterwaveMachine.settings = SETTINGS
TestPytorchMachine = PytorchMachine.TestCase
TestPytorchMachine.settings = SETTINGS
