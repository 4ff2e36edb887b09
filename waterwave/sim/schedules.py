"""Schedules: how several jobs' steps are cut into segments and ordered.

A schedule turns each job's steps into *segments*, each tagged with a round.
The simulator runs round r once every job has scheduled all its segments of
earlier rounds: a barrier between rounds, as a thread barrier does between
halves in bench/data/gpu-snapshots/probe.py, or the NodeGroup executor's
CounterBarrier between node-group pairs. Within a round, jobs run freely.

- ``lockstep``: one segment per job, every step, round 0: jobs start
  together and run free.
- ``sequential``: each job's steps, one job after another (job j's steps in
  round j): a trial at a time, the baseline a search without sharing runs.
- ``turns``: the jobs take turns step by step (job j's step s in round
  s x jobs + j): whole steps in turn, as time-slicing a GPU between
  processes does.
- ``phased``: half the jobs (the even ones) run a step's forward while the
  other half run a backward and update, then the other way round, a barrier
  between halves (Waterwave-s of the paper; probe.py's PHASED=1). The odd
  jobs run one forward first, and one more at the end.
- ``waterwave``, ``waterwave-alg1`` and ``waterwave-s``: the NodeGroup
  pipeline (``NodeGroupSchedule``), each as ``waterwave.pipeline.schedules``
  defines it for the trainer too: each job's step cut into node groups and
  paired over rounds. Their traces must be built with their ``partition``,
  which records the groups in them.
- ``sharing``: eager jobs as ``waterwave.sharing`` members
  (``SharingSchedule``): no rounds; each job's step cut at its gates by the
  members' rule (``pipeline.pass_profile``), each segment starting when the
  shared budget (csrc/runtime/shared_budget.cpp, the same code) admits it, a
  job's first step alone and measured, its later ones predicted from it; the
  first step of a job whose trace another job measured first borrows that
  measure, as trials of one model do at run time; an operator the device
  cannot place waits for another job's frees (multijob.py), as a member's
  allocation does.
- ``session``: what a training session runs (``SessionSchedule``): each
  job first measured alone, then side by side, in turn, one after another
  or the memory pairing, as ``pipeline.session_choice`` chooses from those
  figures and probes of a few steps.
- any callable ``schedule(jobs, steps) -> list[list[Segment]]``.

May import: waterwave.pipeline, this package.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..pipeline import schedules as pipeline
from ..pipeline.nodegroups import Partition
from ..graph import footprint
from ..pipeline.pairing import (SEGMENT_SLACK, JobGroups, JobPlan, RoundPlanner, SegmentSpare,
                                whole_run)
from ..pipeline.pass_profile import (START, Region, coarsen, gate_keys, rise_of, split_for,
                                     with_slack)
from ..pipeline.session_choice import (GUARDED_STEPS, PROBED, Choice, MeasuredAlone,
                                       cached_peak, choose)
from .rates import added_steps_rate
from .trace import Trace


@dataclass
class Segment:
    round: int
    step: int    # whose blocks these operators use
    first: int   # operator range [first, last) of the job's trace
    last: int


# A function of the jobs' traces and the steps: each job's segments.
SegmentSchedule = Callable[[list[Trace], int], list[list[Segment]]]


def forward_end(t: Trace) -> int:
    """Index of the first operator after the forward pass."""
    return next((k for k, op in enumerate(t.ops) if op.phase not in ("", "forward")), len(t.ops))


def lockstep(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    return [[Segment(0, s, 0, len(t.ops)) for s in range(steps)] for t in jobs]


def sequential(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    return [[Segment(j, s, 0, len(t.ops)) for s in range(steps)] for j, t in enumerate(jobs)]


def turns(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    n = len(jobs)
    return [[Segment(s * n + j, s, 0, len(t.ops)) for s in range(steps)] for j, t in enumerate(jobs)]


def phased(jobs: list[Trace], steps: int) -> list[list[Segment]]:
    out = []
    for j, t in enumerate(jobs):
        f = forward_end(t)
        if f in (0, len(t.ops)):
            raise ValueError(f"the phased schedule needs a forward and a backward phase; trace "
                             f"{t.name!r} has {'no forward' if f == 0 else 'only a forward'}")
        segs = []
        if j % 2 == 0:
            for s in range(steps):
                segs += [Segment(2 * s + 1, s, 0, f), Segment(2 * s + 2, s, f, len(t.ops))]
        else:
            segs.append(Segment(0, 0, 0, f))
            for s in range(steps):
                segs.append(Segment(2 * s + 1, s, f, len(t.ops)))
                segs.append(Segment(2 * s + 2, s + 1, 0, f))
        out.append(segs)
    return out


@dataclass
class NodeGroupSchedule:
    """A schedule of the NodeGroup pipeline (``waterwave.pipeline.schedules``)
    over traces: build each job's trace with ``partition``, then the
    schedule pairs their groups over rounds, as the trainer pairs them."""
    name: str = "waterwave"
    split_size: int | None = None    # bytes; None: each job's peak over ``groups``
    memory_limit: int | None = None  # the budget the pairing plans for; None: no limit
    order: str = "bfs"               # the groups' order, where the schedule leaves it open
    overlap: bool = True             # Algorithm 1: a job's next step starts as soon as it can
    groups: int = 8
    segment_slack: int = SEGMENT_SLACK  # the memory pairing's part-empty segments a job
    # Each job's segment spare, measured alone (JobPlan.segment_spare), by
    # trace name; a job not named has none measured.
    segment_spares: dict[str, SegmentSpare] | None = None

    @property
    def __name__(self) -> str:
        return self.name

    @property
    def spec(self) -> pipeline.Schedule:
        return pipeline.schedule(self.name)

    def partition(self, g) -> Partition:
        return self.spec.partition(g, self.split_size, self.order, self.groups)

    def planner(self, jobs: list[Trace], steps: int) -> RoundPlanner:
        """The run's rounds for ``jobs``, as the trainer plans them."""
        for t in jobs:
            if "groups" not in t.meta:
                raise ValueError(f"the {self.name} schedule needs traces built with its "
                                 f"partition; trace {t.name!r} has no node groups")
        spec = self.spec
        inputs = []
        for j, t in enumerate(jobs):
            kinds = [d >= 0 for _, _, d in t.meta["groups"]]
            num_angs = kinds.index(False) if False in kinds else len(kinds)
            inputs.append(pipeline.PairingInput(
                JobPlan(j, sum(footprint(p[1]) for p in t.persistent), group_rises(t),
                        segment_spare=(self.segment_spares or {}).get(t.name)),
                JobGroups(j, num_angs, len(kinds), t.peak_live(),
                          t.meta["partition"]["split_size"])))
        limit = None if spec.pairing == pipeline.FREE else self.memory_limit
        return spec.round_planner(steps, limit, inputs, overlap=self.overlap,
                                  segment_slack=self.segment_slack)

    def __call__(self, jobs: list[Trace], steps: int) -> list[list[Segment]]:
        where = whole_run(self.planner(jobs, steps), steps)
        out = []
        for j, t in enumerate(jobs):
            spans = t.meta["groups"]
            out.append([Segment(r, s, spans[g][0], spans[g][1]) for r, s, g in where[j]])
        return out


@dataclass
class GatedSegment(Segment):
    """A segment that starts at a gate: what the member asks there, in bytes
    above its level. A job's first step runs alone, as a member's first
    pass does: measured, with no gate inside."""
    rise: int | None = 0    # None: the step runs alone
    rest: int = 0           # the most the step rises from here to its end
    net: int = 0            # its change from here to its end
    boundary: bool = False  # the step's first segment
    gate: bool = True       # False: inside a step measured alone, no gate
    # A first step another job of the same trace measures first (trials of
    # one model): what to ask instead of running alone once that job's first
    # step has ended, where memory is plentiful (sharing.py's borrowed ask).
    borrow: "Borrowed | None" = None


@dataclass(frozen=True)
class Borrowed:
    """A borrowed first step's ask, and whose first step measures it: job
    ``source`` once its thread is past its first ``source_segments``."""
    rise: int
    net: int
    source: int
    source_segments: int


@dataclass
class SharingSchedule:
    """``sharing`` (see the module's opening): segments in round 0 that
    the simulator runs as their gates admit them, under ``memory_limit``."""
    memory_limit: int | None = None
    name: str = "sharing"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, jobs: list[Trace], steps: int) -> list[list[Segment]]:
        out = []
        measured_by: dict = {}  # a trace's kind -> (the job that measures it, its segments)
        for j, t in enumerate(jobs):
            regions = op_regions(t)
            gates = gate_keys(regions, split_for(regions, self.memory_limit or 0))
            coarse = coarsen(regions, gates)
            starts = [r.key[1] for r in coarse]
            spans = list(zip(starts, [*starts[1:], len(t.ops)]))
            asks = []
            for i, r in enumerate(coarse):
                level, rest = 0, 0
                for later in coarse[i:]:
                    rest = max(rest, level + later.rise)
                    level += later.net
                asks.append((r.rise, with_slack(rest), level))  # as a member asks
            # Trials of one model: the first job of a trace measures its
            # first step; the others' first steps may borrow what it needed.
            kind = (t.name, tuple(regions), tuple(t.persistent))
            source = measured_by.setdefault(kind, (j, len(spans)))
            borrow = None
            if source[0] != j:
                rise, net = first_step(t)
                spare = 2 * sum(footprint(n) for _, n, _, at in t.persistent if at < 0)
                borrow = Borrowed(rise + spare, max(0, net) + spare, *source)
            segments = []
            for step in range(steps):
                for i, (first, last) in enumerate(spans):
                    if step == 0:  # measured alone: one gate, at the step's start
                        segments.append(GatedSegment(0, step, first, last, None, 0, 0, i == 0,
                                                     gate=i == 0, borrow=borrow if i == 0
                                                     else None))
                    else:
                        segments.append(GatedSegment(0, step, first, last, *asks[i], i == 0))
            out.append(segments)
        return out


# Runs traces on the simulated device the caller set up: (jobs, schedule, steps) -> SimResult.
Probe = Callable[[list[Trace], SegmentSchedule, int], object]
# Steps a probe runs before those it times: the first makes each job's
# segments, the second is the first with every job's blocks cached beside
# the others' (under a cap, where segments go back and come again).
SETTLING_STEPS = 2


@dataclass
class SessionSchedule:
    """``session`` (see the module's opening). Its traces are cut with
    ``partition``: node groups in program order, so that side by side and in
    turns the operators run as the eager loop runs them. ``decide`` measures
    each job alone (``probe_steps`` steps), probes each way where side by
    side does not surely fit, and gives the schedule chosen; the probes'
    own steps are not counted in the run. Side by side chosen from its
    probe is kept only where it lasts the steps a trainer runs it in short
    guarded chunks (``session_choice.GUARDED_STEPS``), as the trainer's
    guard would find; its later, longer chunks are not modelled."""
    memory_limit: int | None = None
    name: str = "session"
    groups: int = 8
    probe_steps: int = 3
    segment_slack: int = SEGMENT_SLACK  # its pairing's part-empty segments a job
    # The ways it probes where side by side does not surely fit: all, as a
    # trainer on a GPU does; CPU_PROBES as one where nothing holds a budget
    # (side by side then only where the peaks fit).
    probed: tuple[str, ...] = PROBED
    # Each job's segment spare measured alone counts, as a trainer counts it
    # under Waterwave's allocator: in its peak (then the bytes it reserved
    # alone), and where the pairing runs the jobs free. False: as a trainer
    # under PyTorch's allocator, a trainer's peak is its bytes allocated
    # with a margin and a part-empty segment of each pool (cached_peak), and
    # the pairing's a margin of the bytes.
    segment_spares: bool = True

    @property
    def __name__(self) -> str:
        return self.name

    def partition(self, g) -> Partition:
        return pipeline.schedule("session").partition(g, None, groups=self.groups)

    def pairing(self, segment_spares: dict[str, SegmentSpare] | None = None) -> NodeGroupSchedule:
        """The memory pairing, given each job's segment spare as measured
        alone (by trace name; None: not measured)."""
        return NodeGroupSchedule("waterwave", None, self.memory_limit, "program",
                                 groups=self.groups, segment_slack=self.segment_slack,
                                 segment_spares=segment_spares)

    def decide(self, jobs: list[Trace], probe: Probe) -> tuple[SegmentSchedule, Choice | None]:
        """The schedule to run ``jobs`` by, and the choice behind it (None:
        a job does not train even alone, so nothing was chosen)."""
        alone, runs = [], []
        for t in jobs:
            r = probe([t], lockstep, max(2, self.probe_steps))
            runs.append((t, r))
            if not r.ok or not r.step_time_us or r.step_time_us[0] is None:
                return lockstep, None  # it runs out of memory alone: as side by side would
        spares = segment_spares(runs)
        for t, r in runs:
            # A trainer counts its step and the segment spare measured alone
            # (what its stream's own segments reserved, beside what it holds
            # elsewhere): the bytes reserved alone. Without the spares, its
            # bytes allocated, with a margin and a segment of each pool.
            if not self.segment_spares:
                peak, spare = cached_peak(r.peak_allocated), None
            else:
                peak, spare = r.peak_reserved, spares[t.name]
            alone.append(MeasuredAlone(peak, r.step_time_us[0] / 1e6,
                                       t.meta.get("batch_size") or 1, spare))
        choice = choose(alone, self.memory_limit)
        by_pairing = {pipeline.FREE: lockstep, pipeline.TURNS: turns,
                      pipeline.SEQUENTIAL: sequential,
                      pipeline.MEMORY: self.pairing(spares if self.segment_spares else None)}
        if choice.why == "probe":
            probes = {p: self._probe_rate(jobs, by_pairing[p], probe) for p in self.probed}
            choice = choose(alone, self.memory_limit, probes)
            if choice.pairing == pipeline.FREE and not probe(
                    jobs, lockstep, SETTLING_STEPS + self.probe_steps + GUARDED_STEPS).ok:
                # As a trainer's guard finds it (session_choice.GUARDED_STEPS):
                # side by side ran out after its probe, and no longer counts.
                probes[pipeline.FREE] = None
                choice = choose(alone, self.memory_limit, probes)
        return by_pairing[choice.pairing], choice

    def _probe_rate(self, jobs: list[Trace], way: SegmentSchedule, probe: Probe) -> float | None:
        """Samples per second of ``probe_steps`` steps of every job run
        ``way`` (None: out of memory), as a trainer times a probe: to the
        end of the last job's last step, so a way that leaves one job
        behind pays for it (``rates.added_steps_rate``). The rate within a
        steady window would count whichever jobs' steps fell in it. The
        steps timed follow ``SETTLING_STEPS``: a simulated run starts from
        an empty cache, a trainer's probe from one its earlier steps filled.
        As a trainer does, it does not probe a pairing whose budget holds
        no job's step beside what all hold (``MemoryPairing.fits``)."""
        if isinstance(way, NodeGroupSchedule) and not way.planner(jobs, 1).fits:
            return None
        return added_steps_rate(probe(jobs, way, SETTLING_STEPS),
                                probe(jobs, way, SETTLING_STEPS + self.probe_steps))

    def __call__(self, jobs: list[Trace], steps: int) -> list[list[Segment]]:
        raise ValueError("the session schedule chooses by simulating its jobs: run it through "
                         "waterwave.sim.simulate, which gives it the device to measure them on")


def segment_spares(alone) -> dict[str, SegmentSpare]:
    """Each job's segment spare (``JobPlan.segment_spare``) from ``alone``,
    pairs of a trace and its run alone: what its segments held beyond its
    blocks, reserved less allocated at their peaks, in all and in the small
    pool, as a trainer on a GPU reads it of the job's stream
    (exec/job_loop.py, ``MemoryProbe.own_peaks``). By trace name; traces of
    one name share the most any measured."""
    spares: dict[str, SegmentSpare] = {}
    for t, r in alone:
        streams = r.stats["own_segments_by_stream"].values()
        spare = SegmentSpare.from_peaks(
            r.peak_reserved, r.peak_allocated,
            sum(own["reserved_bytes.small_pool.peak"] for own in streams),
            sum(own["allocated_bytes.small_pool.peak"] for own in streams))
        seen = spares.get(t.name, spare)
        total = max(seen.total, spare.total)
        spares[t.name] = SegmentSpare(total, max(seen.small_pool, spare.small_pool))
    return spares


def op_regions(t: Trace, first: bool = False) -> list[Region]:
    """A step's regions from one operator to the next (each at its blocks'
    ``footprint``), keyed by the operator's index: what a member's points
    measure, at every operator. ``first``: the first step's, with the
    persistent blocks it makes before each operator (an optimizer's state)."""
    size = {b: footprint(n) for op in t.ops for b, n in op.alloc}
    made = t.persistent_at() if first else {}
    out = []
    for k, op in enumerate(t.ops):
        up = sum(size[b] for b, _ in op.alloc) + sum(footprint(n) for _, n, _ in made.get(k, []))
        out.append(Region(START if k == 0 else ("op", k), up, up - sum(size[b] for b in op.free)))
    return out


def first_step(t: Trace) -> tuple[int, int]:
    """The first step's (rise, net) from its start: what a member measures
    of its first pass."""
    regions = op_regions(t, first=True)
    return rise_of(regions), sum(r.net for r in regions)


def group_rises(t: Trace) -> list[tuple[int, int]]:
    """Each node group's (net bytes, rise) in a steady step: the rise is the
    most bytes live above the group's start while it runs, workspaces
    included, each tensor at its ``footprint`` in the allocator: what the
    trainer measures in a job's first step on a GPU (exec/job_loop.py, MemoryProbe)."""
    size = {b: footprint(n) for op in t.ops for b, n in op.alloc}
    out = []
    for first, end, _ in t.meta["groups"]:
        acc = rise = 0
        for op in t.ops[first:end]:
            acc += sum(size[b] for b, _ in op.alloc)
            rise = max(rise, acc)
            acc -= sum(size[b] for b in op.free)
        out.append((acc, rise))
    return out


# Run on traces whole: lockstep (the pipeline's FREE pairing, one segment
# a step), and the simulator's own: phased, sequential and turns.
WHOLE_TRACE_SCHEDULES: dict[str, SegmentSchedule] = {"lockstep": lockstep, "phased": phased,
                                              "sequential": sequential, "turns": turns}
# lockstep, turns and sequential are the pipeline's FREE, TURNS and
# SEQUENTIAL pairings, run on whole traces here.
NODE_GROUP_SCHEDULES = tuple(n for n, s in pipeline.SCHEDULES.items()
                             if s.pairing not in (pipeline.FREE, pipeline.TURNS,
                                                  pipeline.SEQUENTIAL, pipeline.SESSION))
NAMES = (*WHOLE_TRACE_SCHEDULES, *NODE_GROUP_SCHEDULES, "sharing", "session")
# Each schedule's allocator (policy, config), as the benchmarks and the demo
# run it: PyTorch's jobs under PyTorch's policy; the NodeGroup pipeline under
# the waterwave policy, blocks over 128 MiB never split (the paper's setting);
# sharing members under the waterwave policy, whose blocks of 20 MiB or more
# the run keeps whole as a session on a GPU does (alloc/cache_splits.py).
ALLOCATORS: dict[str, tuple[str, str]] = {
    "phased": ("pytorch", ""), "sequential": ("pytorch", ""), "turns": ("pytorch", ""),
    **{n: (s.policy, s.config) for n, s in pipeline.SCHEDULES.items()},
    "sharing": ("waterwave", ""),  # the session keeps large blocks whole (cache_splits)
}


def schedule(name_or_fn: str | SegmentSchedule, memory_limit: int | None = None,
             split_size: int | None = None) -> SegmentSchedule:
    """A schedule by name (node-group schedules plan for ``memory_limit``,
    with ``split_size`` or their own choice), or the callable itself."""
    if callable(name_or_fn):
        return name_or_fn
    if name_or_fn in NODE_GROUP_SCHEDULES:
        return NodeGroupSchedule(name_or_fn, split_size, memory_limit)
    if name_or_fn == "sharing":
        return SharingSchedule(memory_limit)
    if name_or_fn == "session":
        return SessionSchedule(memory_limit)
    try:
        return WHOLE_TRACE_SCHEDULES[name_or_fn]
    except KeyError:
        raise ValueError(f"unknown schedule {name_or_fn!r}: choose one of {', '.join(NAMES)}, "
                         "or pass a callable") from None
