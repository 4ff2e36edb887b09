"""Pairing several jobs' node groups into rounds (Waterwave paper, section
4.4, Algorithm 1), and repeating them over training steps.

Algorithm 1 fills two vectors, one per stream: ``av`` and ``dv``. The node
groups at the same index run in parallel, a *pair*; a barrier separates one
pair from the next (``counter_barrier.py``). The first job's allocation
groups (ANGs) go to ``av``; its deallocation groups (DNGs) to ``dv`` after
them. The second job's first ``p`` ANGs run in ``dv`` beside the first job's
last ANGs, where ``p`` is how many split sizes the memory left beside the
first job's peak holds, less one (so that a DNG frees before the next ANG
allocates); its other ANGs go to ``av`` beside the first job's DNGs. Each
later job follows the one before it; the last job's DNGs fill ``av`` while
it has room. Jobs are sorted first by their groups' sizes, largest first.

A *round* here is one index of the two vectors. ``rounds(...)`` repeats the
pairing for each training step. The paper starts each step's pairing when
the last one has ended; ``overlap=True`` (ours) starts a job's next step as
soon as its previous one and the pairs' width of two allow, which removes
the bubble at the start of every step.

Ours, ``MemoryPairing``, fills rounds under a memory budget (its docstring).
Both plan a run a window of whole rounds at a time (``window``), as the
trainer needs them (``round_feed.py``); ``rounds`` and ``memory_rounds``
join every window.

May import: waterwave.graph, this package.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..graph import Graph, footprint
from ..graph.lifetimes import lifetimes
from .nodegroups import Partition


@dataclass
class JobGroups:
    """What Algorithm 1 needs of a job."""
    job: int         # the job's index among the trainer's jobs
    num_angs: int    # allocation groups before the first deallocation group
    num_groups: int
    peak: int        # bytes: the job's peak (persistent memory included)
    split_size: int


def algorithm1(jobs: list[JobGroups], memory_limit: int | None) -> tuple[dict, dict]:
    """The two vectors, as maps index -> (job, group)."""
    if not jobs:
        return {}, {}
    jobs = sorted(jobs, key=lambda j: (-j.split_size, -j.peak, j.job))
    first = jobs[0]
    if memory_limit is None:
        p = jobs[1].num_angs if len(jobs) > 1 else 0
    else:
        p = (memory_limit - first.peak) // max(first.split_size, 1) - 1
    p = max(0, min(p, first.num_angs, jobs[1].num_angs if len(jobs) > 1 else 0))
    offset = first.num_angs - p
    av, dv = {}, {}
    idx1, idx2 = 0, first.num_angs
    for k, job in enumerate(jobs):
        second, last = k == 1, k == len(jobs) - 1
        i = at = 0  # at: the index of the job's last group so far
        if second:
            for i in range(p):
                dv[offset + i] = (job.job, i)
                at = offset + i
            i = p
        for i in range(i, job.num_angs):
            av[idx1] = (job.job, i)
            at = idx1
            idx1 += 1
        i = job.num_angs
        # A job's DNGs come no earlier than its own ANGs (in the same round
        # they run in order): a first job with few groups can leave dv's
        # index behind the second job's last ANG in av.
        while i < job.num_groups:
            if last and idx2 > idx1 >= at:
                av[idx1] = (job.job, i)
                at = idx1
                idx1 += 1
            else:
                idx2 = max(idx2, at)
                dv[idx2] = (job.job, i)
                at = idx2
                idx2 += 1
            i += 1
    return av, dv


def iteration_rounds(jobs: list[JobGroups], memory_limit: int | None) -> list[list[tuple[int, int]]]:
    """One training step's rounds: the pairs of Algorithm 1, in order."""
    av, dv = algorithm1(jobs, memory_limit)
    n = max([*av, *dv], default=-1) + 1
    # The last job's DNGs can land in both vectors at one index: a job's
    # groups in one round run one after the other, in order.
    return [sorted(x for x in (av.get(r), dv.get(r)) if x is not None) for r in range(n)]


def rounds(jobs: list[JobGroups], memory_limit: int | None, steps: int,
           overlap: bool = True) -> dict[int, list[tuple[int, int, int]]]:
    """Each job's (round, step, group) over ``steps`` steps, rounds counted
    from 0 over the whole run."""
    return whole_run(algorithm1_rounds(jobs, memory_limit, steps, overlap), steps)


def algorithm1_rounds(jobs: list[JobGroups], memory_limit: int | None, steps: int,
                      overlap: bool = True) -> PeriodicRounds:
    """``rounds``, planned a window at a time (``PeriodicRounds``)."""
    one = iteration_rounds(jobs, memory_limit)
    where = {j.job: [] for j in jobs}  # job -> [(round in the step, group)]
    for r, pair in enumerate(one):
        for job, group in pair:
            where[job].append((r, group))
    length = len(one)
    shift = length
    if overlap and length:
        # The smallest shift at which each job's next step starts after its
        # last round, and no round holds more than two groups.
        shift = max(rs[-1][0] - rs[0][0] + 1 for rs in where.values() if rs)
        while not _fits(where, shift, steps):
            shift += 1
    return PeriodicRounds(where, shift, steps)


class RoundPlanner:
    """What a round feed (``round_feed.py``) asks of a pairing: the next
    window of rounds, whether a job's part of the run is planned, and that a
    job leaves it. ``PeriodicRounds`` (a fixed pairing) and ``MemoryPairing``
    are the two."""

    def window(self, steps: int) -> dict[int, list[tuple[int, int, int]]]:
        """Each job's entries (round, step, group) in the next rounds."""
        raise NotImplementedError

    def planned_all(self, job: int) -> bool:
        """Whether ``job``'s part of the run is planned."""
        raise NotImplementedError

    def leave(self, job: int) -> None:
        """``job`` runs none of its remaining groups. A fixed pairing keeps
        its rounds as planned (the barrier passes the job's groups)."""

    @property
    def fits(self) -> bool:
        """Whether the rounds keep to the pairing's memory budget; a fixed
        pairing has none."""
        return True


class PeriodicRounds(RoundPlanner):
    """A run whose every step repeats one step's rounds, ``shift`` rounds
    later (0: every group in round 0, where nothing waits), handed out a
    window at a time: ``window(n)`` gives each job's entries (round, step,
    group) in the next rounds, about ``n`` steps of them. A window holds
    whole rounds, so every entry of a later window has a higher round than
    every entry handed out before it (the barrier's order needs that: a
    round must be planned whole before any job can pass it)."""

    def __init__(self, where: dict[int, list[tuple[int, int]]], shift: int, steps: int):
        self.where, self.shift, self.steps = where, shift, steps
        self.jobs = list(where)
        self._next = 0  # shift 0: the next step; else the next round
        # Where _next ends: past the last step, or past the last step's last round.
        last = max((rs[-1][0] for rs in where.values() if rs), default=-1)
        self._end = steps if shift == 0 else last + (steps - 1) * shift + 1

    @property
    def finished(self) -> bool:
        return self._next >= self._end

    def planned_all(self, job: int) -> bool:
        return self.finished  # every job's rounds are planned together

    def window(self, steps: int) -> dict[int, list[tuple[int, int, int]]]:
        out: dict[int, list[tuple[int, int, int]]] = {job: [] for job in self.where}
        if self.shift == 0:
            first, self._next = self._next, min(self.steps, self._next + max(1, steps))
            for job, rs in self.where.items():
                out[job] = [(r, s, g) for s in range(first, self._next) for r, g in rs]
            return out
        lo, hi = self._next, self._next + max(1, steps) * self.shift
        self._next = hi
        for job, rs in self.where.items():
            if not rs:
                continue
            # The steps that have a round in [lo, hi).
            s_lo = max(0, (lo - rs[-1][0] + self.shift - 1) // self.shift)
            s_hi = min(self.steps, (hi - 1 - rs[0][0]) // self.shift + 1)
            out[job] = sorted((r + s * self.shift, s, g) for s in range(s_lo, s_hi)
                              for r, g in rs if lo <= r + s * self.shift < hi)
        return out


def _fits(where: dict, shift: int, steps: int) -> bool:
    width: dict[int, int] = {}
    for s in range(min(steps, 3)):  # the pattern repeats after two shifts
        for rs in where.values():
            for r, _ in rs:
                width[r + s * shift] = width.get(r + s * shift, 0) + 1
    if any(w > 2 for w in width.values()):
        return False
    return all(rs[0][0] + shift > rs[-1][0] for rs in where.values() if rs)


@dataclass(frozen=True)
class SegmentSpare:
    """What a job's segments held beyond its blocks in a step measured
    alone, reserved less allocated at their peaks: in all, and in the small
    pool's segments (``shared_small_pool``)."""
    total: int
    small_pool: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.small_pool <= self.total:
            raise ValueError(f"a segment spare needs 0 <= small_pool <= total bytes, not {self}")

    @classmethod
    def from_peaks(cls, reserved: int, allocated: int, small_reserved: int,
                   small_allocated: int) -> SegmentSpare:
        """From the segments' peaks, in all and in the small pool. Peaks
        fall at different moments, so the small pool's difference can
        exceed the whole's; it is kept within it."""
        total = max(0, reserved - allocated)
        return cls(total, min(total, max(0, small_reserved - small_allocated)))


@dataclass
class JobPlan:
    """What the memory-aware pairing needs of a job: its persistent bytes,
    each group's net bytes and rise (its most bytes above its start),
    ``after``: bytes it holds beside its persistent ones once its planned
    steps end (a training session's job evaluating between its calls), and
    ``segment_spare``: what the allocator's segments held beyond its blocks
    at its peak, measured with the job alone, or None where nothing
    measured it."""
    job: int
    persistent: int
    groups: list[tuple[int, int]]  # (delta, rise)
    after: int = 0
    segment_spare: SegmentSpare | None = None


# Of a budget, what plans keep back for the allocator: ``MARGIN`` where
# groups are paired; ``FREE_MARGIN`` of a job's bytes before jobs run free,
# where its segment spare was not measured (allocators cache and fragment,
# and plans count bytes).
MARGIN, FREE_MARGIN = 0.03, 0.05
# What a job's stream can hold in segments beyond its blocks: a small-pool
# segment and the large-pool segment that blocks of 1-10 MiB share (20 MiB
# unless the allocator's large_segment_size says), each almost empty. A
# small job's cache is mostly these (simulated: an MLP 512x1 at batch 1024
# reserves 86 MiB for 70.6 MiB allocated), which a margin in proportion to
# its bytes does not cover: paired rounds keep back the larger of the two.
SMALL_SEGMENT, LARGE_SEGMENT = 2 << 20, 20 << 20
SEGMENT_SLACK = SMALL_SEGMENT + LARGE_SEGMENT

# Side by side, the jobs' streams share the allocator's small pool (its
# blocks go to any stream's segments), where alone each stream filled
# segments of its own. Their small blocks interleave, and the pool can take
# a segment more than the bytes each job reserved alone add up to: two MLP
# 4096x2 at batch 256 reserve 280 MiB each alone and need 562 side by side
# (simulated), their small segments alone holding 0.7 MiB beyond their
# blocks in all. See shared_small_pool.
SHARED_SMALL_POOL = SMALL_SEGMENT


def shared_small_pool(spares) -> int:
    """What jobs running free may take beyond the bytes each reserved alone
    (``spares``: each job's ``SegmentSpare``, None where not measured):
    a small-pool segment where the spares measured leave less than one in
    the jobs' small segments, nothing where they leave one or more, or
    where none was measured (then margins or ``cached_peak``'s segments
    stand in). Capped at the sum of the bytes reserved alone, side by side
    ran out in 10 of 900 simulated mixes of 2-4 MLPs; capped at that sum and
    this, in none (bench/concurrent/session_fit.py). Under random caps a trainer runs free from its
    peaks in 166 draws of 261 where it did in 168 (counting a segment
    always: 158, and 8 more below 97% of the best plain schedule). Counted
    by a trainer's side by side
    (``session_choice.side_by_side_need``) and the pairing's free run."""
    measured = [s.small_pool for s in spares if s is not None]
    return SHARED_SMALL_POOL if measured and sum(measured) < SHARED_SMALL_POOL else 0


def memory_rounds(jobs: list[JobPlan], memory_limit: int | None, steps: int,
                  margin: float = MARGIN, free_margin: float = FREE_MARGIN,
                  segment_slack: int = SEGMENT_SLACK) -> dict[int, list[tuple[int, int, int]]]:
    """Each job's (round, step, group) over ``steps`` steps under
    ``memory_limit`` bytes: ``MemoryPairing``'s whole run at once."""
    return whole_run(MemoryPairing(jobs, memory_limit, steps, margin, free_margin,
                                   segment_slack), steps)


def whole_run(planner: PeriodicRounds | MemoryPairing,
              steps: int) -> dict[int, list[tuple[int, int, int]]]:
    """Every window of a planner, joined: each job's entries for the run."""
    out: dict[int, list[tuple[int, int, int]]] = {job: [] for job in planner.jobs}
    while not planner.finished:
        for job, entries in planner.window(steps).items():
            out[job] += entries
    return out


class MemoryPairing(RoundPlanner):
    """Ours: rounds filled greedily under a memory budget, kept safe as the
    banker's algorithm keeps a system safe. Each job's groups run in order,
    steps one after another with no pause between.

    Memory held at a round's start is each job's persistent bytes plus what
    its finished groups left live; a round's groups each rise by their
    ``rise`` above that (frees beside a group never count: memory freed in
    one round serves the next). A job's *claim* is the most it will hold
    before its current step ends. A round takes a job's next group (the jobs
    furthest behind are asked first) when the round's rises fit the budget
    and the state after it is *safe*: some order lets every job finish its
    step, each in turn finding room for its claim beside what the others
    hold, a finished job holding only its persistent bytes. So a second job
    grows exactly as fast as the first one's frees leave room for its whole
    remaining step: memory flows from one to the other. Plans count bytes
    as the allocator does (``footprint``); for what the allocator's cache
    holds beyond them, paired rounds keep back ``margin`` of the limit or
    ``segment_slack`` bytes a job (the part-empty segments its blocks sit
    in, ``SEGMENT_SLACK``), whichever is more. When nothing fits, the
    group that needs least runs alone past the budget (``forced`` counts
    them; ``fits`` says beforehand whether the budget holds every job's
    step): the allocator may run out. When every job's whole step fits
    beside the others', each with the spare its segments held alone
    (``JobPlan.segment_spare``, and where they leave less than a segment
    of the small pool the jobs share, one, ``shared_small_pool``;
    unmeasured, ``free_margin`` of its bytes:
    allocators cache and fragment, and plans count bytes), the jobs run
    free, in one round.

    The run is planned a window at a time (``window``), as the trainer runs
    it: a long run neither waits for its whole plan nor holds it. A claim
    costs O(1) (each job's claims from every group on are tabled once)."""

    def __init__(self, jobs: list[JobPlan], memory_limit: int | None, steps: int,
                 margin: float = MARGIN, free_margin: float = FREE_MARGIN,
                 segment_slack: int = SEGMENT_SLACK):
        self.margin, self.free_margin = margin, free_margin
        self.segment_slack = segment_slack
        self.forced = 0  # groups run alone past the budget: nothing fitted it
        self.memory_limit = memory_limit
        self.outside = 0  # bytes held beside the plan (jobs that left it)
        self.by_job: dict[int, JobPlan] = {}
        self.jobs: list[int] = []
        self.held: dict[int, int] = {}
        self.done: dict[int, int] = {}  # groups planned so far, over all steps
        self.total: dict[int, int] = {}
        self.solo: dict[int, int] = {}  # job -> groups left of a step it runs alone
        self.paused: set[int] = set()   # jobs whose groups wait for a measurement (update)
        self._rise_from: dict[int, list[int]] = {}
        self.round = 0  # the next round to plan
        self._free_round: int | None = None  # the round free windows put everything in
        for j in jobs:
            self.join(j, steps)

    # Jobs join and leave between windows (a training session's members) ---
    def join(self, plan: JobPlan, steps: int, solo_first: bool = False) -> None:
        """Plan ``steps`` more steps of ``plan.job``, from its next group on.
        ``solo_first``: its first step runs alone, each group in a round of
        its own, and its later groups wait for ``update`` (the trainer
        measures that step on a GPU)."""
        j = plan.job
        if j in self.by_job:
            raise ValueError(f"job {j} is already planned")
        self.by_job[j] = plan
        self.jobs.append(j)
        self.done[j] = 0
        self.total[j] = len(plan.groups) * steps
        self.held[j] = plan.persistent + (plan.after if not self.total[j] else 0)
        self._rise_from[j] = rises_from(plan.groups)
        if solo_first and self.total[j]:
            self.solo[j] = len(plan.groups)
        self._refresh()

    def leave(self, j: int, still_held: bool = True) -> None:
        """Plan nothing more for job j. ``still_held``: its persistent bytes
        (parameters, optimizer state) and its ``after`` bytes stay on the
        device, outside the plan."""
        if still_held and j in self.by_job:
            self.outside += self.by_job[j].persistent + self.by_job[j].after
        for table in (self.by_job, self.held, self.done, self.total, self.solo, self._rise_from):
            table.pop(j, None)
        self.paused.discard(j)
        if j in self.jobs:
            self.jobs.remove(j)
        self._refresh()

    def update(self, j: int, groups: list[tuple[int, int]],
               segment_spare: SegmentSpare | None = None) -> None:
        """Job j's groups as measured (same count), and its segment spare
        where measured; its paused groups go on."""
        plan = self.by_job[j]
        if len(groups) != len(plan.groups):
            raise ValueError(f"job {j} has {len(plan.groups)} groups, not {len(groups)}")
        self.by_job[j] = replace(plan, groups=list(groups), segment_spare=segment_spare)
        self._rise_from[j] = rises_from(self.by_job[j].groups)
        self.paused.discard(j)
        self._refresh()

    def resume(self, j: int) -> None:
        """Job j's paused groups go on with the bytes it had (no measurement)."""
        self.paused.discard(j)

    def set_limit(self, memory_limit: int | None, outside: int | None = None) -> None:
        """A new budget for the rounds not yet planned; ``outside``: bytes
        held on the device by what is not planned here (jobs between their
        training calls), kept out of it."""
        self.memory_limit = memory_limit
        if outside is not None:
            self.outside = outside
        self._refresh()

    def remaining(self, j: int) -> int:
        """Groups of job j still to plan; 0 for a job not planned here."""
        return self.total.get(j, 0) - self.done.get(j, 0)

    def planned_all(self, job: int) -> bool:
        return self.remaining(job) <= 0

    def _refresh(self) -> None:
        plans = list(self.by_job.values())
        limit, outside = self.memory_limit, self.outside
        slack = self.segment_slack * len(plans)
        unlimited = limit is None
        if unlimited:  # a budget no step reaches, so the jobs run free
            limit, outside, slack = sum(step_peak(j) for j in plans) * 2 + 1, 0, 0
        self.limit = limit - max(int(limit * self.margin), slack) - outside
        self.free = not self.solo and not self.paused and (
            unlimited or sum(self._free_bytes(j) for j in plans)
            + shared_small_pool(j.segment_spare for j in plans) <= limit - outside)

    def _free_bytes(self, plan: JobPlan) -> float:
        """What a job counts for running free: the most it holds, and the
        segments' spare its blocks left measured alone, or, where not
        measured, ``free_margin`` of the whole. A job whose cache is mostly
        part-empty segments outgrows a margin in proportion to its bytes
        (simulated, 13 of 258 tight draws ran out of memory free); the
        segment slack of paired rounds, counted here instead, put the
        trainer's simulated session below 97% of the best plain schedule
        three times as often (docs/results.md)."""
        held = max(step_peak(plan), plan.persistent + plan.after)
        if plan.segment_spare is not None:
            return held + plan.segment_spare.total
        return held / (1 - self.free_margin) if self.free_margin < 1 else float("inf")

    @property
    def finished(self) -> bool:
        return all(self.done[j] >= self.total[j] for j in self.done)

    @property
    def fits(self) -> bool:
        """Whether the rounds from here on keep to the budget (``forced``
        stays as it is): the jobs run free, or a step runs alone as asked
        (``solo_first``), or every job's step fits beside what the others
        hold between their steps."""
        if self.free or self.solo:
            return True
        between = {i: self.held[i] if self.done[i] >= self.total[i]
                   else self.by_job[i].persistent + self.by_job[i].after for i in self.by_job}
        rest = sum(between.values())
        return all(self._step_claim(j) + rest - between[j] <= self.limit
                   for j in self._waiting())

    def _step_claim(self, j: int) -> int:
        """The most job j holds from here to its planned steps' end: its
        current (or next) step's claim, and each later step's from its
        persistent bytes, the last one's ``after`` bytes with it."""
        plan, done = self.by_job[j], self.done[j]
        n = len(plan.groups)
        claim = max(self.held[j] + self._rise_from[j][done % n], self._rest(j, done + 1))
        if -(-(done + 1) // n) * n < self.total[j]:  # steps after this one
            claim = max(claim, plan.persistent + self._rise_from[j][0],
                        plan.persistent + plan.after)
        return claim

    def window(self, steps: int) -> dict[int, list[tuple[int, int, int]]]:
        """Each job's entries (round, step, group) in the next rounds: about
        ``steps`` steps of every job, in whole rounds (see
        ``PeriodicRounds``); empty once the run is planned. Free windows put
        every group in one round, the same one window after window, so
        nothing waits; a window that is not free starts past it."""
        out: dict[int, list[tuple[int, int, int]]] = {j: [] for j in self.by_job}
        if self.free:  # every group in one round: nothing waits
            if self._free_round is None:
                self._free_round = self.round
                self.round += 1
            for j, plan in self.by_job.items():
                n = len(plan.groups)
                first = self.done[j]
                self.done[j] = min(self.total[j], first + max(1, steps) * n)
                out[j] = [(self._free_round, *divmod(k, n)) for k in range(first, self.done[j])]
                self.held[j] += sum(plan.groups[k % n][0] for k in range(first, self.done[j]))
                if first < self.total[j] == self.done[j]:
                    self.held[j] += plan.after
            return out
        self._free_round = None
        want = max(1, steps) * sum(len(p.groups) for p in self.by_job.values())
        planned = 0
        while planned < want:
            chosen = self._next_round()
            if not chosen:  # every job is finished or paused
                break
            for j in chosen:
                step, g = divmod(self.done[j], len(self.by_job[j].groups))
                out[j].append((self.round, step, g))
                self.held[j] += self._next_group(j)[0]
                self.done[j] += 1
                planned += 1
                if j in self.solo:
                    self.solo[j] -= 1
                    if not self.solo[j]:
                        del self.solo[j]
                        self.paused.add(j)
            self.round += 1
        return out

    def _next_round(self) -> list[int]:
        """The jobs whose next group runs in the next round."""
        done, by_job = self.done, self.by_job
        if self.solo:  # a step run alone: one group a round, nothing beside it
            return [min(self.solo)]
        waiting = self._waiting()
        if not waiting:
            return []
        budget = self.limit - sum(self.held.values())
        chosen: list[int] = []
        state, progress = dict(self.held), dict(done)
        for j in waiting:
            delta, rise = self._next_group(j)
            trial_state = {**state, j: state[j] + delta}
            trial_progress = {**progress, j: progress[j] + 1}
            if max(0, rise) <= budget and self._safe(trial_state, trial_progress):
                chosen.append(j)
                budget -= max(0, rise)
                state, progress = trial_state, trial_progress
        if not chosen:
            self.forced += 1
            chosen = [min(waiting,
                          key=lambda j: by_job[j].groups[done[j] % len(by_job[j].groups)][1])]
        return chosen

    def _waiting(self) -> list[int]:
        """The jobs with groups left to plan, not paused, furthest behind
        first."""
        done = self.done
        return sorted((j for j in done if done[j] < self.total[j] and j not in self.paused),
                      key=lambda j: (done[j], j))

    def _next_group(self, j: int) -> tuple[int, int]:
        """Job j's next group's (net bytes, rise). Its last planned group
        also takes the job's ``after`` bytes: its thread goes on (evaluating)
        while the rest of that round runs, and holds them after."""
        plan = self.by_job[j]
        delta, rise = plan.groups[self.done[j] % len(plan.groups)]
        if self.done[j] + 1 == self.total[j]:
            delta += plan.after
            rise = max(rise, delta)
        return delta, rise

    def _claim(self, j: int, held_j: int, next_done: int) -> int:
        """The most job j holds from group ``next_done`` to its step's end,
        and once it has ended."""
        k = next_done % len(self.by_job[j].groups)
        if k == 0:  # at a step boundary: no claim yet
            return held_j
        return max(held_j + self._rise_from[j][k], self._rest(j, next_done))

    def _rest(self, j: int, next_done: int) -> int:
        """What job j holds once the step that group ``next_done`` belongs
        to has ended: its persistent bytes, and its ``after`` bytes if that
        step is its last planned one."""
        plan = self.by_job[j]
        n = len(plan.groups)
        end = -(-next_done // n) * n
        return plan.persistent + (plan.after if end >= self.total[j] else 0)

    def _safe(self, state: dict[int, int], progress: dict[int, int]) -> bool:
        left = set(state)
        hold = dict(state)
        total = sum(hold.values())
        while left:
            for j in sorted(left):
                if self._claim(j, state[j], progress[j]) + total - hold[j] <= self.limit:
                    left.remove(j)
                    rest = state[j] if progress[j] % len(self.by_job[j].groups) == 0 \
                        else self._rest(j, progress[j])
                    total += rest - hold[j]
                    hold[j] = rest
                    break
            else:
                return False
        return True


def rises_from(groups: list[tuple[int, int]]) -> list[int]:
    """For each group k, the most a step rises above its level at k's start
    while groups k, k+1, ... run (0 if it never rises)."""
    out, above = [0] * len(groups), None  # above: the most over groups k.., from k's start
    for k in range(len(groups) - 1, -1, -1):
        delta, rise = groups[k]
        above = max(0, rise) if above is None else max(0, rise, delta + above)
        out[k] = above
    return out


def graph_plan(job: int, g: Graph, part: Partition) -> JobPlan:
    """What the memory-aware pairing knows of a job: its captured step's
    tensors, each at its ``footprint`` in the allocator. A node holds its
    outputs before the tensors it used last are freed (eager PyTorch frees
    them when the operator returns), so a group's rise counts them both.
    The trainer plans from this on the CPU. What kernels allocate around
    themselves (cuDNN's workspaces) is not in the graph, so on a GPU the
    trainer measures its groups instead, and the simulator plans from its
    traces (``sim.schedules.group_rises``)."""
    size = {t.id: footprint(t.size) for t in g.tensors}
    kept = {t.id for t in g.tensors if t.persistent or t.kind == "input"}
    freed: dict[int, int] = {}  # node -> bytes of the tensors it used last
    for t, (_, end) in zip(g.tensors, lifetimes(g, part.order)):
        if t.id not in kept and t.size:
            v = part.order[end]
            freed[v] = freed.get(v, 0) + size[t.id]
    groups = []
    for grp in part.groups:
        level = rise = 0
        for v in grp.nodes:
            level += sum(size[t] for t in g.nodes[v].outputs if t not in kept)
            rise = max(rise, level)
            level -= freed.get(v, 0)
        groups.append((level, rise))
    return JobPlan(job, sum(size[t] for t in kept), groups)


def step_peak(j: JobPlan) -> int:
    """The most a job holds over a step: persistent bytes and the highest
    level its groups reach."""
    return j.persistent + (rises_from(j.groups)[0] if j.groups else 0)
