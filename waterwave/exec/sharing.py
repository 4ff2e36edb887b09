"""``waterwave.sharing(model)``: any eager training loop shares its device.

    with ww.sharing(model):          # this trial's memory flows with the others'
        for batch in loader:         # the user's own loop, unchanged
            opt.zero_grad(); model(**batch).loss.backward(); opt.step()

Inside the block the loop is the user's eager PyTorch, untouched: any
forward, loss and optimizer, shapes that change every batch. Its results are
the eager loop's because it is the eager loop; Waterwave only counts and
waits. The calling thread becomes a *member* of its device's training
session (``session.py``) while the block runs: its allocations are counted
in the session's ledger (a thread account: ``csrc/runtime/
thread_accounts.h``; on the CPU through Waterwave's CPU allocator,
``alloc/cpu_allocator.py``), and with a budget it waits at *gates*, points
inside each pass that hooks see (the model's forward starting, chosen
modules' forward and backward starting, an optimizer's step: hooks, not
capture), until the region after the gate fits beside the others' holdings
(``csrc/runtime/shared_budget.cpp``). So one trial's forward runs while
another's backward frees.

What a region needs is learned from the allocator's own counts of earlier
passes (``pipeline/pass_profile.py``). A member's first pass of each kind
(training, evaluating) is measured at every module, and runs alone unless a
member of the same model structure measured that pass in this session
(another trial of one model): then it asks for what that one needed, with
room to spare, and runs beside the others. The gates are then chosen by
measured memory, as node groups are cut by size. A pass
counts as ending no lower than its optimizer's step left it: a block can end
after any batch, its gradients alive. A pass larger than any seen is
predicted scaled; an allocation past a prediction waits for
the others' frees, and if every member waits, one fails with
``torch.OutOfMemoryError`` naming the budget while the others go on. (On a
GPU with no ``memory_limit`` the budget is measured, not the user's: there
that allocation asks the device instead, which may refuse it.) A ``Job``'s
steps (``job.train``) are undone there, where the update has not begun, and
run again with the member's next passes alone (``run_alone``;
``job_loop.run_free``).

Without a budget (a CPU session with no ``memory_limit``) nothing waits:
members are counted, and one hook at the model's call lets Ctrl-C stop them.

A member's model, its account and what was learned of it last as long as
the model: the next block (the next epoch) goes on from them. Hooks are
placed when a block starts and removed when it ends, so the model outside
its blocks is the user's, unchanged (saved, copied, evaluated). A ``Job``'s
blocks (``job_sharing``) put no hook on the model at all: the job calls its
model and steps its optimizer itself, and tells the member of each.

May import: waterwave._C, waterwave.alloc, this package; torch (lazily).
"""
from __future__ import annotations

import threading
import weakref
from array import array
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

from .. import _C
from ..alloc.thread_account import ThreadAccount
from ..pipeline.pass_profile import (RECENT, START, PassRecorder, Profiles, Region, coarsen,
                                     gate_keys, rise_of, split_for, with_slack)

ADMITTED, TIMED_OUT, INTERRUPTED = 0, 1, 2
GATE_POLL_MS = 100  # a waiting gate returns to Python this often (Ctrl-C lands)
END = ("end", 0)    # the point that ends a pass (never a region's start)
# The signature of what a block allocates before its model's first call (the
# loader's first batch): a pass of its own, learned as the others are.
BLOCK_START = ("block start",)

_local = threading.local()  # .member: the member whose block runs on this thread
_members: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Member
_members_lock = threading.Lock()
_optimizer_hooks: list = []  # the global optimizer hooks, while any block runs
_blocks_running = 0


# The pass state's slots (``_C.PASS_STATE_SLOTS``; csrc/bindings/bind_sharing.cpp):
# the numbers a member's pass boundary reads and writes at every pass, in one
# array('q') that the member's Python and its C++ boundary share.
_SLOTS = {name: index for index, name in enumerate(_C.PASS_STATE_SLOTS)}


def _in_pass_state(name: str, doc: str) -> property:
    """An attribute kept in the object's pass state (``_state``), slot ``name``."""
    index = _SLOTS[name]

    def get(self) -> int:
        return self._state[index]

    def put(self, value: int) -> None:
        self._state[index] = value
    return property(get, put, doc=doc)


class _Recorder(PassRecorder):
    """The running pass's recorder, its start and level in its member's pass
    state, where the C++ boundary's steady path restarts it. A member's
    recorders share those slots: only the newest is read."""

    start = _in_pass_state("recorder_start", "where the pass started")
    _level = _in_pass_state("recorder_level", "the level at its last point")

    def __init__(self, live: int, state: array):
        self._state = state
        super().__init__(live)


class _Steady(NamedTuple):
    """A pass the steady path may end and start again: its signature and
    size, and its prediction at its start (``Prediction.at(START)``): the
    rise and net it allows, which its gate asked, and the rest its gate
    asked with slack."""
    signature: tuple
    size: int
    rise: int
    net: int
    rest: int


class Member:
    """One model's training as a member of its device's session: its
    account in the session's ledger and what its passes were measured
    needing (see the module's opening)."""

    passes = _in_pass_state("passes", "passes begun")
    most = _in_pass_state("most", "the most its account held, as far as its points saw")
    _depth = _in_pass_state("depth", "nested calls of the model in the running pass")
    _as_predicted = _in_pass_state(
        "as_predicted", "single-region passes in a row within their prediction")
    _after_step = _in_pass_state(
        "after_step", "the most held just after an optimizer's step in this pass")
    _carried_peak = _in_pass_state(
        "carried_peak", "the peak read after an optimizer's step, carried to the next read")

    def __init__(self, model, session, name: str):
        self._state = array("q", [0]) * len(_SLOTS)  # the pass state: the slots above, and more
        self.model_ref = weakref.ref(model)
        self.session = session
        self.name = name
        self.ledger = session.ledger()
        self.account = ThreadAccount(self.ledger)
        self.profiles = Profiles()
        self.gates: dict[tuple, frozenset] = {}  # signature -> gate keys
        # The (module index, phase) points some signature's gates need.
        self._gate_points: frozenset = frozenset()
        self._gates_now: frozenset = frozenset()  # the running pass's gate keys
        self.thread: int | None = None  # the thread whose block runs now
        # On a GPU: the member's own stream, by which its backward (run on
        # PyTorch's shared autograd thread) is counted to it.
        self.on_cuda = str(session.device).startswith("cuda")
        self.stream = None
        self._outer_stream = None
        self._stream_context = None
        self.budget = 0       # the budget when the block began (0: none)
        self.base = 0         # its model's bytes, which it holds untagged
        self.measured_passes = 0
        self.borrowed_passes = 0  # measured passes that did not run alone (FirstPasses)
        self._kind: tuple | None = None  # the measured pass's kind (FirstPasses), while it runs
        self._modules: list = []
        self._hooks: dict[tuple, object] = {}  # (module index, phase) -> handle
        self._hooked: frozenset | None = None   # the module points hooked now
        self._placed = False
        self._root_handles: list = []
        # Where the block's caller tells it of each model call (``job_sharing``),
        # the pass boundary it calls; None where a hook on the model calls it.
        self.boundary = None
        self._root_return = None
        self._recorder: _Recorder | None = None
        self._signature: tuple | None = None
        self._size = 0
        self._prediction = None
        self._occurrences: Counter = Counter()
        self._steady = None
        # Whether an optimizer's step is a point of the running pass (it is
        # measured, or has gates inside): the global step hook reads it, at
        # every step of every member.
        self.step_point = False
        # Whether the block's caller tells it of each call of the model and
        # each optimizer step (``job_sharing``): the model has no hook, and
        # the global optimizer hooks pass it by.
        self.told = False
        # Its passes run alone, the running one and alone_left more: a step
        # of its ran out of memory beside the others and was undone
        # (job_loop.run_free).
        self.alone = False
        self.alone_left = 0
        self.alone_passes = 0

    @property
    def _steady(self) -> _Steady | None:
        """The steady path's pass: set where the pass that runs is predicted
        as one region, so that the next pass of its signature and size, if
        this one ends within its prediction, changes nothing. Kept in the
        pass state too, where the C++ boundary reads it."""
        return self._steady_pass

    @_steady.setter
    def _steady(self, steady: _Steady | None) -> None:
        self._steady_pass = steady
        state = self._state
        signature = steady.signature if steady is not None else None
        if (type(signature) is not tuple or len(signature) != 2
                or not all(type(x) is bool for x in signature)):
            state[_SLOTS["steady"]] = 0  # none, or a signature only the Python takes
            return
        for name, value in (("steady_grad", signature[0]), ("steady_training", signature[1]),
                            ("steady_size", steady.size), ("steady_rise", steady.rise),
                            ("steady_net", steady.net), ("steady_rest", steady.rest),
                            ("steady", 1)):
            state[_SLOTS[name]] = value

    @property
    def _root_return(self):
        """The model's forward hook's handle, where a pass needs it (it
        counts the depth of nested calls); its presence in the pass state."""
        return self._root_return_handle

    @_root_return.setter
    def _root_return(self, handle) -> None:
        self._root_return_handle = handle
        self._state[_SLOTS["root_return"]] = handle is not None

    # The block ------------------------------------------------------------
    def enter(self, budget: int, base: int, modules: list) -> None:
        """The block starts; ``modules``: its model's, the model first.
        Where ``told``, the block's caller calls ``boundary`` before each
        call of the model (``job_sharing``), so the model gets no forward
        pre-hook: a hook on it takes torch's slower call path at every step
        (about 8 µs of a digits MLP's 450 µs step on the CPU). Such a
        caller (``job.train``) allocates nothing in its block before its
        model's call but its batch, as each of its steps does: a steady
        pass its last block left open goes on (``exit``), asking at the
        block's start what it asked, with no pass of the block's own before
        that call (``BLOCK_START``), so that each call's first step takes
        the steady path too."""
        model = self.model_ref()
        self.thread = threading.get_ident()
        self.budget, self.base = budget, base
        self._depth = 0
        told = self.told
        if not (told and self._steady is not None):
            self._recorder = None
            self._steady = None
        self.step_point = False
        self.alone, self.alone_left = False, 0
        self._modules = modules if budget else [model]
        boundary = self._root_hook()
        self.boundary = boundary if told else None
        self._root_handles = [] if told else [
            model.register_forward_pre_hook(boundary, with_kwargs=True)]
        self._root_return = None  # the model's forward hook, where a pass needs it
        if self.on_cuda:
            self._enter_stream()
        if self.gating and self._steady is None:  # what it allocates before its model's
            self._start_pass(BLOCK_START, 0, *self._read())  # first call is a pass's too
        elif self.gating:
            # The steady pass its last block left open goes on: at its block's
            # start it asks again what it asked (a boundary's wait, never an
            # allocation's, which a tie could fail), its peak left unread.
            steady = self._steady
            live, _ = self.account.usage()
            self._wait(steady.rise, steady.rest, live + steady.net, boundary=True)

    def _enter_stream(self) -> None:
        """The block's work on the member's own stream, after what the caller
        queued before it (its batch, its model), as ``job.train`` runs a job."""
        import torch

        device = torch.device(self.session.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self._outer_stream = torch.cuda.current_stream(device)
        self.stream.wait_stream(self._outer_stream)
        self._stream_context = torch.cuda.stream(self.stream)
        self._stream_context.__enter__()
        self.ledger.set_stream_account(self.stream.cuda_stream, self.account.id)

    def _exit_stream(self) -> None:
        """The caller's stream waits for the block's work, as after ``train()``."""
        self.ledger.set_stream_account(self.stream.cuda_stream, 0)
        self._stream_context.__exit__(None, None, None)
        self._outer_stream.wait_stream(self.stream)
        self._stream_context = self._outer_stream = None

    def exit(self) -> None:
        """The block ends. Its running pass ends here, unless the block's
        caller tells it of its model's calls and the pass is a steady one:
        that pass goes on into the member's next block (``enter``), its
        peak unread, and ends at that block's first call of the model."""
        keeps_pass = self.told and self._steady is not None and self.gating
        if not keeps_pass:
            live, peak = self._read()
            if self._recorder is not None:
                self._end_pass(live, peak)
        for handle in [*self._root_handles, *self._hooks.values()]:
            handle.remove()
        if self._root_return is not None:
            self._root_return.remove()
        self._root_handles, self._hooks, self._hooked, self._placed = [], {}, None, False
        self.boundary = None
        if not keeps_pass:
            self._steady = None
        self.step_point = False
        self._root_return = None
        if self._stream_context is not None:
            self._exit_stream()
        self._modules = []
        self.thread = None

    @property
    def gating(self) -> bool:
        return bool(self.budget)

    # Passes -----------------------------------------------------------------
    def _root_hook(self):
        """The member's pass boundary for this block, where a pass begins
        (the model's forward pre-hook, or ``boundary``):
        ``_C.PassBoundary`` (``csrc/bindings/bind_sharing.cpp``). It keeps
        the depth of nested calls (the model called from its own forward is
        one pass, where the forward hook counts the depth; where it is not
        placed, a small model's steady passes, every call starts one), counts
        the pass, reads the account and takes the steady path's common case
        itself: a pass that ended with nothing to learn
        (``_single_region_ended``'s rule) asks at its gate what the last one
        asked. Every other case is ``_pass_begins``. In C++, reading and
        writing the member's pass state (``_state``) and no attribute,
        because a small model's step is short (a digits MLP's 250-450 µs on
        the CPU) and, after a step's torch work, every object touched costs
        a cache miss."""
        import torch

        return _C.PassBoundary(self, self._state, self.ledger, self.account.id, self.thread,
                               self._modules[0], self.gating, self.on_cuda,
                               torch.is_grad_enabled, torch.Tensor, elements, RECENT)

    def _pass_begins(self, signature: tuple, size: int, live: int, peak: int) -> None:
        """A pass of ``signature`` and ``size`` begins, the account read at
        ``live`` and ``peak`` (``_root_hook``), where the steady path's
        common case did not hold."""
        steady, recorder = self._steady, self._recorder
        if (steady is not None and steady.signature == signature and steady.size == size
                and not recorder.regions):
            # The steady path: a small model's step after step, the same
            # batch shape. Where the pass ending teaches nothing, the next
            # asks what this one asked: nothing else of _start_pass changes.
            region = self._single_region_ended(recorder, live, peak, steady.rise, steady.net)
            if region is None:
                if self.on_cuda:
                    self.session.probe_sharing_budget()
                self._wait(steady.rise, steady.rest, live + steady.net, boundary=True)
                recorder.restart(live)
                self._after_step = 0
                return
            self.profiles.learn(signature, size, [region])
            self._recorder = None  # ended: _start_pass goes on from here
        self._start_pass(signature, size, live, peak)

    def _root_returned(self, module, args, output):
        if self._depth and threading.get_ident() == self.thread and module is self._modules[0]:
            self._depth -= 1
            if self._depth == 0 and self.gating:
                self._hook_backward(0, output)

    def _start_pass(self, signature: tuple, size: int, live: int, peak: int) -> None:
        """The previous pass ends (``live`` and ``peak`` read at its end);
        the next one (of ``signature`` and ``size``) waits at its boundary
        until it is admitted."""
        self._steady = None
        if self._recorder is not None:
            self._end_pass(live, peak)
        if self.on_cuda and self.gating and signature != BLOCK_START:  # taken outside blocks since
            self.session.probe_sharing_budget()
        prediction = self.profiles.predict(signature, size)
        measuring = prediction is None
        if self.alone and self.alone_left <= 0:
            self.alone = False  # its passes alone are over: this one is gated as before
        alone_pass = self.alone and not measuring and signature != BLOCK_START
        if signature != BLOCK_START:
            self._place_hooks(None if measuring else self._gate_points)
            self.measured_passes += measuring
        if measuring:
            self._kind = (structure_of(self._modules), signature, size)
            if self._wait_first_pass(live):
                self.borrowed_passes += 1
        elif alone_pass:
            self._wait(None, 0, live, boundary=True)
            self.alone_passes += 1
            self.alone_left -= 1
        else:
            rise, rest, net = prediction.at(START)
            self._wait(rise, with_slack(rest), live + net, boundary=True)
        self._recorder = _Recorder(live, self._state)  # waiting, it allocated nothing
        self._after_step = 0
        self._signature, self._size, self._prediction = signature, size, prediction
        self._gates_now = frozenset() if alone_pass else self.gates.get(signature, frozenset())
        self.step_point = measuring or bool(self._gates_now)
        self._occurrences.clear()
        if not measuring and prediction.scale == 1.0 and not self._gates_now and (
                signature != BLOCK_START) and not alone_pass:
            # One region, no point inside: _end_pass's first case, which the
            # steady path repeats.
            self._steady = _Steady(signature, size, rise, net, with_slack(rest))

    def run_alone(self, passes: int) -> None:
        """Its next ``passes`` passes run alone (the others held at their
        boundaries, its claim all the room there is), within this block:
        its step ran out of memory beside the others and was undone."""
        self.alone, self.alone_left = True, passes
        self._steady = None  # each pass's start goes through _start_pass

    def _end_pass(self, live: int, peak: int) -> None:
        recorder, signature, prediction = self._recorder, self._signature, self._prediction
        self._recorder = None
        self.step_point = False
        if not recorder.regions and prediction is not None and prediction.scale == 1.0:
            predicted_rise, _, predicted_net = prediction.at(START)
            region = self._single_region_ended(recorder, live, peak, predicted_rise,
                                               predicted_net)
            if region is not None:
                self.profiles.learn(signature, self._size, [region])
            return
        recorder.at(END, max(live, self._after_step), peak)
        regions = recorder.regions
        if self._prediction is None:  # measured at every module: choose the gates
            self.gates[signature] = frozenset(gate_keys(regions, split_for(regions, self.budget)))
            if self.session.first_passes.note(self._kind, rise_of(regions),
                                              sum(r.net for r in regions),
                                              live - recorder.start, self.base):
                self.ledger.relook()  # members waiting to run this kind alone may borrow it
            self._gate_points = frozenset((k[0], k[1]) for keys in self.gates.values()
                                          for k in keys if isinstance(k[0], int))
        self.profiles.learn(signature, self._size,
                            coarsen(regions, self.gates.get(signature, frozenset())))

    def _single_region_ended(self, recorder: _Recorder, live: int, peak: int,
                             predicted_rise: int, predicted_net: int) -> Region | None:
        """A pass with no point inside (a small model's) ended at ``live``,
        ``peak``: the one region to learn of it, or None where there is
        nothing. Exactly as predicted, it has nothing to teach: the bucket's
        maxima are its own. Within the prediction, nothing new but every
        RECENT-th pass, which lets a first pass's one-time costs age out."""
        rise, net = max(0, peak - recorder.start), max(live, self._after_step) - recorder.start
        if rise == predicted_rise and net == predicted_net:
            return None
        self._as_predicted += 1
        if rise <= predicted_rise and net <= predicted_net and self._as_predicted < RECENT:
            return None
        self._as_predicted = 0
        return Region(START, rise, net)

    def _wait_first_pass(self, live: int) -> bool:
        """Wait at a first pass's boundary (``live`` bytes held): with what
        a member of the same structure needed for it (``_borrowed_ask``),
        else alone. Waiting alone, it looks again whenever a member has
        measured a first pass (``relook``) and at each poll: trials of one
        model that start together wait while the first of them is
        measured, then run beside each other rather than one by one (on a
        GPU a first pass takes seconds: cuDNN's autotuning). True where it
        was admitted with a borrowed ask."""
        borrowed = None
        while True:
            if borrowed is None:
                seen = self.ledger.relooks()  # one after this returns the gate at once
                borrowed = self._borrowed_ask(self._kind)
            least = self._room_to_go_on(self._kind)
            if borrowed is None:
                result = self._gate(None, 0, live, True, seen, least=least)
            else:
                rise, net = borrowed
                result = self._gate(rise, with_slack(rise), live + net, True, least=least)
            if result == ADMITTED:
                return borrowed is not None

    def _room_to_go_on(self, kind: tuple) -> int:
        """Under a ``memory_limit``, the room a first pass of ``kind`` is
        admitted with where a member measured that kind: what the pass rose
        and what it left held at the next pass's start (its optimizer's
        state), so that once it has made its state it can still run its
        next pass, which rises about as much, beside everything then held.
        With less, each trial that made its state could wait for another's
        room: four MLP trials under 45 MiB made three states where two
        fitted a pass beside them, and every trial waited
        (``bench/concurrent/state_fit.py``). Not the net change, which
        counts the gradients an optimizer's step leaves: asking that much
        more, no first pass fitted beside three models under 35 MiB, every
        trial waited, and one forced made a second state.

        A training pass of a kind none measured (another architecture's
        first) is guessed from those measured
        (``FirstPasses.room_to_go_on_guess``): a guess too large only makes
        it wait for a leave, where with none four MLPs of four widths under
        30 and 35 MiB trained 1-3 of 4 and one after another trains 4. 0
        for a pass that computes no gradients, for the session's first
        pass (nothing measured to guess from), and where the budget is
        measured (a GPU's without a limit: an estimate whose ties ask the
        device)."""
        if self._budget_measured():
            return 0
        measured = self.session.first_passes.get(kind)
        if measured is not None:
            return measured.to_go_on
        # A kind none measured: where the pass computes gradients (it may
        # make an optimizer's state), guessed from the kinds measured.
        signature = kind[1] if isinstance(kind, tuple) and len(kind) > 1 else None
        if isinstance(signature, tuple) and signature[:1] == (True,):
            return self.session.first_passes.room_to_go_on_guess(self.base)
        return 0

    def _borrowed_ask(self, kind: tuple) -> tuple[int, int] | None:
        """A first pass's (rise, net) to ask at its boundary, where a member
        of the same structure measured a pass of ``kind``: that pass's, each
        with room for another optimizer's state beside it (twice the
        model's bytes: Adam keeps two tensors a parameter). None where none
        was measured, or where the budget less what the members hold live
        (regions in flight left out) is not twice the rise asked: memory is
        not plentiful, and the pass runs alone, as any first pass, so that
        a wrong guess costs a wait, never a failure. Where it is, the gate
        still admits the ask only beside the others' regions.

        Except, under a ``memory_limit``, where that room is less than the
        measured pass rose and left held (``_room_to_go_on``): then the
        others' state, not their passes, holds what it lacks, and running
        alone would only drain their passes and start it short, to fail in
        the tie-break where one after another trains it. It asks what was
        measured, with the spare, and waits at its gate for a member to
        leave, holding no one back.
        A measured budget (a GPU's without a limit) is an estimate with a
        margin, past which a tie asks the device: there it runs alone, as
        the simulator, which models that case, has it."""
        seen = self.session.first_passes.get(kind)
        if seen is None:
            return None
        spare = 2 * self.base
        rise, net = seen.rise + spare, max(0, seen.net) + spare
        room = self.ledger.room_beside_live(self.account.id)
        if 2 * rise > room and room >= self._room_to_go_on(kind):
            return None
        return rise, net

    def _budget_measured(self) -> bool:
        """Whether the budget shared is the session's estimate of a GPU's
        room rather than a ``memory_limit`` the user set."""
        return bool(self.ledger.share_stats()["measured"])

    # Points -----------------------------------------------------------------
    def _point(self, key: tuple) -> None:
        """A point of the pass: at a gate (or measuring: anywhere), read the
        account; at a gate, on the member's thread, wait. Other points would
        only be merged into their gate's region (``coarsen``): skipped."""
        recorder, prediction = self._recorder, self._prediction
        if recorder is None or (prediction is not None and key not in self._gates_now):
            return
        live, peak = self._read()
        recorder.at(key, live, peak)
        if prediction is not None and threading.get_ident() == self.thread:
            rise, rest, net = prediction.at(key)
            self._wait(rise, with_slack(rest), live + net, boundary=False)

    def _read(self) -> tuple[int, int]:
        """The account's (bytes live, most since the last read)."""
        live, peak = self.ledger.take_peak(self.account.id)
        peak = max(peak, self._carried_peak)
        self._carried_peak = 0
        self.most = max(self.most, peak)
        return live, peak

    def optimizer_stepped(self) -> None:
        """An optimizer's step ended: a pass's end is counted at least as high
        as what is held here (the gradients), since the block can end here,
        after its last batch, with no ``zero_grad`` to free them: the others'
        gates count on what a member holds when its pass ends."""
        if self._recorder is not None:
            live, peak = self.ledger.take_peak(self.account.id)
            self._carried_peak = max(self._carried_peak, peak)
            self._after_step = max(self._after_step, live)

    def _wait(self, rise, rest: int, end: int, boundary: bool) -> None:
        """Wait at a gate until the session admits the region (``rise`` None:
        the pass runs alone). Ctrl-C (the session interrupted) raises here."""
        while self._gate(rise, rest, end, boundary) != ADMITTED:
            pass

    def _gate(self, rise, rest: int, end: int, boundary: bool, relooks_seen=None,
              least: int = 0) -> int:
        """One call at a gate: ADMITTED, or TIMED_OUT after a poll or a
        relook (the member still waits there, and calls again, perhaps
        asking otherwise). Ctrl-C (the session interrupted) raises here."""
        result = self.ledger.gate(self.account.id, rise, max(0, rest), max(0, end), boundary,
                                  GATE_POLL_MS, relooks_seen, least)
        if result == INTERRUPTED:
            raise KeyboardInterrupt(f"{self.name!r} stopped at a gate: training was "
                                    "interrupted")
        return result

    def module_called(self, index: int):
        def pre_hook(module, args):
            # (A copy of the model made inside the block carries the hook:
            # its calls are not this pass's.)
            if (threading.get_ident() == self.thread and self._recorder is not None
                    and self._modules[index] is module):
                key = (index, "f", self._occurrences[(index, "f")])
                self._occurrences[(index, "f")] += 1
                self._point(key)
        return pre_hook

    def module_returned(self, index: int):
        def post_hook(module, args, output):
            if (threading.get_ident() == self.thread and self._recorder is not None
                    and self._modules[index] is module):
                self._hook_backward(index, output)
        return post_hook

    def _hook_backward(self, index: int, output) -> None:
        """A point where the backward of ``output`` starts: a hook on the
        autograd node that made it (no change to the graph or its values)."""
        if self._recorder is None or self.on_cuda or not self._wants(index, "b"):
            return  # on a GPU the backward runs on autograd's shared thread: no points there
        node = first_grad_fn(output)
        if node is None:
            return
        key = (index, "b", self._occurrences[(index, "b")])
        self._occurrences[(index, "b")] += 1

        def reached(grad_outputs, key=key):
            # On the CPU autograd runs the backward on the calling thread; on
            # a GPU on its device thread, shared by every member: read there,
            # never wait (``_point`` waits on the member's thread only).
            self._point(key)
        node.register_prehook(reached)

    def optimizer_step(self) -> None:
        if self._recorder is not None and (self._prediction is None or self._gates_now):
            key = ("step", self._occurrences["step"])
            self._occurrences["step"] += 1
            self._point(key)

    # Hooks ------------------------------------------------------------------
    def _wants(self, index: int, phase: str) -> bool:
        return self._hooked is None or (index, phase) in self._hooked

    def _place_hooks(self, points: frozenset | None) -> None:
        """Hooks at ``points`` (None: every module's, to measure a pass)."""
        if self._placed and points == self._hooked:
            return
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self._hooked, self._placed = points, True
        wants_return = points is None or (0, "b") in points
        if wants_return and self._root_return is None:
            self._root_return = self._modules[0].register_forward_hook(self._root_returned,
                                                                       always_call=True)
        elif not wants_return and self._root_return is not None:
            self._root_return.remove()
            self._root_return = None
        for index, module in enumerate(self._modules):
            if index and (points is None or (index, "f") in points):
                self._hooks[(index, "f")] = module.register_forward_pre_hook(
                    self.module_called(index))
            if index and (points is None or (index, "b") in points):
                self._hooks[(index, "b")] = module.register_forward_hook(
                    self.module_returned(index))

    def stats(self) -> dict:
        """Its passes, those measured (and of them, those that asked what
        another member's first pass needed rather than run alone), those run
        alone after a step of its was undone (``run_alone``), its gates
        per kind of pass, and its bytes (its model's included): now, and the
        most its points saw."""
        return {"name": self.name, "passes": self.passes,
                "measured_passes": self.measured_passes,
                "borrowed_passes": self.borrowed_passes,
                "alone_passes": self.alone_passes,
                "gates": {str(s): len(k) for s, k in self.gates.items()},
                "bytes": self.base + self.ledger.usage(self.account.id)[0],
                "peak_bytes": self.base + self.most}

    def __repr__(self) -> str:
        return f"Member({self.name!r}, {self.passes} passes)"


# A call of the model with no keyword arguments, as a member's ``boundary``
# is told it (``job_sharing``); never written, so one dict serves every call.
NO_KEYWORDS: dict = {}


class sharing:
    """``with waterwave.sharing(model):`` (see the module's opening). The
    device is the model's (its parameters'); ``session`` another than the
    device's; ``name`` what stats and errors call it (the model's class)."""

    # Whether the block's caller tells its member of each call of the model
    # and each optimizer step (``job_sharing``). Otherwise the block hooks
    # the model's calls and every optimizer's step (the global optimizer
    # hooks, while any block runs): a user's loop calls its model and steps
    # its optimizer where only a hook sees it.
    caller_tells = False

    def __init__(self, model, session=None, *, name: str | None = None):
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"waterwave.sharing takes the model being trained (a "
                            f"torch.nn.Module), not a {type(model).__name__}")
        self.model = model
        self.name = name or type(model).__name__
        self._session = session
        self.member: Member | None = None

    def __enter__(self) -> Member:
        from .session import training_session

        model = self.model
        session = self._session or training_session(model_device(model))
        with _members_lock:
            member = _members.get(model)
            if member is None or member.session is not session:
                member = _members[model] = Member(model, session, self.name)
            if member.thread is not None:
                raise RuntimeError(f"{self.name!r} already shares its device from another "
                                   "thread: train a model in one sharing block at a time")
            if getattr(_local, "member", None) is not None:
                raise RuntimeError("this thread is already in a sharing block (of "
                                   f"{_local.member.name!r}): one block per thread")
            member.thread = threading.get_ident()
        try:
            if not self.caller_tells:
                _optimizer_hooks_on()
        except BaseException:
            member.thread = None
            raise
        member.told = self.caller_tells
        modules = list(model.modules())  # one walk of the model, for its bytes and its hooks
        base = base_bytes(model, session.device, modules)
        try:
            budget = session.join_sharing(member, base)
        except BaseException:
            member.thread = None
            if not self.caller_tells:
                _optimizer_hooks_off()
            raise
        self.member = member
        try:
            member.enter(budget, base, modules)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        member.account.tag()
        _local.member = member
        return member

    def __exit__(self, kind, error, trace) -> None:
        member = self.member
        self.member = None
        ThreadAccount.untag()
        _local.member = None
        try:
            member.exit()
        finally:
            if not self.caller_tells:
                _optimizer_hooks_off()
            member.session.leave_sharing(member)
        return None


class job_sharing(sharing):
    """``sharing`` for a ``Job``'s eager steps (``job.train`` where nothing
    is captured), whose loop calls the model and steps the optimizer
    itself: it calls the member's ``boundary`` before each call of the
    model, so the model has no forward pre-hook, and tells the member of
    each step (``Member.optimizer_step`` where the step is a point of the
    pass), so no global optimizer hook runs for it, at every step of every
    optimizer in the process. Its steps free their gradients right after
    the update, within the pass, so nothing is read after the step: what
    the pass ends with is what the next one starts from. (A batch of other
    inputs, which ``Job.plain_step`` hands to ``_eager_step``, tells
    nothing: that pass has no point at its step, and is measured coarser.)"""

    caller_tells = True


def _optimizer_hooks_on() -> None:
    """The global optimizer hooks (an optimizer's step is a point of the
    member stepping it), while any block runs."""
    global _blocks_running
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    with _members_lock:
        if _blocks_running == 0:
            _optimizer_hooks.append(register_optimizer_step_pre_hook(_optimizer_stepping))
            _optimizer_hooks.append(register_optimizer_step_post_hook(_optimizer_stepped))
        _blocks_running += 1


def _optimizer_hooks_off() -> None:
    global _blocks_running
    with _members_lock:
        _blocks_running -= 1
        if _blocks_running == 0:
            for handle in _optimizer_hooks:
                handle.remove()
            _optimizer_hooks.clear()


def _optimizer_stepping(optimizer, args, kwargs):
    member = getattr(_local, "member", None)
    if member is not None and member.step_point and not member.told:
        member.optimizer_step()
    return None


def _optimizer_stepped(optimizer, args, kwargs):
    member = getattr(_local, "member", None)
    if member is not None and member.budget and not member.told:  # gating
        member.optimizer_stepped()
    return None


# A captured step (job.train) runs no step hooks and refuses optimizers that
# have some; these act only in a member's thread, where steps are eager.
_optimizer_stepping.waterwave_not_in_captured_steps = True
_optimizer_stepped.waterwave_not_in_captured_steps = True


def elements(value, depth: int = 0) -> int:
    """The elements of the tensors in a model's arguments (nested lists,
    tuples and mappings: a dict batch, a PackedSequence)."""
    import torch

    if type(value) is tuple and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value[0].numel()  # the usual call: one tensor
    if isinstance(value, torch.Tensor):
        return value.numel()
    if depth > 4:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(elements(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return sum(elements(v, depth + 1) for v in value.values())
    return 0


def first_grad_fn(output, depth: int = 0):
    """The autograd node of the first tensor in a module's output that has
    one (a tensor, a tuple, a dict, a model output object)."""
    import torch

    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if depth > 3:
        return None
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for value in output:
            node = first_grad_fn(value, depth + 1)
            if node is not None:
                return node
    return None


def structure_of(modules: list) -> tuple:
    """What makes two models' passes alike, as far as their modules tell:
    each module's class, and its parameters' and buffers' names, shapes and
    dtypes (and whether each parameter trains), in order. Two trials of one
    model at other learning rates share it; another width does not."""
    return tuple(
        (type(m),
         tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
               for name, p in m._parameters.items() if p is not None),
         tuple((name, tuple(b.shape), b.dtype) for name, b in m._buffers.items() if b is not None))
        for m in modules)


def model_device(model):
    """The device a model trains on: its parameters' (else its buffers')."""
    import torch

    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def base_bytes(model, device: str, modules: list | None = None) -> int:
    """Bytes of the model's parameters and buffers on ``device``: a member
    holds them without having allocated them in its blocks. ``modules``: the
    model's (``model.modules()``), where the caller has them: each block
    start reads them, and their own dictionaries are read faster than
    ``parameters()`` walks the model again."""
    import torch

    kind = torch.device(device).type
    storages = {}
    for module in model.modules() if modules is None else modules:
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and tensor.device.type == kind:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


__all__ = ["sharing", "job_sharing", "Member", "Region"]
