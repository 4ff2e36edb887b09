"""waterwave.sharing's members on the CUDA runtime, against the fake driver
(tests/cpp/fake_cuda.c; see test_cuda_backend.py): an allocation the
device ran out for waits for another member's free, a tie among members
fails one alone, and a backward on PyTorch's autograd thread never waits.
"""
import threading

import pytest
from conftest import start_and_join
from test_cuda_backend import MiB, S1, S2, use, use_expandable

import waterwave as ww
import waterwave.cuda as wc
from waterwave import _C

def sharing_members(n):
    """``n`` accounts of the CUDA runtime's ledger, each a sharing member
    in its block (no budget: only the device can run out)."""
    ledger = _C.cuda_accounts()
    ids = [ledger.open() for _ in range(n)]
    for i in ids:
        ledger.join(i, 0)
    return ledger, ids


def allocating_member(account, nbytes, got) -> threading.Thread:
    """A thread started as member ``account``, allocating ``nbytes`` on S1:
    ``got`` receives the pointer or the error."""
    def allocate():
        _C.ThreadAccounts.set_thread(account)
        try:
            got.append(_C.cuda_malloc(nbytes, 0, S1))
        except Exception as e:  # noqa: BLE001 (the test reads it)
            got.append(e)
        finally:
            _C.ThreadAccounts.set_thread(0)

    t = threading.Thread(target=allocate)
    t.start()
    return t


def one_holding(fake, expandable=False):
    """Two members on a 64 MiB device (fixed or expandable segments), the
    first holding 40 MiB on S1: (ledger, (a, b), its pointer)."""
    if expandable:
        use_expandable(fake, "waterwave")
    else:
        use(fake)
    fake.fake_cuda_set_capacity(64 * MiB)
    ledger, (a, b) = sharing_members(2)
    _C.ThreadAccounts.set_thread(a)
    try:
        p = _C.cuda_malloc(40 * MiB, 0, S1)
    except BaseException:
        leave_all(ledger, (a, b))
        raise
    _C.ThreadAccounts.set_thread(0)
    return ledger, (a, b), p


def one_holds_the_other_waits(fake, got):
    """``one_holding``, and the second member's thread asking 40 MiB more,
    waiting for the device: (ledger, (a, b), pointer, waiting thread); on a
    failed check both leave."""
    ledger, (a, b), p = one_holding(fake)
    try:
        t = allocating_member(b, 40 * MiB, got)
        t.join(0.3)
        assert t.is_alive() and ledger.share_stats()["waiting"] == 1
    except BaseException:
        leave_all(ledger, (a, b))
        raise
    return ledger, (a, b), p, t


def leave_all(ledger, ids):
    _C.ThreadAccounts.set_thread(0)
    for i in ids:
        ledger.leave(i)
        ledger.close(i)


def each_holds_then_asks(ledger, ids, held, more, timeout=20):
    """Members ``ids``, each on a thread of its own (and a stream of its
    own), allocate ``held`` bytes, meet, then each ask ``more`` and give it
    back. Returns each one's error (None: it got the memory); every thread
    unwinds, freeing what it holds, and leaves."""
    errors, started = [None] * len(ids), threading.Barrier(len(ids))

    def member(k):
        stream = S1 if k else S2
        _C.ThreadAccounts.set_thread(ids[k])
        kept = _C.cuda_malloc(held, 0, stream)
        try:
            started.wait()
            _C.cuda_free(_C.cuda_malloc(more, 0, stream), more, 0, stream)
        except ww.OutOfMemoryError as e:
            errors[k] = e
        finally:
            _C.cuda_free(kept, held, 0, stream)
            _C.ThreadAccounts.set_thread(0)
            ledger.leave(ids[k])

    start_and_join([threading.Thread(target=member, args=(k,)) for k in range(len(ids))],
                   timeout, "members hung")
    return errors


def test_a_sharing_member_the_device_ran_out_for_waits_for_another_members_free(fake, policy):
    """Where the device itself has no room (here its whole capacity; on a
    GPU also a per-process cap, or a cache no member counts), a sharing
    member's allocation waits for another member's free and then goes
    through, instead of failing; a thread that is no member still fails at
    once."""
    use(fake, policy)
    fake.fake_cuda_set_capacity(64 * MiB)
    ledger, (a, b) = sharing_members(2)
    before = ledger.share_stats()  # the runtime's ledger lives as long as the process
    got = []
    try:
        _C.ThreadAccounts.set_thread(a)
        p = _C.cuda_malloc(40 * MiB, 0, S1)
        _C.ThreadAccounts.set_thread(0)
        with pytest.raises(ww.OutOfMemoryError):  # no member: the device's error, at once
            _C.cuda_malloc(40 * MiB, 0, S1)

        t = allocating_member(b, 40 * MiB, got)
        t.join(0.3)
        assert t.is_alive() and ledger.share_stats()["waiting"] == 1  # waits, not fails
        _C.cuda_free(p, 40 * MiB, 0, S1)
        t.join(5)
        assert not t.is_alive() and isinstance(got[0], int), got
        _C.cuda_free(got[0], 40 * MiB, 0, S1)
        stats = ledger.share_stats()
        assert stats["device_waits"] == before["device_waits"] + 1
        assert stats["waiting"] == 0 and stats["failed"] == before["failed"]
    finally:
        leave_all(ledger, (a, b))
    wc.check_invariants(0)


@pytest.mark.parametrize("segments", ["fixed", "expandable"])
def test_a_members_backward_the_device_ran_out_for_fails_at_once_saying_why(fake, segments):
    """A member's backward runs on PyTorch's autograd thread (untagged),
    known by the member's stream: shared by every member, it never waits,
    so where the device ran out it fails at once, and the error says whose
    backward it was and what to change: with fixed segments, expandable
    ones too (under a cap on an H200, four resnet18 trials lost one with
    fixed segments and trained with expandable ones). On another stream,
    or once the member left its block, the device's error is as it was."""
    ledger, (a, b), p = one_holding(fake, expandable=segments == "expandable")
    try:
        ledger.set_stream_account(S1, a)
        waiting_before = ledger.share_stats()["device_waits"]
        with pytest.raises(ww.OutOfMemoryError, match="sharing trial's backward") as e:
            _C.cuda_malloc(40 * MiB, 0, S1)
        assert "memory_limit" in str(e.value) and "autograd thread" in str(e.value)
        assert ("expandable_segments=True" in str(e.value)) == (segments == "fixed")
        assert ledger.share_stats()["device_waits"] == waiting_before  # it did not wait
        with pytest.raises(ww.OutOfMemoryError) as e:
            _C.cuda_malloc(40 * MiB, 0, S2)
        assert "backward" not in str(e.value)
        ledger.leave(a)
        with pytest.raises(ww.OutOfMemoryError) as e:
            _C.cuda_malloc(40 * MiB, 0, S1)
        assert "backward" not in str(e.value)
        _C.cuda_free(p, 40 * MiB, 0, S1)
    finally:
        ledger.set_stream_account(S1, 0)
        leave_all(ledger, (a, b))
    wc.check_invariants(0)


def test_a_member_waiting_for_the_device_when_training_is_interrupted_fails_saying_so(fake):
    """Ctrl-C while a member waits for the device: its allocation fails
    saying training was interrupted, and names no memory setting to change
    (nothing about the memory was wrong)."""
    got = []
    ledger, (a, b), p, t = one_holds_the_other_waits(fake, got)
    try:
        ledger.interrupt()
        t.join(5)
        assert not t.is_alive() and isinstance(got[0], ww.OutOfMemoryError), got
        assert "interrupted (Ctrl-C)" in str(got[0])
        assert "expandable" not in str(got[0]) and "memory_limit" not in str(got[0])
        _C.cuda_free(p, 40 * MiB, 0, S1)
    finally:
        leave_all(ledger, (a, b))
    wc.check_invariants(0)


def test_sharing_members_all_waiting_for_the_device_fail_one_alone(fake):
    """Two members each hold memory and ask for more than the device has
    left: one fails with the device's out of memory and why, unwinds, and
    the other then gets its memory. Never a hang."""
    use(fake)
    fake.fake_cuda_set_capacity(64 * MiB)
    ledger, ids = sharing_members(2)
    failed_before = ledger.share_stats()["failed"]
    try:
        errors = each_holds_then_asks(ledger, ids, 28 * MiB, 20 * MiB)  # 96 MiB of 64
        failed = [e for e in errors if e is not None]
        assert len(failed) == 1, errors
        assert "out of memory" in str(failed[0])
        assert "every trial sharing the device was waiting for another's memory" in str(failed[0])
        assert "expandable_segments=True" in str(failed[0])  # the fixed segments' fix
        assert ledger.share_stats()["failed"] == failed_before + 1
    finally:
        leave_all(ledger, ids)
    fake.fake_cuda_complete_all()
    wc.check_invariants(0)


def test_a_member_whose_retry_fails_otherwise_waits_no_more(fake):
    """A member waiting on the device whose retry meets another error (the
    driver's) gets that error, and counts as waiting no more: the members'
    tie-break must not take a running thread for a stuck one."""
    got = []
    ledger, (a, b), p, t = one_holds_the_other_waits(fake, got)
    try:
        fake.fake_cuda_fail_next_alloc(700)  # its next try meets the driver's error
        t.join(5)
        assert not t.is_alive()
        assert isinstance(got[0], RuntimeError) and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(got[0])
        assert ledger.share_stats()["waiting"] == 0
        _C.cuda_free(p, 40 * MiB, 0, S1)
    finally:
        leave_all(ledger, (a, b))
    wc.check_invariants(0)


@pytest.mark.parametrize("capacity_mib,fails", [(128, 0), (40, 1)])
def test_past_a_measured_budget_a_tie_asks_the_device(fake, capacity_mib, fails):
    """A GPU session with no memory_limit measures its budget (95% of what
    the allocator could give): where every member waits past it, one
    allocation goes on to the device instead of failing. With the room
    there (128 MiB) both members get their memory; without it (40 MiB) the
    device refuses, the refused members wait for each other, and one fails
    with the device's error, never the budget's. Never a hang."""
    use(fake)
    fake.fake_cuda_set_capacity(capacity_mib * MiB)
    ledger, ids = sharing_members(2)
    before = ledger.share_stats()
    ledger.set_budget(38 * MiB, measured=True)
    try:
        errors = each_holds_then_asks(ledger, ids, 16 * MiB, 16 * MiB)  # 64 MiB past 38
        failed = [e for e in errors if e is not None]
        assert len(failed) == fails, errors
        for e in failed:
            assert "every trial sharing the device was waiting for another's memory" in str(e)
            assert "memory_limit=" not in str(e)
        after = ledger.share_stats()
        assert after["overdrawn"] > before["overdrawn"]
        assert after["failed"] - before["failed"] == fails
    finally:
        ledger.set_budget(0, 0)
        leave_all(ledger, ids)
    fake.fake_cuda_complete_all()
    wc.check_invariants(0)
