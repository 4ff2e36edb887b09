"""What a ``waterwave.sharing`` member's passes need, learned from the
allocator's own counts: the bytes its thread holds at points inside each
pass, and the most between them.

A *pass* runs from one call of the member's model (its forward, at the top)
to the next: forward, loss, backward, the optimizer's step and whatever the
loop does before the next batch. *Points* are places a hook sees inside it:
a module's forward starting, its backward starting, an optimizer's step;
each has a key, ``(where, occurrence in the pass)``. A *region* runs from a
point to the next point reached; its rise is the most its bytes went above
their level at its start, its net the change by its end.

Passes are told apart by their *signature* (gradients on, the model's
training mode): an evaluation pass needs less than a training one. Sizes
differ from batch to batch (dynamic padding): a pass's *size* is the
elements of the tensors its model was called with. What was learned is kept
per size bucket (a quarter of an octave wide); a pass is predicted from the
smallest bucket at or above its size (memory grows with the batch), or, past
every size seen, from the largest, scaled by the square of the ratio (an
attention's scores grow with the square of a sequence's length): an upper
bound, where allocations past it wait rather than fail (the shared budget,
csrc/runtime/shared_budget.cpp). A signature never seen has no prediction:
the member's pass runs alone and is measured at every module, unless
another member of the same model structure measured that pass already
(``FirstPasses``): then it asks for what that one needed, with room to
spare, and is measured beside the others.

``gate_keys`` chooses where a member waits (its *gates*) from a measured
pass, as node groups are cut (``nodegroups.py``): a gate wherever the bytes
risen or fallen since the last gate reach ``split_for`` the pass, so a large
model has a gate every eighth of its pass's rise and a small one only at the
pass's start. The simulator cuts its sharing jobs' traces by the same rule
(``sim/schedules.py``).

May import: the standard library only.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

START = ("start", 0)  # the pass's first point: its model called
MAX_BUCKETS = 64      # sizes kept per signature (oldest dropped past it)
RECENT = 4            # passes a bucket predicts from
GATES_PER_PASS = 8    # a gate every eighth of a pass's rise, as node groups are cut
# Regions rising less than this share of the budget get no gate of their own:
# a gate costs a hook and a lock, and small regions fit anyway.
SMALLEST_GATE_SHARE = 1 / 256
# Of a GPU's budget, what members leave for the caching allocator's
# fragmentation: they count the bytes their tensors take, the allocator
# reserves whole segments (the CPU's budget is exact: no margin there).
GPU_MARGIN = 0.05
# Passes a member runs alone after a step of its ran out of memory beside
# the others and was undone (job.train's steps), doubling at each further
# undo in the same block: pressure that lasts costs an undone partial step
# a doubling, pressure that passes no more than these passes in turn.
ALONE_PASSES = 8
# A pass's levels drift from its bucket's by a little (another batch's
# shapes within the bucket, rounding): the room a member reserves for the
# rest of its pass allows this much more, so a member admitted can finish
# its pass without the tie-break forcing a gate. (Without it, four
# transformer trials at a limit a few MiB above their need met a forced
# gate in most runs.)
REST_SLACK = 1 / 16


def with_slack(rest: int) -> int:
    """``rest`` bytes still to rise in a pass, with ``REST_SLACK``."""
    return rest + int(math.ceil(rest * REST_SLACK)) if rest > 0 else rest


class Region(NamedTuple):
    """From the point ``key`` to the next point reached (a tuple: passes make
    them on the training thread's hot path)."""
    key: tuple
    rise: int  # the most above its start level, at least 0
    net: int   # its end level less its start level


class PassRecorder:
    """A pass's regions as its points are reached; ``at`` takes the account's
    (live bytes, most live since the last point)."""

    def __init__(self, live: int):
        self.regions: list[Region] = []
        self.start = live
        self._key, self._level = START, live

    def at(self, key: tuple, live: int, peak: int) -> None:
        self.regions.append(Region(self._key, max(0, peak - self._level), live - self._level))
        self._key, self._level = key, live

    def restart(self, live: int) -> None:
        """A new pass from ``live``, where this one reached no point."""
        self.start = self._level = live



def rise_of(regions: list[Region]) -> int:
    """The most a run of regions rises above its start level."""
    level, most = 0, 0
    for r in regions:
        most = max(most, level + r.rise)
        level += r.net
    return most


def coarsen(regions: list[Region], gates: set[tuple]) -> list[Region]:
    """The regions between gates: each run of regions from a gate (or the
    pass's start) to the next, as one."""
    out: list[Region] = []
    for r in regions:
        if not out or r.key == START or r.key in gates:
            out.append(r)
        else:
            last = out[-1]
            out[-1] = Region(last.key, max(last.rise, last.net + r.rise), last.net + r.net)
    return out


@dataclass
class Bucket:
    """What the latest passes of one signature and size bucket needed: per
    key, the most each region rose and its largest net change; the order of
    the keys in the latest pass; the largest size seen. The maxima are over
    the passes since they were last recomputed, which they are whenever
    ``RECENT`` passes have gone by or the path changed: a first pass that
    made an optimizer's state, once, is forgotten after a few more."""
    size: int
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    order: list[tuple] = field(default_factory=list)
    rise: dict = field(default_factory=dict)
    net: dict = field(default_factory=dict)
    pass_rise: int = 0
    pass_net: int = 0
    version: int = 0   # bumped when what it predicts changes
    _since: int = 0    # passes added since the maxima were recomputed

    def add(self, size: int, regions: list[Region]) -> None:
        if size > self.size:
            self.size = size
        self.recent.append(regions)
        self._since += 1
        if len(regions) == 1 and self.order == [START] and self._since < RECENT:
            # A pass with no gate inside (a small model's): one region.
            r = regions[0]
            if r.rise > self.rise[START] or r.net > self.net[START]:
                self.rise[START] = self.pass_rise = max(self.rise[START], r.rise)
                self.net[START] = self.pass_net = max(self.net[START], r.net)
                self.version += 1
            return
        order = [r.key for r in regions]
        if order != self.order or self._since >= RECENT:
            self.order, self._since = order, 0
            self.rise, self.net = {}, {}
            for kept in self.recent:
                self._merge(kept)
            self.pass_rise = max(rise_of(kept) for kept in self.recent)
            self.pass_net = max(sum(r.net for r in kept) for kept in self.recent)
            self.version += 1
            return
        if self._merge(regions):
            self.pass_rise = max(self.pass_rise, rise_of(regions))
            self.pass_net = max(self.pass_net, sum(r.net for r in regions))
            self.version += 1

    def _merge(self, regions: list[Region]) -> bool:
        """Each region's values into the maxima; whether any grew."""
        grew = False
        rise, net = self.rise, self.net
        for r in regions:
            if r.rise > rise.get(r.key, -1):
                rise[r.key] = r.rise
                grew = True
            if r.key not in net or r.net > net[r.key]:
                net[r.key] = r.net
                grew = True
        return grew


class Prediction:
    """A pass's needs at its gates, in bytes above the level at the gate,
    from a bucket scaled by ``scale`` (answers kept until the bucket
    changes)."""

    def __init__(self, bucket: Bucket, scale: float):
        self.bucket, self.scale = bucket, scale
        self._answers: dict = {}
        self._version = bucket.version

    def at(self, key: tuple) -> tuple[int, int, int]:
        """(the most the region from ``key`` rises, the most the pass rises
        from here to its end, its net change from here to its end)."""
        b = self.bucket
        if self._version != b.version:
            self._answers.clear()
            self._version = b.version
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = self._compute(key)
        return answer

    def _compute(self, key: tuple) -> tuple[int, int, int]:
        b, scale = self.bucket, self.scale
        if key not in b.order:  # not on the latest pass's path: bound by the whole pass
            rest = _scaled(max(b.rise.get(key, 0), b.pass_rise), scale)
            return _scaled(b.rise.get(key, b.pass_rise), scale), rest, \
                max(0, _scaled(b.pass_net, scale))
        level, rest = 0, 0
        for k in b.order[b.order.index(key):]:
            rest = max(rest, level + b.rise[k])
            level += b.net[k]
        return _scaled(b.rise[key], scale), _scaled(rest, scale), _scaled(level, scale)


def _scaled(n: int, scale: float) -> int:
    return int(math.ceil(n * scale)) if n > 0 else n


class Profiles:
    """Everything learned of one member's passes (see the module's opening)."""

    def __init__(self):
        self._by_signature: dict[tuple, dict[int, Bucket]] = {}
        self._generation = 0  # buckets added, dropped or grown: predictions chosen again
        self._chosen: dict = {}  # (signature, bucket of the size) -> (generation, Prediction)

    def knows(self, signature: tuple) -> bool:
        return signature in self._by_signature

    def learn(self, signature: tuple, size: int, regions: list[Region]) -> None:
        """A pass of ``size`` ran through ``regions`` (in order, the last
        ending with the pass)."""
        buckets = self._by_signature.setdefault(signature, {})
        b = bucket_of(size)
        found = buckets.get(b)
        if found is None:
            if len(buckets) >= MAX_BUCKETS:
                del buckets[next(iter(buckets))]
            found = buckets[b] = Bucket(size)
            self._generation += 1
        elif size > found.size:
            self._generation += 1
        found.add(size, regions)

    def predict(self, signature: tuple, size: int) -> Prediction | None:
        """None: nothing known of the signature (the pass must be measured)."""
        buckets = self._by_signature.get(signature)
        if not buckets:
            return None
        key = (signature, size)
        chosen = self._chosen.get(key)
        if chosen is not None and chosen[0] == self._generation:
            return chosen[1]
        at_or_above = [bk for bk in buckets.values() if bk.size >= size]
        if at_or_above:
            prediction = Prediction(min(at_or_above, key=lambda bk: bk.size), 1.0)
        else:
            largest = max(buckets.values(), key=lambda bk: bk.size)
            prediction = Prediction(largest, (size / max(1, largest.size)) ** 2)
        if len(self._chosen) > 4 * MAX_BUCKETS:
            self._chosen.clear()
        self._chosen[key] = (self._generation, prediction)
        return prediction


class FirstPass(NamedTuple):
    """A first pass measured: the most it rose above its start, its net
    change (counted no lower than its optimizer's step left it: the block
    may end there, its gradients alive), and what it left held at the
    next pass's start (its optimizer's state, the gradients freed where
    the loop zeroes them first)."""
    rise: int
    net: int
    held: int
    base: int = 0  # its model's bytes

    @property
    def to_go_on(self) -> int:
        """The room a trial needs to make this pass's state and then run
        its next pass beside it: the rise and what was left held."""
        return self.rise + max(0, self.held)


class FirstPasses:
    """The first pass each member measured, by the pass's kind: its model's
    structure (``sharing.structure_of``), its signature and its size. A
    session keeps one: a search's trials are often one model at other
    learning rates, and the first pass of each new trial need not run
    alone, holding the others at their boundaries, to learn what the
    previous trials showed. What is kept (``FirstPass``) includes a first
    pass's one-time costs (an optimizer's state)."""

    MOST = 256  # kinds kept, the oldest dropped past it

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: OrderedDict = OrderedDict()

    def note(self, kind: tuple, rise: int, net: int, held: int | None = None,
             base: int = 0) -> bool:
        """Keep a first pass of ``kind`` (``held``: ``net`` where not
        told; ``base``: its model's bytes); True where it is the first."""
        with self._lock:
            if kind in self._seen:
                return False
            self._seen[kind] = FirstPass(rise, net, net if held is None else held, base)
            if len(self._seen) > self.MOST:
                self._seen.popitem(last=False)
            return True

    def get(self, kind: tuple) -> FirstPass | None:
        """The first pass measured of ``kind``; None: none yet."""
        with self._lock:
            return self._seen.get(kind)

    def room_to_go_on_guess(self, base: int) -> int:
        """For a first pass of a kind none measured, of a model of ``base``
        bytes: what a measured one rose and left held, the most of any kind
        and the most scaled by the model's bytes, so that a model smaller
        or larger than those seen is not guessed short (its activations
        grow more slowly than its parameters; its state, as fast). 0 where
        none was measured."""
        with self._lock:
            seen = list(self._seen.values())
        most = max((p.to_go_on for p in seen), default=0)
        scaled = max((p.to_go_on * base // p.base for p in seen if p.base), default=0)
        return max(most, scaled)


def bucket_of(size: int) -> int:
    """A size's bucket: a quarter of an octave wide."""
    return int(math.floor(math.log2(max(1, size)) * 4))


def split_for(regions: list[Region], budget: int) -> int:
    """The bytes between gates for a pass measured as ``regions`` under
    ``budget`` (0: none)."""
    return max(rise_of(regions) // GATES_PER_PASS, int(budget * SMALLEST_GATE_SHARE), 1)


def gate_keys(regions: list[Region], split: int) -> set[tuple]:
    """The keys of the points where a member waits: a point whose level has
    moved ``split`` bytes or more from the level at the last gate (the
    pass's start is always one). Temporaries that come and go within a
    region move no level (they are its rise, wherever the gates are): a
    forward has about eight gates rising, a backward about eight falling."""
    gates: set[tuple] = set()
    level = base = 0
    for r in regions:
        if r.key != START and abs(level - base) >= split:
            gates.add(r.key)
            base = level
        level += r.net
    return gates
