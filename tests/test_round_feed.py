"""Planning a run a window at a time: the pairings' windows join into the
whole run's plan, each window later than the last; the feed hands them to
threads through the CounterBarrier in order, plans only as far as the jobs
have reached, and never waits on a job that left."""
import threading

from conftest import start_and_join
from hypothesis import example, given, settings
from hypothesis import strategies as st

from waterwave.pipeline.counter_barrier import CounterBarrier
from waterwave.pipeline.pairing import (
    JobGroups,
    JobPlan,
    MemoryPairing,
    algorithm1_rounds,
    memory_rounds,
    rises_from,
    rounds,
)
from waterwave.pipeline.round_feed import RoundFeed

group = st.tuples(st.integers(-40, 60), st.integers(-5, 90))
job_groups = st.lists(group, min_size=1, max_size=7)


def joined_windows(planner, sizes):
    """Every window of ``planner`` (sizes cycled), joined; checks that each
    window's rounds all come after every earlier window's."""
    out, last, k = {j: [] for j in planner.jobs}, -1, 0
    while not planner.finished:
        window = planner.window(sizes[k % len(sizes)])
        k += 1
        got = [r for entries in window.values() for r, _, _ in entries]
        if got:  # later rounds, or round 0 throughout (where nothing waits)
            assert min(got) > last or (max(got) == 0 and last <= 0), (window, last)
            last = max(last, max(got))
        for j, entries in window.items():
            out[j] += entries
    return out


@given(st.lists(st.tuples(job_groups, st.integers(0, 30)), min_size=1, max_size=4),
       st.integers(40, 500), st.integers(1, 5), st.lists(st.integers(0, 3), min_size=1,
                                                         max_size=4))
@settings(max_examples=150, deadline=None)
def test_memory_pairing_windows_join_into_the_whole_run(jobs, limit, steps, sizes):
    plans = [JobPlan(j, p, gs) for j, (gs, p) in enumerate(jobs)]
    whole = memory_rounds(plans, limit, steps, segment_slack=0)
    assert joined_windows(MemoryPairing(plans, limit, steps, segment_slack=0), sizes) == whole
    for p in plans:  # every group of every step, in order
        assert [(s, g) for _, s, g in whole[p.job]] == [
            (s, g) for s in range(steps) for g in range(len(p.groups))]


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(1, 60),
                          st.integers(1, 20)), min_size=1, max_size=4),
       st.integers(10, 200), st.integers(1, 5), st.booleans(),
       st.lists(st.integers(0, 3), min_size=1, max_size=4))
@settings(max_examples=150, deadline=None)
# A first job with no ANGs left dv's index behind the second job's ANGs in
# av, and Algorithm 1 put the second job's DNG before its own ANGs.
@example(jobs=[(1, 0, 1, 1), (4, 3, 1, 1)], limit=10, steps=1, overlap=False, sizes=[0])
def test_algorithm1_windows_join_into_the_whole_run(jobs, limit, steps, overlap, sizes):
    groups = [JobGroups(j, min(a, n), n, peak, split)
              for j, (n, a, peak, split) in enumerate(jobs)]
    whole = rounds(groups, limit, steps, overlap)
    assert joined_windows(algorithm1_rounds(groups, limit, steps, overlap), sizes) == whole
    for g in groups:
        assert [(s, k) for _, s, k in whole[g.job]] == [
            (s, k) for s in range(steps) for k in range(g.num_groups)]
        assert [r for r, _, _ in whole[g.job]] == sorted(r for r, _, _ in whole[g.job])


@given(job_groups)
def test_a_claim_is_the_most_a_steprises_from_a_group_on(groups):
    table = rises_from(groups)
    for k in range(len(groups)):
        level = most = 0
        for delta, rise in groups[k:]:
            most = max(most, level + max(0, rise))
            level += delta
        assert table[k] == most


def run_threads(feed, jobs, stop_after=None, starts=None):
    """Each job in a thread through the feed; a log of (event, job, round)
    in the order they happened. ``stop_after``: job -> entries it runs
    before it leaves; ``starts``: called as each group starts."""
    log, lock = [], threading.Lock()

    def worker(k):
        try:
            for n, (r, _, _) in enumerate(feed.entries(k)):
                if stop_after and stop_after.get(k) == n:
                    return
                feed.barrier.wait(jobs[k], r)
                with lock:
                    log.append(("start", k, r))
                    if starts:
                        starts()
                with lock:
                    log.append(("done", k, r))
                feed.barrier.done(jobs[k], r)
        finally:
            feed.leave(k)

    start_and_join([threading.Thread(target=worker, args=(k,), daemon=True)
                    for k in range(len(jobs))], 60, "the feed or the barrier deadlocked")
    return log


def turns(n_jobs=3, groups=6):
    """Jobs that can only take turns: each step fills the limit."""
    plans = [JobPlan(j, 10, [(20, 20)] * (groups // 2) + [(-20, 0)] * (groups // 2))
             for j in range(n_jobs)]
    return plans, 10 * n_jobs + 20 * (groups // 2) + 5


def test_threads_run_a_long_run_in_round_order_planned_as_they_go():
    plans, limit = turns()
    steps = 40
    whole = memory_rounds(plans, limit, steps, segment_slack=0)
    planner = MemoryPairing(plans, limit, steps, segment_slack=0)
    asked = []
    window = planner.window
    planner.window = lambda n: (asked.append(n), window(n))[1]
    jobs = [f"job{k}" for k in range(len(plans))]
    feed = RoundFeed(planner, jobs, CounterBarrier(), window_steps=1)
    planned_at_start = []
    log = run_threads(feed, jobs, starts=lambda: planned_at_start.append(len(asked)))
    assert planned_at_start[0] == 1, "the feed planned more than a window before it started"
    assert len(asked) > steps // 2  # planned as the jobs went, not up front
    for k in range(len(jobs)):
        assert [r for e, j, r in log if e == "start" and j == k] == [r for r, _, _ in whole[k]]
    # A group of round r starts only once every group of the rounds before r is done.
    unfinished = {}
    for entries in whole.values():
        for r, _, _ in entries:
            unfinished[r] = unfinished.get(r, 0) + 1
    for event, _, r in log:
        if event == "start":
            assert all(n == 0 for q, n in unfinished.items() if q < r), r
        else:
            unfinished[r] -= 1
    assert feed.last_round == max(r for entries in whole.values() for r, _, _ in entries)
    assert feed.barrier.pending() == {}


def test_a_job_that_leaves_mid_run_never_holds_the_others():
    plans, limit = turns()
    steps = 20
    whole = memory_rounds(plans, limit, steps, segment_slack=0)
    jobs = ["a", "b", "c"]
    feed = RoundFeed(MemoryPairing(plans, limit, steps, segment_slack=0), jobs, CounterBarrier(),
                     window_steps=1)
    log = run_threads(feed, jobs, stop_after={1: 7})
    assert len([1 for e, j, _ in log if e == "start" and j == 1]) == 7
    for k in (0, 2):  # every group, in order; once b left, planned without it
        started = [r for e, j, r in log if e == "start" and j == k]
        assert len(started) == len(whole[k]) and started == sorted(started)
    assert feed.barrier.pending() == {}


@given(st.lists(st.tuples(job_groups, st.integers(0, 30)), min_size=2, max_size=4),
       st.integers(60, 400), st.integers(1, 12), st.integers(1, 3), st.data())
@settings(max_examples=40, deadline=None)
def test_threads_through_random_plans_keep_round_order_whoever_leaves(jobs, limit, steps,
                                                                      window, data):
    """Thread stress: random jobs and limits, windows of 1-3 steps, any job
    leaving after any number of its groups: no deadlock, the jobs that stay
    run their whole plan, and no group starts before every group of the
    earlier rounds run by a job still there has finished."""
    plans = [JobPlan(j, p, gs) for j, (gs, p) in enumerate(jobs)]
    whole = memory_rounds(plans, limit, steps, segment_slack=0)
    leaving = data.draw(st.dictionaries(st.sampled_from(range(len(plans))),
                                        st.integers(0, 3 * steps), max_size=len(plans) - 1))
    names = [f"job{k}" for k in range(len(plans))]
    feed = RoundFeed(MemoryPairing(plans, limit, steps, segment_slack=0), names, CounterBarrier(),
                     window_steps=window)
    log = run_threads(feed, names, stop_after=leaving)
    started = {k: [r for e, j, r in log if e == "start" and j == k] for k in whole}
    for k, entries in whole.items():
        rounds_k = [r for r, _, _ in entries]
        # Every group it ran, in order; once a job left, the others are planned
        # without it, so their rounds may come sooner than in the whole run.
        expected = min(leaving[k], len(rounds_k)) if k in leaving else len(rounds_k)
        assert len(started[k]) == expected and started[k] == sorted(started[k])
    ran: dict[int, int] = {}  # round -> groups that ever started in it
    for event, _, r in log:
        if event == "start":
            ran[r] = ran.get(r, 0) + 1
    finished: dict[int, int] = {}
    for event, _, r in log:
        if event == "done":
            finished[r] = finished.get(r, 0) + 1
        else:
            assert all(finished.get(q, 0) == n for q, n in ran.items() if q < r), r
    assert feed.barrier.pending() == {}
