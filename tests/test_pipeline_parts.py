"""The NodeGroup pipeline's parts: partitions (BFS order, two groups), the
pairings (Algorithm 1, the memory-aware rounds under a budget, what a job
holds after its last step), and the CounterBarrier."""
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from test_concurrent import pairs  # noqa: E402

from waterwave.pipeline.counter_barrier import CounterBarrier  # noqa: E402
from waterwave.pipeline.nodegroups import (  # noqa: E402
    auto_split_size,
    bfs_order,
    node_deltas,
    partition,
    two_groups,
)
from waterwave.pipeline.pairing import (  # noqa: E402
    FREE_MARGIN,
    MARGIN,
    SEGMENT_SLACK,
    SHARED_SMALL_POOL,
    SegmentSpare,
    JobGroups,
    JobPlan,
    MemoryPairing,
    iteration_rounds,
    memory_rounds,
    whole_run,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def graph():
    return pairs()[1].job.graph


def test_bfs_order_is_topological_and_groups_cover_it(graph):
    order = bfs_order(graph)
    pos = {v: i for i, v in enumerate(order)}
    assert all(pos[p] < pos[v] for v in order for p in graph.preds(v))
    part = partition(graph, 2048)
    assert [v for grp in part.groups for v in grp.nodes] == order
    deltas = node_deltas(graph, order)
    assert sum(g.delta for g in part.groups) == sum(deltas)
    assert all(abs(g.delta) >= 2048 for g in part.groups[:-1])
    assert part.num_angs >= 1 and part.groups[part.num_angs].kind == "DNG"
    assert auto_split_size(graph) >= max(abs(d) for d in deltas)
    # The simulator's node-group schedule cuts each peak in its `groups`:
    # one group per peak gives fewer, larger groups than the default eight.
    from waterwave.sim.schedules import NodeGroupSchedule

    whole = NodeGroupSchedule(groups=1).partition(graph)
    default = NodeGroupSchedule().partition(graph)
    assert whole.split_size == auto_split_size(graph, 1) >= default.split_size
    assert len(whole.groups) < len(default.groups)


def test_two_groups_cut_after_the_forward_pass(graph):
    part = two_groups(graph, "forward")
    assert len(part.groups) == 2 and part.groups[0].kind == "ANG"
    loss = min(graph.producer(t) for t in graph.meta["outputs"])
    assert part.groups[0].nodes[-1] == loss
    assert two_groups(graph, "peak").groups[0].delta == two_groups(graph, "peak").peak


# Pairing ----------------------------------------------------------------------
def test_algorithm1_pairs_the_second_jobs_allocations_beside_the_firsts_frees():
    jobs = [JobGroups(0, 4, 8, 10, 1), JobGroups(1, 4, 8, 10, 1)]
    rounds = iteration_rounds(jobs, memory_limit=13)  # p = (13 - 10) // 1 - 1 = 2
    assert rounds[:2] == [[(0, 0)], [(0, 1)]]
    assert rounds[2] == [(0, 2), (1, 0)] and rounds[3] == [(0, 3), (1, 1)]
    assert rounds[4] == [(0, 4), (1, 2)]  # job 1's ANGs beside job 0's DNGs
    assert all(len(r) <= 2 for r in rounds)
    for job in (0, 1):
        seen = [g for r in rounds for j, g in r if j == job]
        assert seen == list(range(8))


@given(st.lists(st.lists(st.integers(1, 6), min_size=2, max_size=8), min_size=1, max_size=4),
       st.integers(0, 3), st.integers(1, 3))
@settings(max_examples=100, deadline=None)
def test_memory_rounds_keep_each_job_in_order_and_within_the_budget(ups, slack, steps):
    """Jobs that rise then fall: every group runs once per step, in order;
    each round's planned memory stays within the limit whenever one job's
    whole step fits beside the others' persistent bytes; the jobs run free
    only when all their steps fit at once."""
    plans = []
    for j, up in enumerate(ups):
        groups = [(u, u) for u in up] + [(-u, 0) for u in reversed(up)]
        plans.append(JobPlan(j, 1, groups))
    limit = max(sum(u) for u in ups) + len(ups) + slack
    planner = MemoryPairing(plans, limit, steps, margin=0, free_margin=0, segment_slack=0)
    assert planner.fits
    out = whole_run(planner, steps)
    assert planner.forced == 0  # it fitted, so no group ran past the budget
    held = {p.job: p.persistent for p in plans}
    by_round = {}
    for p in plans:
        entries = out[p.job]
        assert [(s, g) for _, s, g in entries] == [(s, g) for s in range(steps)
                                                  for g in range(len(p.groups))]
        assert [r for r, _, _ in entries] == sorted(r for r, _, _ in entries)
        for r, _, g in entries:
            by_round.setdefault(r, []).append((p.job, g))
    if len(by_round) == 1:  # everything fits at once: the jobs run free
        peaks = [max(1 + sum(u[:i + 1]) for i in range(len(u))) for u in ups]
        assert sum(peaks) <= limit
        return
    for r in sorted(by_round):
        rise = sum(max(0, plans[j].groups[g][1]) for j, g in by_round[r])
        assert sum(held.values()) + rise <= limit
        for j, g in by_round[r]:
            held[j] += plans[j].groups[g][0]


@given(st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=2, max_size=6), st.integers(0, 8)),
                min_size=1, max_size=4),
       st.integers(0, 3), st.integers(1, 3))
@settings(max_examples=150, deadline=None)
def test_memory_rounds_keep_room_for_what_a_job_does_after_its_last_step(jobs, slack, steps):
    """A job's ``after`` bytes (its evaluation between training calls) are
    held from its last group on, beside every later round and beside the
    rest of the round its last group runs in (its thread goes on while the
    round's other groups run): memory planned for each round, with them,
    stays within the limit whenever each job's step fits beside what the
    others hold once finished."""
    plans = []
    for j, (up, after) in enumerate(jobs):
        groups = [(u, u) for u in up] + [(-u, 0) for u in reversed(up)]
        plans.append(JobPlan(j, 1, groups, after=after))
    rest = [1 + after for _, after in jobs]
    limit = max(1 + sum(up) + sum(rest) - rest[j] for j, (up, _) in enumerate(jobs)) + slack
    limit = max(limit, sum(rest))
    out = memory_rounds(plans, limit, steps, margin=0, free_margin=0, segment_slack=0)
    last = {p.job: out[p.job][-1][0] for p in plans}
    by_round = {}
    for p in plans:
        for r, _, g in out[p.job]:
            by_round.setdefault(r, []).append((p.job, g))
    if len(by_round) == 1:  # the jobs run free: each one's peak, training or after, at once
        peaks = [max(max(1 + sum(up[:i + 1]) for i in range(len(up))), 1 + after)
                 for up, after in jobs]
        assert sum(peaks) <= limit
        return
    held = {p.job: p.persistent for p in plans}
    for r in sorted(by_round):
        rise = 0
        for j, g in by_round[r]:
            delta, up = plans[j].groups[g]
            if r == last[j]:  # the job's evaluation starts beside this round
                up = max(up, delta + plans[j].after)
            rise += max(0, up)
        assert sum(held.values()) + rise <= limit
        for j, g in by_round[r]:
            held[j] += plans[j].groups[g][0] + (plans[j].after if r == last[j] else 0)
    assert held == {j: 1 + after for j, (_, after) in enumerate(jobs)}


@given(st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=2, max_size=8), st.integers(0, 8)),
                min_size=1, max_size=4),
       st.integers(0, 40), st.integers(0, 3), st.integers(1, 3), st.booleans())
@settings(max_examples=150, deadline=None)
def test_a_pairing_that_fits_its_budget_never_runs_a_group_past_it(jobs, limit, slack, steps,
                                                                   evaluating):
    """Under any limit, ``fits`` tells beforehand that the plan keeps to its
    budget: where it says so, no round's groups run past it (``forced``).
    Where the jobs hold nothing after their last step, that is exact: where
    it does not say so, some group does. Each job keeps back
    ``segment_slack`` bytes."""
    plans = []
    for j, (up, after) in enumerate(jobs):
        groups = [(u, u) for u in up] + [(-u, 0) for u in reversed(up)]
        plans.append(JobPlan(j, 1, groups, after=after if evaluating else 0))
    planner = MemoryPairing(plans, limit + len(jobs) * slack, steps, margin=0, free_margin=0,
                            segment_slack=slack)
    fits = planner.fits
    whole_run(planner, steps)
    if fits:
        assert planner.forced == 0
    if not evaluating:
        assert fits == (planner.free or len(jobs) + max(sum(u) for u, _ in jobs) <= limit)
        assert (planner.forced == 0) == fits


def test_paired_rounds_keep_back_their_margin_or_a_part_empty_segment_a_job_whichever_is_more():
    two = [JobPlan(0, 10 * MiB, [(5 * MiB, 5 * MiB), (-5 * MiB, 0)]),
           JobPlan(1, 10 * MiB, [(5 * MiB, 5 * MiB), (-5 * MiB, 0)])]
    never_free = {"free_margin": 1.0}
    bytes_only = 25 * MiB  # both jobs' state and one step, counted in bytes
    assert MemoryPairing(two, bytes_only, 1, segment_slack=0, margin=0, **never_free).fits
    assert not MemoryPairing(two, bytes_only, 1, margin=0, **never_free).fits
    assert MemoryPairing(two, bytes_only + 2 * SEGMENT_SLACK, 1, margin=0, **never_free).fits
    assert SEGMENT_SLACK == 22 * MiB  # a 2 MiB small-pool and a 20 MiB large-pool segment
    big = MemoryPairing(two, 10 << 30, 1, **never_free)  # 3% of 10 GiB is more than 44 MiB
    assert big.limit == (10 << 30) - int((10 << 30) * MARGIN)
    small = MemoryPairing(two, 1 << 30, 1, **never_free)
    assert small.limit == (1 << 30) - 2 * SEGMENT_SLACK


def test_jobs_run_free_where_their_steps_and_measured_spares_fit_else_with_a_margin():
    """Each job counts the most it holds in a step, and the spare its
    segments held beyond its blocks measured alone, and the jobs together a
    segment of the small pool they share where their small segments' spares
    leave less than one (``shared_small_pool``); a job not measured counts
    FREE_MARGIN of its bytes instead."""
    def two(spare, small=0):
        spare = None if spare is None else SegmentSpare(spare, small)
        return [JobPlan(j, 10 * MiB, [(5 * MiB, 5 * MiB), (-5 * MiB, 0)], segment_spare=spare)
                for j in range(2)]

    steps = 30 * MiB  # both jobs' state and steps at once
    shared = SHARED_SMALL_POOL
    assert shared == 2 * MiB
    assert MemoryPairing(two(0), steps + shared, 1).free
    assert not MemoryPairing(two(0), steps + shared - 1, 1).free
    assert not MemoryPairing(two(1), steps + shared, 1).free
    assert MemoryPairing(two(MiB), steps + 2 * MiB + shared, 1).free
    assert not MemoryPairing(two(MiB), steps + 2 * MiB + shared - 1, 1).free
    assert MemoryPairing(two(MiB // 2), steps + MiB + shared, 1).free
    # Spares of the small pool leaving a segment or more in all: none more.
    assert MemoryPairing(two(MiB, MiB), steps + 2 * MiB, 1).free
    assert not MemoryPairing(two(MiB, MiB - 1), steps + 2 * MiB, 1).free
    assert not MemoryPairing(two(None), steps + MiB, 1).free  # 5% of 30 MiB is more
    assert MemoryPairing(two(None), int(steps / (1 - FREE_MARGIN)) + 1, 1).free  # no pool counted
    mixed = [two(MiB)[0], two(None)[1]]
    mixed_need = 16 * MiB + int(15 * MiB / (1 - FREE_MARGIN)) + shared
    assert MemoryPairing(mixed, mixed_need + 1, 1).free
    assert not MemoryPairing(mixed, mixed_need - 1, 1).free
    measured = MemoryPairing(two(None), steps + MiB + shared, 1)
    for j in range(2):
        measured.update(j, [(5 * MiB, 5 * MiB), (-5 * MiB, 0)],
                        segment_spare=SegmentSpare(MiB // 2))
    assert measured.free


def test_a_job_leaving_keeps_its_after_bytes_outside_the_plan():
    plan = JobPlan(0, 100, [(50, 50), (-50, 0)], after=30)
    pairing = MemoryPairing([plan, JobPlan(1, 10, [(5, 5), (-5, 0)])], 1000, 1)
    pairing.leave(0)
    assert pairing.outside == 130


def test_the_counter_barrier_releases_waiters_when_a_job_leaves():
    b = CounterBarrier()
    b.plan("a", [0, 1])
    b.plan("b", [0, 2])
    order = []

    def b_thread():
        b.wait("b", 2)  # needs a's round 1, which a never runs
        order.append("b ran round 2")

    t = threading.Thread(target=b_thread)
    t.start()
    b.done("b", 0)
    b.wait("a", 0)
    b.done("a", 0)
    b.leave("a")  # a fails before its round 1
    t.join(10)
    assert order == ["b ran round 2"] and not t.is_alive()
    with pytest.raises(ValueError, match="no unfinished group"):
        b.done("a", 1)


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_counter_barrier_tracks_the_lowest_unfinished_round(data):
    """Random jobs plan rounds, finish groups in any admissible order, leave
    and plan again: after every step the barrier's counts equal a plain
    model's, its lowest unfinished round is the model's, and a job at an
    admissible round passes ``wait`` at once."""
    b, model = CounterBarrier(), {}  # model: job -> its unfinished rounds, in order
    ops = data.draw(st.lists(st.sampled_from(["plan", "run", "run", "run", "leave"]),
                             min_size=1, max_size=60))
    for op in ops:
        job = data.draw(st.sampled_from("abc"))
        if op == "plan":
            start = max((r for rs in model.values() for r in rs), default=0)
            rounds = sorted(data.draw(st.lists(st.integers(start, start + 8), max_size=6)))
            b.plan(job, rounds)
            model.setdefault(job, []).extend(rounds)
            model[job].sort()
        elif op == "leave":
            b.leave(job)
            model.pop(job, None)
        else:
            lowest = min((r for rs in model.values() for r in rs), default=None)
            ready = [j for j, rs in model.items() if rs and rs[0] == lowest]
            if ready:
                j = data.draw(st.sampled_from(sorted(ready)))
                b.wait(j, lowest)  # admissible: returns at once
                b.done(j, lowest)
                model[j].pop(0)
        want = {}
        for rs in model.values():
            for r in rs:
                want[r] = want.get(r, 0) + 1
        assert b.pending() == want
        assert b._lowest() == min(want, default=float("inf"))


def test_without_a_limit_jobs_run_free_whatever_their_spares():
    spare = SegmentSpare(64 * MiB)  # more than the steps' bytes
    plans = [JobPlan(j, MiB, [(MiB, MiB), (-MiB, 0)], segment_spare=spare) for j in range(2)]
    assert MemoryPairing(plans, None, 1).free
