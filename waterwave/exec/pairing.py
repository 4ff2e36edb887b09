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

May import: waterwave.planner (graphs and lifetimes), this package.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..planner.graph import Graph
from ..planner.lifetimes import lifetimes
from .nodegroups import Partition


@dataclass
class JobGroups:
    """What Algorithm 1 needs of a job."""
    job: int         # the job's index among the trainer's jobs
    num_angs: int    # allocation groups before the first deallocation group
    num_groups: int
    peak: int        # bytes: the job's peak (persistent memory included)
    split_size: int


def algorithm1(jobs: list[JobGroups], mem_limit: int | None) -> tuple[dict, dict]:
    """The two vectors, as maps index -> (job, group)."""
    if not jobs:
        return {}, {}
    jobs = sorted(jobs, key=lambda j: (-j.split_size, -j.peak, j.job))
    first = jobs[0]
    if mem_limit is None:
        p = jobs[1].num_angs if len(jobs) > 1 else 0
    else:
        p = (mem_limit - first.peak) // max(first.split_size, 1) - 1
    p = max(0, min(p, first.num_angs, jobs[1].num_angs if len(jobs) > 1 else 0))
    offset = first.num_angs - p
    av, dv = {}, {}
    idx1, idx2 = 0, first.num_angs
    for k, job in enumerate(jobs):
        second, last = k == 1, k == len(jobs) - 1
        i = 0
        if second:
            for i in range(p):
                dv[offset + i] = (job.job, i)
            i = p
        for i in range(i, job.num_angs):
            av[idx1] = (job.job, i)
            idx1 += 1
        i = job.num_angs
        while i < job.num_groups:
            if last and idx2 > idx1:
                av[idx1] = (job.job, i)
                idx1 += 1
            else:
                dv[idx2] = (job.job, i)
                idx2 += 1
            i += 1
    return av, dv


def iteration_rounds(jobs: list[JobGroups], mem_limit: int | None) -> list[list[tuple[int, int]]]:
    """One training step's rounds: the pairs of Algorithm 1, in order."""
    av, dv = algorithm1(jobs, mem_limit)
    n = max([*av, *dv], default=-1) + 1
    # The last job's DNGs can land in both vectors at one index: a job's
    # groups in one round run one after the other, in order.
    return [sorted(x for x in (av.get(r), dv.get(r)) if x is not None) for r in range(n)]


def rounds(jobs: list[JobGroups], mem_limit: int | None, steps: int,
           overlap: bool = True) -> dict[int, list[tuple[int, int, int]]]:
    """Each job's (round, step, group) over ``steps`` steps, rounds counted
    from 0 over the whole run."""
    one = iteration_rounds(jobs, mem_limit)
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
    out = {job: [] for job in where}
    for s in range(steps):
        for job, rs in where.items():
            out[job] += [(r + s * shift, s, group) for r, group in rs]
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


@dataclass
class JobPlan:
    """What the memory-aware pairing needs of a job: its persistent bytes,
    and each group's net bytes and rise (its most bytes above its start)."""
    job: int
    persistent: int
    groups: list[tuple[int, int]]  # (delta, rise)


def memory_rounds(jobs: list[JobPlan], mem_limit: int, steps: int, margin: float = 0.03,
                  free_margin: float = 0.05) -> dict[int, list[tuple[int, int, int]]]:
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
    as the allocator does (``footprint``); ``margin`` of the limit is kept
    back for fragmentation. When nothing fits,
    the group that needs least runs alone (if that fails, the batch does not
    fit). When every job's whole step fits beside the others' with
    ``free_margin`` to spare (allocators cache and fragment: plans count
    bytes), the jobs run free, in one round."""
    limit = int(mem_limit * (1 - margin))
    by_job = {j.job: j for j in jobs}
    if sum(step_peak(j) for j in jobs) <= mem_limit * (1 - free_margin):
        # Every job's whole step fits beside the others': no barrier at all.
        return {j.job: [(0, s, g) for s in range(steps) for g in range(len(j.groups))]
                for j in jobs}
    held = {j.job: j.persistent for j in jobs}
    done = {j.job: 0 for j in jobs}  # groups run so far, over all steps
    total = {j.job: len(j.groups) * steps for j in jobs}
    out: dict[int, list[tuple[int, int, int]]] = {j.job: [] for j in jobs}

    def claim(j: int, held_j: int, next_done: int) -> int:
        """The most job j holds from group ``next_done`` to its step's end."""
        plan = by_job[j].groups
        if next_done % len(plan) == 0:  # at a step boundary: no claim yet
            return held_j
        level, most = held_j, held_j
        for g in range(next_done % len(plan), len(plan)):
            most = max(most, level + max(0, plan[g][1]))
            level += plan[g][0]
        return most

    def safe(state: dict[int, int], progress: dict[int, int]) -> bool:
        left = set(state)
        hold = dict(state)
        while left:
            for j in sorted(left):
                others = sum(hold[k] for k in hold if k != j)
                if claim(j, state[j], progress[j]) + others <= limit:
                    left.remove(j)
                    hold[j] = by_job[j].persistent
                    break
            else:
                return False
        return True

    r = 0
    while any(done[j] < total[j] for j in done):
        waiting = sorted((j for j in done if done[j] < total[j]), key=lambda j: (done[j], j))
        budget = limit - sum(held.values())
        chosen: list[int] = []
        state, progress = dict(held), dict(done)
        for j in waiting:
            delta, rise = by_job[j].groups[done[j] % len(by_job[j].groups)]
            trial_state = {**state, j: state[j] + delta}
            trial_progress = {**progress, j: progress[j] + 1}
            if max(0, rise) <= budget and safe(trial_state, trial_progress):
                chosen.append(j)
                budget -= max(0, rise)
                state, progress = trial_state, trial_progress
        if not chosen:
            chosen = [min(waiting,
                          key=lambda j: by_job[j].groups[done[j] % len(by_job[j].groups)][1])]
        for j in chosen:
            step, g = divmod(done[j], len(by_job[j].groups))
            out[j].append((r, step, g))
            held[j] += by_job[j].groups[g][0]
            done[j] += 1
        r += 1
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


def footprint(nbytes: int) -> int:
    """What a tensor of ``nbytes`` costs the caching allocator: 512-byte
    blocks, and a large tensor (over 10 MiB) its own segment in 2 MiB
    steps (PyTorch's rules, both policies'). Plans count these, not bytes."""
    rounded = -(-nbytes // 512) * 512
    return -(-rounded // (2 << 20)) * (2 << 20) if rounded > 10 << 20 else rounded


def step_peak(j: JobPlan) -> int:
    """The most a job holds over a step: persistent bytes and the highest
    level its groups reach."""
    level = most = j.persistent
    for delta, rise in j.groups:
        most = max(most, level + max(0, rise))
        level += delta
    return most
