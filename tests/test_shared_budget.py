"""The shared budget of ``waterwave.sharing``'s members (issue 39, item 2),
driven directly: a ledger of its own (``_C.ThreadAccounts()``), threads as
members, their allocations told to it. The rule (csrc/runtime/
shared_budget.cpp): a gate admits a region when its predicted rise fits and
the state stays safe; a pass with no prediction runs alone; an allocation
past the budget waits for the others' frees; when every member waits, one
allocation fails naming the budget, else a gate goes on. Never a hang, and
the members' bytes never pass the budget."""
import itertools
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import start_and_join

from waterwave import _C

ADMITTED, TIMED_OUT, INTERRUPTED = 0, 1, 2
_addresses = itertools.count(1 << 20)


class SimMember:
    """A member on a thread of its own: passes of (rise, actual) regions,
    each region's allocations told to the ledger, freed at the pass's end."""

    def __init__(self, ledger, base=0, device=None):
        self.ledger, self.device = ledger, device  # device: a Device its memory comes from
        self.id = ledger.open()
        ledger.join(self.id, base)
        self.error = None
        self.passes = 0

    def gate(self, rise, rest, end, boundary):
        while (r := self.ledger.gate(self.id, rise, rest, end, boundary, 50)) == TIMED_OUT:
            pass
        return r

    def allocate(self, nbytes):
        ptr = next(_addresses)
        (self.device or self.ledger).allocate(ptr, nbytes)
        return ptr

    def free(self, ptr):
        (self.device or self.ledger).free(ptr)

    def run(self, passes, kept=0):
        """``passes``: lists of (predicted rise, bytes actually allocated)
        per region; ``kept``: bytes allocated once in the first pass and
        held after (an optimizer's state)."""
        _C.ThreadAccounts.set_thread(self.id)
        held, live = [], []
        try:
            for p, regions in enumerate(passes):
                rest = sum(r for r, _ in regions)
                self.gate(regions[0][0] if p else None, rest, 0, boundary=True)
                live = []
                for k, (rise, actual) in enumerate(regions):
                    if k:
                        self.gate(rise, sum(r for r, _ in regions[k:]), 0, boundary=False)
                    if actual:
                        live.append(self.allocate(actual))
                    time.sleep(0.0005)
                if p == 0 and kept:
                    held.append(self.allocate(kept))
                while live:
                    self.free(live.pop())
                self.passes += 1
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            self.error = e
            while live:  # its thread unwinds: the pass's tensors go
                self.free(live.pop())
        finally:
            _C.ThreadAccounts.set_thread(0)
            self.ledger.leave(self.id)
        return held



def two_members(budget: int):
    """A ledger with ``budget`` bytes to share and two members in it, holding
    nothing yet: (ledger, a, b)."""
    ledger = _C.ThreadAccounts()
    ledger.set_budget(budget)
    a, b = ledger.open(), ledger.open()
    ledger.join(a, 0)
    ledger.join(b, 0)
    return ledger, a, b

def run_members(members, plans, timeout=60):
    threads = [threading.Thread(target=m.run, args=(plan,)) for m, plan in zip(members, plans)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "members hung"


def test_members_take_turns_where_both_do_not_fit_and_never_pass_the_budget():
    ledger = _C.ThreadAccounts()
    ledger.set_budget(1000)
    a, b = SimMember(ledger, base=100), SimMember(ledger, base=100)
    plans = [[[(400, 400)]] * 30, [[(500, 500)]] * 30]
    run_members([a, b], plans)
    stats = ledger.share_stats()
    assert a.error is None and b.error is None
    assert a.passes == b.passes == 30
    assert stats["peak"] <= 1000
    assert stats["gate_waits"] > 0  # they did wait for each other
    assert stats["failed"] == stats["forced"] == 0


def test_members_that_fit_together_run_side_by_side():
    ledger = _C.ThreadAccounts()
    ledger.set_budget(10_000)
    a, b = SimMember(ledger), SimMember(ledger)
    run_members([a, b], [[[(400, 400)]] * 20] * 2)
    stats = ledger.share_stats()
    assert stats["peak"] == 800  # both at once
    assert stats["failed"] == stats["forced"] == 0


def test_a_pass_with_no_prediction_runs_alone():
    ledger, a, b = two_members(10_000)
    assert ledger.gate(a, 100, 100, 0, True, 0) == ADMITTED  # a is in a pass
    assert ledger.gate(b, None, 0, 0, True, 0) == TIMED_OUT  # b must run alone: waits for a
    # a back at its boundary waits too: b came first
    assert ledger.gate(a, 100, 100, 0, True, 0) == TIMED_OUT
    assert ledger.share_stats()["waiting"] == 2
    assert ledger.gate(b, None, 0, 0, True, 0) == ADMITTED  # no one else in a pass
    assert ledger.gate(a, 100, 100, 0, True, 0) == TIMED_OUT  # b's pass runs alone
    assert ledger.gate(b, 100, 100, 0, True, 0) == ADMITTED  # b's pass ended
    assert ledger.gate(a, 100, 100, 0, True, 0) == ADMITTED


def test_relook_returns_a_gate_waiting_to_run_alone_to_its_member_at_once():
    """A first pass of a waiting member's kind measured (``relook``): a gate
    waiting to run alone returns at once, still waiting in its turn, so its
    member can ask what that pass needed; a gate with a prediction keeps
    waiting. What a member could ask beside the others leaves their
    regions in flight out (``room_beside_live``)."""
    ledger, a, b = two_members(10_000)
    c = ledger.open()
    ledger.join(c, 300)
    assert ledger.gate(a, 100, 100, 0, True, 0) == ADMITTED  # a is in a pass
    assert ledger.room_beside_live(b) == 10_000 - 300  # a's claim left out, c's base not
    results = {}

    def wait(member, rise):
        start = time.monotonic()
        results[member] = (ledger.gate(member, rise, 0 if rise is None else rise, 0, True, 5000),
                           time.monotonic() - start)

    assert ledger.gate(b, None, 0, 0, True, 0) == TIMED_OUT  # b arrives, to run alone
    seen = ledger.relooks()  # as b chose to run alone, before a relook it did not see
    ledger.relook()
    start = time.monotonic()
    assert ledger.gate(b, None, 0, 0, True, 5000, seen) == TIMED_OUT
    assert time.monotonic() - start < 2
    threads = [threading.Thread(target=wait, args=(b, None))]
    threads[0].start()
    deadline = time.monotonic() + 10
    while ledger.share_stats()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    ledger.relook()
    threads[0].join(10)
    result, waited = results[b]
    assert result == TIMED_OUT and waited < 2  # back at once, not after 5 s
    assert ledger.share_stats()["waiting"] == 1  # still in its turn
    assert ledger.gate(b, 100, 100, 0, True, 0) == ADMITTED  # it asks what was measured
    start = time.monotonic()
    relooking = threading.Timer(0.05, ledger.relook)
    relooking.start()
    assert ledger.gate(c, 20_000, 20_000, 0, True, 300) == TIMED_OUT  # past the budget
    relooking.join()
    assert time.monotonic() - start >= 0.25  # a prediction waits out its poll
    with pytest.raises(Exception, match="not open"):
        ledger.room_beside_live(12345)


def test_a_gate_waits_where_the_state_would_be_unsafe():
    # Each pass rises to 700 and ends keeping 500. b's first region fits
    # beside a's now, but admitting it would leave no order in which both
    # finish: a finished holds 500, and b would need 600 more.
    ledger, a, b = two_members(1000)
    assert ledger.gate(a, 100, 700, 500, True, 0) == ADMITTED
    assert ledger.gate(b, 100, 700, 500, True, 0) == TIMED_OUT
    ledger.leave(a)
    assert ledger.gate(b, 100, 700, 500, True, 0) == ADMITTED


def each_holds_then_asks(ledger, ids, memory, held, more, timeout=10):
    """Members ``ids`` of ``ledger``, each on a thread of its own, take
    ``held[k]`` bytes from ``memory`` (the ledger itself, or a ``Device``
    over it), meet, then each ask ``more`` and give it back. Returns each
    one's error (None: it got the memory); every thread unwinds, freeing
    what it holds, and leaves."""
    errors, started = [None] * len(ids), threading.Barrier(len(ids))

    def member(k):
        _C.ThreadAccounts.set_thread(ids[k])
        try:
            memory.allocate(10 + k, held[k])
            started.wait()
            memory.allocate(20 + k, more)
            memory.free(20 + k)
        except MemoryError as e:
            errors[k] = e
        finally:
            memory.free(10 + k)
            _C.ThreadAccounts.set_thread(0)
            ledger.leave(ids[k])

    start_and_join([threading.Thread(target=member, args=(k,)) for k in range(len(ids))],
                   timeout, "members hung")
    return errors


def test_an_allocation_past_the_budget_waits_for_the_others_frees():
    ledger, a, b = two_members(1000)
    assert ledger.gate(b, 600, 600, 0, True, 0) == ADMITTED
    _C.ThreadAccounts.set_thread(b)
    ledger.allocate(1, 600)
    _C.ThreadAccounts.set_thread(0)
    done = threading.Event()

    def allocate_600():
        _C.ThreadAccounts.set_thread(a)
        ledger.allocate(2, 600)  # past the budget beside b's 600: waits
        _C.ThreadAccounts.set_thread(0)
        done.set()

    t = threading.Thread(target=allocate_600)
    t.start()
    assert not done.wait(0.3)
    assert ledger.share_stats()["allocation_waits"] == 1
    ledger.free(1)  # b's memory comes back, its region's claim at its next gate
    assert not done.wait(0.3)
    assert ledger.gate(b, 300, 300, 0, True, 0) == ADMITTED
    assert done.wait(5)
    t.join()
    assert ledger.share_stats()["peak"] <= 1000


def test_every_member_waiting_fails_one_allocation_naming_the_budget():
    ledger, *ids = two_members(1000)
    errors = each_holds_then_asks(ledger, ids, ledger, [400, 400], 400)  # 1,600 of 1,000
    failed = [e for e in errors if e is not None]
    assert len(failed) == 1, errors  # one fails, alone; the other went on
    assert "memory_limit=1000 bytes" in str(failed[0]) and "every trial" in str(failed[0])
    assert ledger.share_stats()["failed"] == 1
    assert ledger.share_stats()["peak"] <= 1000


# Members on a device: each a list of regions, (predicted rise, bytes
# actually allocated), run for a number of passes.
DEVICE_MIXES = st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 500)),
                                           min_size=1, max_size=4),
                                  st.integers(1, 5)),
                        min_size=2, max_size=4)


class Device:
    """A device of ``capacity`` bytes under the members' ledger, as the CUDA
    runtime's allocation path uses it: where the device has no room, a
    member's allocation waits for the others' frees (``wait_for_frees``)
    and tries again, or fails with why."""

    def __init__(self, ledger, capacity):
        self.ledger, self.capacity, self.used = ledger, capacity, 0
        self.lock = threading.Lock()
        self.sizes: dict = {}

    def allocate(self, ptr, nbytes):
        waited = False
        while True:
            with self.lock:
                room = self.used + nbytes <= self.capacity
                if room:
                    self.used += nbytes
                    self.sizes[ptr] = nbytes
            if room:
                try:
                    self.ledger.allocate(ptr, nbytes)  # the budget's wait, if any
                except MemoryError:
                    with self.lock:
                        self.used -= self.sizes.pop(ptr)
                    raise
                if waited:
                    self.ledger.done_waiting()
                return
            retry, why = self.ledger.wait_for_frees(nbytes)
            if not retry:
                raise MemoryError(f"the device is out of memory; {why}")
            waited = True

    def free(self, ptr):
        with self.lock:
            self.used -= self.sizes.pop(ptr)
        self.ledger.free(ptr)


def test_a_member_the_device_ran_out_for_waits_for_another_members_frees():
    """The device, not the budget, has no room (nothing waits at a budget
    here): the allocation waits, giving up the GIL, until another member
    frees, then goes through."""
    ledger, a, b = two_members(0)
    device = Device(ledger, 1000)
    _C.ThreadAccounts.set_thread(a)
    device.allocate(1, 800)
    done = threading.Event()

    def member_b():
        _C.ThreadAccounts.set_thread(b)
        try:
            device.allocate(2, 400)
            done.set()
        finally:
            _C.ThreadAccounts.set_thread(0)

    t = threading.Thread(target=member_b)
    t.start()
    assert not done.wait(0.3)  # it waits, and this thread runs meanwhile
    assert ledger.share_stats()["waiting"] == 1
    device.free(1)
    assert done.wait(5)
    t.join()
    _C.ThreadAccounts.set_thread(0)
    stats = ledger.share_stats()
    assert stats["device_waits"] == 1 and stats["waiting"] == 0 and stats["failed"] == 0


def test_a_thread_that_is_no_member_or_a_member_alone_never_waits_for_the_device():
    """PyTorch's autograd thread runs every member's backward untagged: it
    must not wait (it would hold up the backward passes that free). A
    member alone has no one to wait for: the device's error stands."""
    ledger, a, b = two_members(0)
    assert ledger.wait_for_frees(100) == (False, "")  # untagged
    other = ledger.open()  # an account that is no member (a job between its calls)
    _C.ThreadAccounts.set_thread(other)
    try:
        assert ledger.wait_for_frees(100) == (False, "")
    finally:
        _C.ThreadAccounts.set_thread(0)
    _C.ThreadAccounts.set_thread(a)  # a member, but the other left: alone, it fails at once
    ledger.leave(b)
    try:
        assert ledger.wait_for_frees(100) == (False, "")
    finally:
        _C.ThreadAccounts.set_thread(0)
    assert ledger.share_stats()["device_waits"] == 0


def refused_allocation(ledger, device, member, ptr, nbytes):
    """``member`` allocates ``nbytes`` on ``device`` from a thread of its own,
    which the device refuses: (the thread, an event set once it went
    through), returned once the ledger shows it waiting."""
    done = threading.Event()

    def allocate():
        _C.ThreadAccounts.set_thread(member)
        try:
            device.allocate(ptr, nbytes)
            done.set()
        finally:
            _C.ThreadAccounts.set_thread(0)

    t = threading.Thread(target=allocate)
    t.start()
    deadline = time.monotonic() + 5
    while ledger.share_stats()["waiting"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ledger.share_stats()["waiting"] == 1
    return t, done


def test_while_the_device_refuses_a_member_the_others_next_passes_wait():
    """The budget has room the device's cache holds: member b waits for the
    device. Member a, its pass over, does not start its next one while c's
    pass runs, which would take again what c frees for b; once c frees and
    b's allocation goes through, a starts."""
    ledger, a, b = two_members(10_000)
    c = ledger.open()
    ledger.join(c, 0)
    device = Device(ledger, 500)
    for member, ptr, nbytes in ((a, 1, 100), (b, 2, 150), (c, 3, 200)):
        assert ledger.gate(member, 300, 300, 0, True, 0) == ADMITTED
        _C.ThreadAccounts.set_thread(member)
        device.allocate(ptr, nbytes)
    device.free(1)  # a's pass frees what it made
    _C.ThreadAccounts.set_thread(0)
    t, done = refused_allocation(ledger, device, b, 4, 200)  # 550 of 500 with c's
    assert ledger.gate(a, 100, 100, 0, True, 0) == TIMED_OUT  # the budget has room; b waits
    _C.ThreadAccounts.set_thread(c)
    device.free(3)  # c's pass frees: b's allocation goes through
    _C.ThreadAccounts.set_thread(0)
    assert done.wait(5)
    t.join()
    assert ledger.gate(a, 100, 100, 0, True, 5000) == ADMITTED
    stats = ledger.share_stats()
    assert stats["device_waits"] == 1 and stats["failed"] == 0


def test_with_no_other_pass_in_flight_a_refused_member_waits_and_the_others_go_on():
    """Memory outside the members' blocks (a trial's evaluation) fills the
    device: member b waits for it. Member a's next pass starts, since no
    pass in flight would free anything for b, and b neither fails nor hangs:
    once the outside memory is freed, b's next look finds it."""
    ledger, a, b = two_members(10_000)
    device = Device(ledger, 500)
    assert ledger.gate(a, 100, 100, 0, True, 0) == ADMITTED
    assert ledger.gate(b, 300, 300, 0, True, 0) == ADMITTED
    _C.ThreadAccounts.set_thread(b)
    device.allocate(1, 150)
    _C.ThreadAccounts.set_thread(0)
    with device.lock:
        device.used += 300  # an evaluation outside every block
    t, done = refused_allocation(ledger, device, b, 2, 100)  # 550 of 500
    assert ledger.gate(a, 100, 100, 0, True, 0) == ADMITTED  # a's next pass starts
    assert not done.wait(0.3)
    with device.lock:
        device.used -= 300  # the evaluation ends; no member's free wakes b: its poll does
    assert done.wait(5)
    t.join()
    assert ledger.share_stats()["failed"] == 0


def test_members_all_waiting_for_the_device_fail_one_and_the_other_goes_on():
    """Both members hold memory and each asks for more than the device has
    left: one of them fails (the one furthest past what it was admitted
    to), naming why, unwinds and leaves; the other then gets its memory."""
    ledger, *ids = two_members(0)
    errors = each_holds_then_asks(ledger, ids, Device(ledger, 1000), [600, 300], 200)
    assert errors[1] is None and errors[0] is not None, errors  # 1,300 wanted of 1,000
    assert "every trial sharing the device was waiting for another's memory" in str(errors[0])
    assert ledger.share_stats()["failed"] == 1 and ledger.share_stats()["device_waits"] == 2


def test_past_a_measured_budget_a_tie_lets_one_allocation_ask_the_device():
    """A GPU session with no memory_limit measures its budget (95% of what
    the allocator can still give): no limit of the user's. A tie among
    members waiting past it lets one allocation go on to the device, which
    has the room here, where the user's budget would fail one (above)."""
    ledger = _C.ThreadAccounts()
    ledger.set_budget(1000, measured=True)
    ids = [ledger.open(), ledger.open()]
    for i in ids:
        ledger.join(i, 0)
    device = Device(ledger, 2000)
    errors = each_holds_then_asks(ledger, ids, device, [400, 400], 400)  # 1,600 of 1,000
    assert errors == [None, None]
    stats = ledger.share_stats()
    assert stats["overdrawn"] == 1 and stats["failed"] == 0
    assert stats["peak"] == 1200  # past the measured budget, within the device
    assert device.used == 0


@settings(max_examples=20)
@given(DEVICE_MIXES, st.integers(500, 2500))
def test_random_members_under_a_measured_budget_fail_only_where_the_device_refuses(specs,
                                                                                   capacity):
    # A budget measured as a GPU session measures it (95% of the device):
    # every run ends, the device never gives more than it has, and a member
    # fails only with the device's refusal, never the budget's; where every
    # member's pass fits beside the others' at once, nothing fails.
    ledger = _C.ThreadAccounts()
    ledger.set_budget(capacity * 95 // 100, measured=True)
    device = Device(ledger, capacity)
    members = [SimMember(ledger, 0, device) for _ in specs]
    plans = [[regions] * passes for regions, passes in specs]
    run_members(members, plans, timeout=60)
    assert device.used == 0
    assert ledger.share_stats()["failed"] <= sum(m.error is not None for m in members)
    for m, (_, passes) in zip(members, specs):
        if m.error is not None:
            assert isinstance(m.error, MemoryError), m.error
            assert "the device is out of memory" in str(m.error), m.error
            assert "memory_limit=" not in str(m.error), m.error
        else:
            assert m.passes == passes
    if sum(sum(actual for _, actual in regions) for regions, _ in specs) <= capacity:
        assert all(m.error is None for m in members)


def test_members_at_gates_that_cannot_all_fit_break_the_tie_without_failing():
    # A pass predicted larger than the budget allows beside the others'
    # holdings still runs (a gate goes on with the room there is) and,
    # needing less than predicted, finishes.
    ledger = _C.ThreadAccounts()
    ledger.set_budget(1000)
    a = SimMember(ledger, base=300)
    b = SimMember(ledger, base=300)
    plans = [[[(900, 200)]] * 5, [[(900, 200)]] * 5]
    run_members([a, b], plans)
    assert a.error is None and b.error is None
    stats = ledger.share_stats()
    assert stats["forced"] > 0 and stats["failed"] == 0
    assert stats["peak"] <= 1000


def test_interrupt_wakes_every_gate_and_fails_waiting_allocations():
    ledger, a, b = two_members(1000)
    assert ledger.gate(a, 900, 900, 0, True, 0) == ADMITTED
    results = []

    def wait_at_gate():
        results.append(ledger.gate(b, 900, 900, 0, True, 10_000))

    t = threading.Thread(target=wait_at_gate)
    t.start()
    time.sleep(0.1)
    ledger.interrupt()
    t.join(5)
    assert results == [INTERRUPTED]
    _C.ThreadAccounts.set_thread(a)
    with pytest.raises(MemoryError, match="interrupted"):
        ledger.allocate(5, 2000)
    _C.ThreadAccounts.set_thread(0)
    ledger.leave(a)
    ledger.leave(b)
    # The last member gone, the next block starts afresh.
    ledger.join(a, 0)
    assert ledger.gate(a, 10, 10, 0, True, 0) == ADMITTED


def test_without_a_budget_nothing_waits():
    ledger = _C.ThreadAccounts()
    a = ledger.open()
    ledger.join(a, 0)
    _C.ThreadAccounts.set_thread(a)
    ledger.allocate(7, 1 << 40)
    _C.ThreadAccounts.set_thread(0)
    assert ledger.gate(a, 1 << 50, 1 << 50, 0, True, 0) == ADMITTED
    assert ledger.share_stats()["peak"] == 1 << 40


def test_a_member_that_left_holds_its_bytes_until_its_account_closes():
    ledger = _C.ThreadAccounts()
    ledger.set_budget(1000, 50)
    a = ledger.open()
    ledger.join(a, 100)
    _C.ThreadAccounts.set_thread(a)
    ledger.allocate(3, 200)  # an optimizer's state, kept
    _C.ThreadAccounts.set_thread(0)
    ledger.leave(a)
    stats = ledger.share_stats()
    assert stats["held"] == 50 + 100 + 200 and stats["active"] == 0
    ledger.close(a)
    assert ledger.share_stats()["held"] == 50
    assert ledger.share_stats()["members_live"] == 0


def test_a_waiting_allocation_gives_up_the_gil():
    # An allocation made with the GIL held (a CPU tensor from a Python list)
    # waits without it: another Python thread runs and frees.
    ledger, a, b = two_members(1000)
    _C.ThreadAccounts.set_thread(b)
    ledger.allocate(1, 900)
    _C.ThreadAccounts.set_thread(0)

    def free_soon():
        time.sleep(0.2)  # Python code: needs the GIL
        ledger.free(1)
        ledger.leave(b)  # its claim goes with it

    t = threading.Thread(target=free_soon)
    t.start()
    _C.ThreadAccounts.set_thread(a)
    ledger.allocate(2, 900)  # waits (the binding gives the GIL up; so does the hook)
    _C.ThreadAccounts.set_thread(0)
    t.join()
    assert ledger.share_stats()["allocation_waits"] == 1


@settings(max_examples=25)
@given(st.lists(st.tuples(st.integers(0, 300),               # base
                          st.lists(st.tuples(st.integers(0, 400),   # predicted rise
                                             st.integers(0, 500)),  # actual bytes
                                   min_size=1, max_size=4),
                          st.integers(1, 6)),                # passes
                min_size=1, max_size=4),
       st.integers(600, 3000), st.booleans())
def test_random_members_end_and_never_pass_the_budget(specs, budget, relooking):
    # Any mix (mispredictions included): every run ends, the members' bytes
    # never pass the budget, and a member fails only with out of memory;
    # also with relooks all along (first passes measured meanwhile), which
    # return the gates waiting to run alone to their members again and again.
    ledger = _C.ThreadAccounts()
    ledger.set_budget(budget)
    bases = [min(base, budget // (2 * len(specs))) for base, _, _ in specs]
    members = [SimMember(ledger, base) for base in bases]
    plans = [[regions] * passes for _, regions, passes in specs]
    done = threading.Event()

    def relook():
        while not done.wait(0.0005):
            ledger.relook()

    relooks = threading.Thread(target=relook, daemon=True)
    if relooking:
        relooks.start()
    try:
        run_members(members, plans, timeout=60)
    finally:
        done.set()
        if relooking:
            relooks.join()
    stats = ledger.share_stats()
    assert stats["peak"] <= budget
    for m, (_, regions, passes) in zip(members, specs):
        if m.error is not None:
            assert isinstance(m.error, MemoryError), m.error
        else:
            assert m.passes == passes
    # What fails is only what could not fit: a region alone past the room
    # the bases leave.
    room = budget - sum(bases)
    if all(sum(actual for _, actual in regions) <= room // len(specs)
           for _, regions, _ in specs):
        assert all(m.error is None for m in members)


@settings(max_examples=20)
@given(DEVICE_MIXES, st.integers(500, 2500), st.sampled_from([0, 4000]))
def test_random_members_on_a_device_that_runs_out_end_and_fail_only_with_out_of_memory(
        specs, capacity, budget):
    # The device binds, not the budget (none, or one above the device):
    # members wait for each other's frees on the device. Every run ends,
    # the device never gives more than it has, a member fails only with out
    # of memory, and where every member's pass fits beside the others' at
    # once nothing fails.
    ledger = _C.ThreadAccounts()
    ledger.set_budget(budget)
    device = Device(ledger, capacity)
    members = [SimMember(ledger, 0, device) for _ in specs]
    plans = [[regions] * passes for regions, passes in specs]
    run_members(members, plans, timeout=60)
    assert device.used == 0
    for m, (_, passes) in zip(members, specs):
        if m.error is not None:
            assert isinstance(m.error, MemoryError), m.error
        else:
            assert m.passes == passes
    if sum(sum(actual for _, actual in regions) for regions, _ in specs) <= capacity:
        assert all(m.error is None for m in members)


def members_holding_state(budget: int, held: int, n: int = 2):
    """A ledger of ``budget`` bytes and ``n`` members, the first holding
    ``held`` bytes between its passes (a trained trial's optimizer state)."""
    ledger = _C.ThreadAccounts()
    ledger.set_budget(budget)
    ids = [ledger.open() for _ in range(n)]
    for i in ids:
        ledger.join(i, 0)
    _C.ThreadAccounts.set_thread(ids[0])
    ledger.allocate(next(_addresses), held)
    _C.ThreadAccounts.set_thread(0)
    return ledger, ids


def test_a_first_pass_that_needs_more_than_the_others_state_leaves_waits_for_a_leave():
    """A first pass to run alone whose kind was measured (``least``: what it
    rose) is not admitted with less room than that, though no pass is in
    flight; where draining the others' passes could not give it that room
    (their state holds it), it holds no one back: their passes go on. Once
    the member holding the state leaves and closes, it runs."""
    ledger, (a, b) = members_holding_state(1000, 600)
    assert ledger.room_beside_live(b) == 400
    assert ledger.gate(b, None, 0, 0, True, 0, None, 500) == TIMED_OUT  # 400 of 500
    for _ in range(8):  # a's passes, every one after b arrived, are not held back
        assert ledger.gate(a, 100, 100, 600, True, 0) == ADMITTED
    assert ledger.share_stats()["forced"] == 0
    ledger.leave(a)
    ledger.close(a)
    assert ledger.gate(b, None, 0, 0, True, 0, None, 500) == ADMITTED


def test_a_first_pass_whose_room_draining_gives_still_holds_the_others_back():
    """The same first pass where the room it needs is held by a pass in
    flight, not by state: the others' next passes wait, as for any first
    pass, so that the room drains to it."""
    ledger, (a, b) = members_holding_state(1000, 200)
    assert ledger.gate(a, 300, 300, 200, True, 0) == ADMITTED  # a's pass in flight
    activations = next(_addresses)
    _C.ThreadAccounts.set_thread(a)
    ledger.allocate(activations, 300)
    _C.ThreadAccounts.set_thread(0)
    assert ledger.gate(b, None, 0, 0, True, 0, None, 600) == TIMED_OUT  # a in a pass
    ledger.free(activations)  # a's pass ends
    assert ledger.gate(a, 100, 100, 200, True, 0) == TIMED_OUT  # b came first: a waits
    assert ledger.gate(b, None, 0, 0, True, 0, None, 600) == ADMITTED  # 800 of 600


def test_a_pass_only_a_leave_makes_room_for_does_not_hold_the_others_back_in_turn():
    """A predicted pass that waited while the others started more than
    their share of passes holds their next ones back, so that it gets its
    turn, but not where the others' state, not their passes, holds its
    room: holding them back could not give it, and every member would wait
    on it."""
    ledger, (a, b) = members_holding_state(1000, 600)
    assert ledger.gate(b, 500, 500, 500, True, 0) == TIMED_OUT  # 400 of 500 beside a's state
    for _ in range(12):
        assert ledger.gate(a, 100, 100, 600, True, 0) == ADMITTED
    stats = ledger.share_stats()
    assert stats["forced"] == stats["failed"] == 0



def test_a_borrowed_first_pass_waits_for_the_room_to_go_on_after_it():
    """A first pass asked from a measured one (rise 300) whose ``least``
    (what that pass rose and left held: 500) the room beside the others'
    state does not hold: its rise fits, but once its own state is made
    neither member could run its next pass, so it waits for a leave. It
    holds no one back meanwhile, and once the other leaves it runs."""
    ledger, (a, b) = members_holding_state(1000, 600)
    assert ledger.gate(b, 300, 300, 200, True, 0, None, 500) == TIMED_OUT  # 400 of 500
    for _ in range(12):  # a's passes, every one after b arrived, are not held back
        assert ledger.gate(a, 100, 100, 600, True, 0) == ADMITTED
    stats = ledger.share_stats()
    assert stats["forced"] == stats["failed"] == 0
    ledger.leave(a)
    ledger.close(a)
    assert ledger.gate(b, 300, 300, 200, True, 0, None, 500) == ADMITTED


def test_a_tie_at_boundaries_forces_a_pass_that_makes_no_new_state_first():
    """Every member waits at its boundary: a, holding state, asks a pass the
    room beside it does not hold; b, which came first, asks a first pass
    (``least``: the room to go on after it) that does not fit either. The
    tie forces a's pass, not b's: forced beside a's state, b's would make
    its own and leave neither room, and failing it would free only its
    model, where a's pass either runs or, failing, frees a's state."""
    ledger, (a, b) = members_holding_state(1000, 600)
    results = {}

    def at_gate(name, *args):
        results[name] = ledger.gate(*args)

    first = threading.Thread(target=at_gate, args=("b", b, 300, 300, 200, True, 1500, None, 500))
    first.start()
    time.sleep(0.2)  # b arrives first
    second = threading.Thread(target=at_gate, args=("a", a, 500, 500, 600, True, 1500))
    start_and_join([second], 10, "a's gate did not return")
    first.join(10)
    assert results == {"a": ADMITTED, "b": TIMED_OUT}
    assert ledger.share_stats()["forced"] == 1


def trial_making_state(ledger, id, activations, state, passes, least, outcome, admitted=None):
    """A trial on a thread of its own, as ``Member`` asks: its first pass
    allocates its activations, frees them and makes its optimizer's state
    (held until it ends); each next pass asks its activations beside it.
    ``least``: the room its first pass asks to go on after it (0: its kind
    unmeasured). At its end it frees its state, leaves and closes;
    ``admitted``: an event set once its first pass is."""
    _C.ThreadAccounts.set_thread(id)
    held = []
    try:
        while ledger.gate(id, None, 0, 0, True, 50, None, least) == TIMED_OUT:
            pass
        if admitted is not None:
            admitted.set()
        ptr = next(_addresses)
        ledger.allocate(ptr, activations)
        time.sleep(0.0005)
        ledger.free(ptr)
        held.append(next(_addresses))
        ledger.allocate(held[0], state)
        for _ in range(passes - 1):
            while ledger.gate(id, activations, activations, state, True, 50) == TIMED_OUT:
                pass
            ptr = next(_addresses)
            ledger.allocate(ptr, activations)
            time.sleep(0.0005)
            ledger.free(ptr)
        outcome[id] = "trained"
    except MemoryError as e:
        outcome[id] = e
    finally:
        for ptr in held:
            ledger.free(ptr)
        _C.ThreadAccounts.set_thread(0)
        ledger.leave(id)
        ledger.close(id)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(10, 100), st.integers(10, 200), st.integers(100, 400),
       st.integers(1, 6), st.data())
def test_trials_whose_state_fits_one_at_a_time_all_train(n, model, state, activations,
                                                          passes, data):
    """Trials of one model, every model held from the start (threads that
    build theirs before their blocks), under a budget holding every model
    and one trial's state and pass, perhaps more: the first trial's first
    pass runs alone, unmeasured; the others' ask room for what it rose
    (its activations, or its state where larger) and what it left held.
    None fails, whatever the timing, and the counted bytes never pass the
    budget: no trial makes its state where it would leave no trial room
    for a pass, and one after another would have trained them all."""
    activations = max(activations, state)  # the first pass rises to its activations
    fits = n * model + state + activations
    budget = data.draw(st.integers(fits, fits + 2 * (state + activations)), label="budget")
    ledger = _C.ThreadAccounts()
    ledger.set_budget(budget)
    ids = [ledger.open() for _ in range(n)]
    for i in ids:
        ledger.join(i, model)
    outcome, first = {}, threading.Event()
    threads = [threading.Thread(target=trial_making_state,
                                args=(ledger, i, activations, state, passes,
                                      0 if k == 0 else activations + state, outcome, first))
               for k, i in enumerate(ids)]
    threads[0].start()
    assert first.wait(10)  # the first trial's first pass, unmeasured, runs first
    start_and_join(threads[1:], 60, "the trials hung")
    threads[0].join(60)
    assert outcome == {i: "trained" for i in ids}
    assert ledger.share_stats()["peak"] <= budget
