"""The plan allocator: planned offsets, deviations, and never corrupting memory."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_graphs import random_graphs

import waterwave as ww
from waterwave.planner import plan, plan_slots
from waterwave.graph.lifetimes import allocation_events

MiB = 1024**2


def run_step(pa, g, p):
    """Allocate and free as the plan's order does, running its in-place pairs
    in place; returns the pointers seen."""
    ptr, seen = {}, []
    into = dict(p.inplace)
    for kind, t in allocation_events(g, p.order, p.inplace):
        if kind == "alloc":
            ptr[t] = pa.alloc(g.tensors[t].size)
            seen.append(ptr[t])
        elif kind == "inplace":
            if into[t] in ptr:  # written into a tensor of the step (not a graph input)
                ptr[t] = ptr.pop(into[t])
        else:
            pa.free(ptr.pop(t))
    for t in list(ptr):
        pa.free(ptr.pop(t))
    return seen


@given(random_graphs())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_matching_program_is_served_entirely_from_the_plan(g):
    p = plan(g, "greedy")  # in-place pairs included: run_step runs them in place
    slots, arena = plan_slots(g, p)
    pa = ww.PlanAllocator(p, graph=g, device=ww.SimDevice(64 * MiB, 0.0))
    for step in range(3):
        pa.begin_step()
        seen = run_step(pa, g, p)
        base = pa.plan_stats()["arena"]
        assert [s - base for s in seen] == [o for _, o in slots]
    stats = pa.plan_stats()
    assert stats["deviations"] == 0 and stats["fallback"] == 0
    assert stats["planned"] == 3 * len(slots)
    assert pa.stats()["reserved_bytes.all.current"] == arena  # nothing beyond the arena
    pa.check_invariants()


def test_a_plan_with_in_place_sharing_is_served_entirely_when_run_in_place():
    """Running the relu in place (as waterwave.optimize does for every planned
    pair), the step allocates what the plan expects and nothing more."""
    from test_planner import shrinking_after_relu

    g = shrinking_after_relu()
    p = plan(g, "greedy")
    assert p.inplace
    slots, arena = plan_slots(g, p)
    assert len(slots) == 3  # a, c and e: b is written into a
    pa = ww.PlanAllocator(p, graph=g, device=ww.SimDevice(64 * MiB, 0.0))
    for _ in range(2):
        pa.begin_step()
        run_step(pa, g, p)
    stats = pa.plan_stats()
    assert stats["deviations"] == 0 and stats["fallback"] == 0 and stats["planned"] == 6
    assert pa.stats()["reserved_bytes.all.current"] == arena == (1 << 20) + (16 << 10)
    pa.check_invariants()


def test_deviations_fall_back_and_are_counted():
    pa = ww.PlanAllocator([(1024, 0), (2048, 1024)], device=ww.SimDevice(64 * MiB, 0.0))
    a = pa.alloc(1000)
    b = pa.alloc(5000)  # the plan says 2048: deviation
    c = pa.alloc(2048)  # the rest of the step stays off-plan
    s = pa.plan_stats()
    assert s["planned"] == 1 and s["fallback"] == 2 and s["deviations"] == 1
    assert "asks for 5120 bytes, the plan has 2048" in s["last_deviation"]
    arena = s["arena"]
    assert arena <= a < arena + 3072
    assert not any(arena <= p < arena + 3072 for p in (b, c))
    for p in (a, b, c):
        pa.free(p)
    pa.begin_step()
    assert pa.alloc(1024) == arena  # a new step is back on plan
    pa.check_invariants()


def test_a_step_that_ends_early_is_a_deviation():
    pa = ww.PlanAllocator([(1024, 0), (2048, 1024)], device=ww.SimDevice(64 * MiB, 0.0))
    a = pa.alloc(1000)
    pa.begin_step()  # the plan's second allocation never came
    s = pa.plan_stats()
    assert s["planned"] == 1 and s["fallback"] == 0 and s["deviations"] == 1
    assert "ended after 1 of the plan's 2 allocations" in s["last_deviation"]
    pa.free(a)
    assert pa.alloc(1024) == s["arena"]  # a new step is back on plan
    pa.check_invariants()


def test_other_stream_and_extra_allocations_leave_the_plan():
    pa = ww.PlanAllocator([(512, 0)], device=ww.SimDevice(64 * MiB, 0.0), stream=0)
    x = pa.alloc(512, 1)
    assert "stream 1" in pa.plan_stats()["last_deviation"]
    pa.free(x)
    pa.begin_step()
    y = pa.alloc(512, 0)
    z = pa.alloc(512, 0)  # the plan is used up and y is still live: slot occupied
    assert y != z
    s = pa.plan_stats()
    assert s["deviations"] == 2 and "still occupied" in s["last_deviation"]


def test_bad_plans_and_pointers_are_clear_errors():
    with pytest.raises(ww.ConfigError, match="plan is corrupt"):
        ww.PlanAllocator([(1024, 4096)], arena=2048)
    with pytest.raises(ww.OutOfMemoryError, match="arena"):
        ww.PlanAllocator([(1024, 0)], arena=1 << 40, device=ww.SimDevice(64 * MiB))
    pa = ww.PlanAllocator([(1024, 0)], device=ww.SimDevice(64 * MiB))
    p = pa.alloc(1024)
    pa.free(p)
    with pytest.raises(ww.PointerError, match="plan's arena"):
        pa.free(p)
    with pytest.raises(ValueError, match="graph"):
        ww.PlanAllocator(plan(__import__("test_planner").chain(), "greedy"))


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 16)), min_size=1, max_size=12),
       st.lists(st.tuples(st.booleans(), st.integers(1, 8 * 512), st.integers(0, 1)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_a_wrong_plan_never_hands_out_overlapping_memory(slots, program):
    """Slots overlap each other arbitrarily and the program ignores them:
    whatever happens, no two live blocks overlap and there are no hazards."""
    slots = [(512 * s, 512 * o) for s, o in slots]
    pa = ww.PlanAllocator(slots, device=ww.SimDevice(64 * MiB, 0.0))
    live = {}
    for i, (is_alloc, size, stream) in enumerate(program):
        if is_alloc or not live:
            p = pa.alloc(size, stream)
            n = pa.allocation_size(p)
            for q, m in live.items():
                assert p + n <= q or q + m <= p, "two live blocks overlap"
            live[p] = n
        else:
            q = sorted(live)[size % len(live)]
            pa.free(q)
            del live[q]
        if i % 7 == 6:
            pa.begin_step()
        pa.check_invariants()
    assert pa.hazards() == []


def test_several_streams_each_follow_their_own_plan():
    """The allocator stack holds one plan per stream: two jobs' steps
    interleave, each served wholly from its own arena, the arenas count as
    reserved memory, and another stream's allocations leave neither plan."""
    a = ww.Allocator("waterwave", ww.SimDevice(64 * MiB, 0.0))
    plans = {0: [(4096, 0), (8192, 4096), (4096, 12288)], 1: [(1024, 0), (1024, 1024)]}
    for stream, slots in plans.items():
        a.set_plan(stream, slots)
    for _ in range(3):
        live = []
        for k in range(3):
            for stream, slots in plans.items():
                if k < len(slots):
                    live.append(a.alloc(slots[k][0], stream))
            live.append(a.alloc(700, 2))  # an unplanned job beside them
        arenas = {s: a.plan_stats(s)["arena"] for s in plans}
        assert live[0] == arenas[0] and live[1] == arenas[1]
        for p in live:
            a.free(p)
        for stream in plans:
            a.begin_step(stream)
    for stream, slots in plans.items():
        st = a.plan_stats(stream)
        assert st["planned"] == 3 * len(slots) and st["deviations"] == st["fallback"] == 0
    assert a.stats()["reserved_bytes.all.current"] >= 16384 + 2048
    with pytest.raises(ww.ConfigError, match="several streams have a plan"):
        a.plan_stats()
    a.check_invariants()
    a.clear_plan()
    assert a.hazards() == []


def test_a_planned_block_used_on_another_stream_is_fenced():
    """record_stream on a planned block: when it is freed, the plan's stream
    waits on the other stream's work before the slot's bytes go out again."""
    a = ww.Allocator("waterwave", ww.SimDevice(64 * MiB, 1.0))
    a.set_plan(0, [(1024, 0)])
    p = a.alloc(1024, 0)
    a.record_stream(p, 1)
    a.launch(1, 1000.0, [p])  # still running on stream 1
    a.free(p)
    a.begin_step(0)
    assert a.alloc(1024, 0) == p
    assert a.hazards() == []


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8), st.integers(0, 3)), max_size=80),
       st.integers(1, 6))
@settings(max_examples=150, deadline=None)
def test_stream_plans_never_overlap_each_other_or_the_policy(program, unit):
    """Two streams with plans of overlapping random slots, a third without,
    record_stream and kernels: no two live blocks ever overlap, no hazards."""
    a = ww.Allocator("waterwave", ww.SimDevice(64 * MiB, 1.0))
    a.set_plan(0, [(512 * unit, 512 * k) for k in range(4)])
    a.set_plan(1, [(512 * unit, 0), (512 * unit, 512 * (unit - 1))])  # overlapping slots
    live = {}
    for stream, size, action in program:
        if action == 0 or not live:
            p = a.alloc(512 * (unit if size % 2 else size), stream)
            n = a.allocation_size(p)
            assert all(p + n <= q or q + m <= p for q, (m, _) in live.items()), "overlap"
            live[p] = (n, stream)
            a.launch(stream, 10.0 * size, [p])
        elif action == 1:
            q = sorted(live)[size % len(live)]
            a.free(q)
            del live[q]
        elif action == 2:
            q = sorted(live)[size % len(live)]
            a.record_stream(q, stream)
            a.launch(stream, 50.0, [q])
        else:
            a.begin_step(stream % 2)
        a.check_invariants()
    assert a.hazards() == []


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 64).map(lambda n: 512 * n),
                          st.one_of(st.integers(0, 1 << 16),
                                    st.integers(2 ** 64 - (1 << 20), 2 ** 64 - 1))),
                min_size=1, max_size=6),
       st.integers(1, 64).map(lambda n: 512 * n))
def test_a_slot_outside_the_arena_or_unaligned_is_refused_never_served(slots, arena):
    """set_plan's check is overflow-free: an offset near 2^64 once wrapped
    offset + size past the arena's end and put the slot before the arena,
    over live memory. A slot is accepted only inside the arena and aligned."""
    a = ww.Allocator("waterwave", device=ww.SimDevice(1 << 30))
    inside = all(o <= arena and s <= arena - o and o % 512 == 0 for s, o in slots)
    if inside:
        a.set_plan(0, slots, arena=arena)
        a.clear_plan(0)
    else:
        with pytest.raises(ww.ConfigError, match="the plan is corrupt"):
            a.set_plan(0, slots, arena=arena)
        assert not a.has_plan(0)


def test_a_plan_the_checker_rejects_is_refused_not_renormalised():
    """A plan whose tensors overlap (here, two live together moved onto one
    offset) was turned into slots anyway; now its PlanError comes through
    (issue 26, item 1)."""
    from test_planner import chain

    from waterwave.planner import PlanError

    g = chain()
    p = plan(g, "greedy")
    live = [t.id for t in g.tensors if not t.persistent and t.size]
    p.offsets[live[1]] = p.offsets[live[0]]
    with pytest.raises(PlanError, match="overlap"):
        ww.PlanAllocator(p, graph=g)
    p.offsets[live[0]] = -(1 << 70)
    with pytest.raises(PlanError):
        ww.PlanAllocator(p, graph=g)


def test_bad_numbers_and_streams_are_value_errors_naming_them():
    a = ww.Allocator("waterwave", device=ww.SimDevice(64 * MiB))
    with pytest.raises(ValueError, match="negative size"):
        a.alloc(-5)
    with pytest.raises(ValueError, match="the stream must be .* got -1"):
        a.alloc(512, -1)
    with pytest.raises(ValueError, match="the size must be .* got 1180591620717411303424"):
        a.alloc(1 << 70)
    with pytest.raises(ValueError, match="the pointer must be"):
        a.free(-1)
    with pytest.raises(TypeError, match="whole number"):
        a.alloc(512, 1.5)
    with pytest.raises(ww.ConfigError, match="stream 999 has no plan"):
        a.clear_plan(999)
    a.set_plan(3, [(512, 0)])
    a.clear_plan(3)
    assert not a.has_plan()
