"""What a job holds between its train() calls (waterwave/exec/between_calls.py):
the room a training session keeps for a job's evaluation beside the jobs
still training, and the thread accounts that measure it on a GPU
(csrc/runtime/thread_accounts.h), here over the fake CUDA driver.
"""
import gc
import threading

import pytest
from test_cuda_backend import use
from test_session import mlp_job, run_in_threads

import waterwave as ww
from waterwave import _C
from waterwave.alloc.thread_account import ThreadAccount
from waterwave.exec.between_calls import BetweenCalls
from waterwave.pipeline.pairing import MemoryPairing, rises_from

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")

MiB = 1 << 20


# Thread accounts -----------------------------------------------------------

def test_an_account_counts_what_its_thread_allocates_wherever_it_is_freed(fake):
    use(fake)
    account = ThreadAccount()
    assert account.tag() == 0
    a = _C.cuda_malloc(3 * MiB, 0, 0)
    b = _C.cuda_malloc(1000, 0, 0)  # counted as the allocator's block: 1024 bytes
    assert account.usage() == (3 * MiB + 1024, 3 * MiB + 1024)
    other = []
    t = threading.Thread(target=lambda: other.append(_C.cuda_malloc(5 * MiB, 0, 0)))
    t.start(), t.join()
    assert account.usage()[0] == 3 * MiB + 1024  # another thread's block is not its
    t = threading.Thread(target=lambda: _C.cuda_free(a, 0, 0, 0))  # freed elsewhere: counted off
    t.start(), t.join()
    assert account.usage() == (1024, 3 * MiB + 1024)
    account.reset_peak()
    assert account.usage() == (1024, 1024)
    assert ThreadAccount.untag() == account.id
    c = _C.cuda_malloc(MiB, 0, 0)  # untagged: not counted
    assert account.usage() == (1024, 1024)
    for p in (b, c, other[0]):
        _C.cuda_free(p, 0, 0, 0)
    assert account.usage() == (0, 1024)
    account.close()
    with pytest.raises(ww.ConfigError, match="not open"):
        account.usage()


def test_a_closed_account_counts_nothing_and_frees_stay_safe(fake):
    use(fake)
    account = ThreadAccount()
    account.tag()
    p = _C.cuda_malloc(MiB, 0, 0)
    account.close()
    q = _C.cuda_malloc(MiB, 0, 0)  # the thread still carries the closed id
    ThreadAccount.untag()
    for ptr in (p, q):
        _C.cuda_free(ptr, 0, 0, 0)
    with pytest.raises(ww.ConfigError, match="not open"):
        account.reset_peak()


def test_accounts_under_threads_allocating_and_freeing_each_others_blocks(fake):
    """Eight threads, each tagged with its own account, allocate and free
    blocks in random order, half of them freed by another thread: every
    account ends at zero, and each one's peak is at least its largest block."""
    use(fake)
    accounts = [ThreadAccount() for _ in range(8)]
    handed = [[] for _ in accounts]
    lock = threading.Lock()

    def work(k):
        import random
        rng = random.Random(k)
        accounts[k].tag()
        mine, biggest = [], 0
        for _ in range(300):
            if mine and rng.random() < 0.45:
                _C.cuda_free(mine.pop(rng.randrange(len(mine))), 0, 0, 0)
            else:
                size = rng.choice([512, 4096, 1 << 20, 3 << 20])
                mine.append(_C.cuda_malloc(size, 0, 0))
                biggest = max(biggest, size)
            with lock:  # take one of another thread's blocks now and then
                theirs = handed[(k + 1) % len(handed)]
                if theirs and rng.random() < 0.2:
                    _C.cuda_free(theirs.pop(), 0, 0, 0)
            if mine and rng.random() < 0.2:
                with lock:
                    handed[k].append(mine.pop())
        for p in mine:
            _C.cuda_free(p, 0, 0, 0)
        ThreadAccount.untag()
        return biggest

    biggest = run_in_threads([lambda k=k: work(k) for k in range(len(accounts))])
    for rest in handed:
        for p in rest:
            _C.cuda_free(p, 0, 0, 0)
    for account, big in zip(accounts, biggest):
        assert not isinstance(big, BaseException), big
        allocated, peak = account.usage()
        assert allocated == 0 and peak >= big
    ww.cuda.check_invariants(0)


# The room kept between calls -------------------------------------------------

def test_the_reserve_is_the_setting_else_the_measured_rise_else_the_steps_peak():
    groups = [(100, 150), (50, 50), (-150, 0)]
    assert BetweenCalls().reserve(groups) == rises_from(groups)[0] == 150
    assert BetweenCalls(evaluation_memory=7).reserve(groups) == 7
    measured = BetweenCalls()
    measured.rise = 30
    assert measured.reserve(groups) == 30
    with pytest.raises(ValueError, match="evaluation_memory must be a whole number of bytes"):
        BetweenCalls(evaluation_memory=-1)
    with pytest.raises(ValueError, match="evaluation_memory"):
        mlp_job(0, evaluation_memory=1.5)


def outside_seen(monkeypatch):
    """Every ``outside`` the session gives its pairing, in order."""
    seen = []
    original = MemoryPairing.set_limit

    def spy(self, memory_limit, outside=None):
        seen.append(outside)
        return original(self, memory_limit, outside)

    monkeypatch.setattr(MemoryPairing, "set_limit", spy)
    return seen


def joined_plans(monkeypatch):
    """Every plan the session joins its pairing with, in order."""
    plans = []
    original = MemoryPairing.join

    def spy(self, plan, steps, solo_first=False):
        plans.append(plan)
        return original(self, plan, steps, solo_first)

    monkeypatch.setattr(MemoryPairing, "join", spy)
    return plans


def test_a_job_between_calls_keeps_room_for_its_evaluation(monkeypatch):
    """While one job evaluates between calls, the others train under the
    budget less its persistent bytes and its evaluation's room: its
    ``evaluation_memory`` when set, else its step's own peak."""
    # Tensors an earlier test's failed trial left in reference cycles are
    # still some member's bytes in the CPU ledger until collected.
    gc.collect()
    session = ww.TrainingSession("cpu", memory_limit=64 << 20, capture=True)
    a, b = mlp_job(1, evaluation_memory=123_456), mlp_job(2)
    a.train(1, session=session)
    held_a = session.member(a).plan.persistent + 123_456
    assert session.stats()["held_between_calls"] == held_a
    seen = outside_seen(monkeypatch)
    b.train(2, session=session)
    assert seen and set(seen) == {held_a}
    peak_b = rises_from(session.member(b).plan.groups)[0]
    assert session.stats()["held_between_calls"] == held_a + session.member(b).plan.persistent + peak_b


def test_each_call_plans_the_jobs_evaluation_room_past_its_last_group(monkeypatch):
    """Each call joins the pairing with the room the job's evaluation takes
    once the call's steps end (``JobPlan.after``), which the pairing holds
    from the job's last group on (tests/test_concurrent.py's property test)."""
    session = ww.TrainingSession("cpu", memory_limit=64 << 20, capture=True)
    a, b = mlp_job(1, evaluation_memory=5 * MiB), mlp_job(2)
    plans = joined_plans(monkeypatch)
    a.train(2, session=session)
    b.train(3, session=session)
    assert [p.after for p in plans] == [5 * MiB, rises_from(session.member(b).plan.groups)[0]]
    assert rises_from(session.member(b).plan.groups)[0] > 0


def test_measured_between_calls_on_the_job_thread_only(fake, monkeypatch):
    """On a GPU under Waterwave (here: the fake driver, the job on the CPU
    with measuring switched on) the job's thread is tagged from the end of
    one call to the start of the next: its evaluation's rise becomes the
    room kept, tensors it keeps count as persistent in the next call, and
    other threads' allocations meanwhile are not its."""
    use(fake)
    monkeypatch.setattr(BetweenCalls, "measurable", staticmethod(lambda on_cuda: True))
    session = ww.TrainingSession("cpu", memory_limit=1 << 30, capture=True)
    job = mlp_job(3)
    job.train(1, session=session)
    assert job.between.rise is None  # nothing measured yet: the step's peak is kept
    kept = _C.cuda_malloc(4 * MiB, 0, 0)     # a metric kept on the device
    scratch = _C.cuda_malloc(2 * MiB, 0, 0)  # evaluation's activations, freed
    _C.cuda_free(scratch, 0, 0, 0)
    other = []
    t = threading.Thread(target=lambda: other.append(_C.cuda_malloc(8 * MiB, 0, 0)))
    t.start(), t.join()
    plans = joined_plans(monkeypatch)
    job.train(1, session=session)
    assert job.between.rise == 6 * MiB and job.between.kept == 4 * MiB
    assert plans[-1].after == 6 * MiB
    assert plans[-1].persistent == session.member(job).plan.persistent + 4 * MiB
    inside = _C.cuda_malloc(MiB, 0, 0)  # made by the caller after train(): counted again
    for p in (kept, inside, other[0]):
        _C.cuda_free(p, 0, 0, 0)
    job.train(1, session=session)  # an interval that fell to nothing keeps the most seen
    assert job.between.rise == 6 * MiB and job.between.kept == 0
    ThreadAccount.untag()


def test_a_zero_byte_allocation_on_a_tagged_thread_is_not_looked_up(fake):
    """cuDNN asks for 0-byte workspaces, which the allocator answers with a
    null pointer: a tagged thread must not look that pointer up (on an H200
    every evaluation between calls failed with 'unknown pointer 0x0')."""
    use(fake)
    account = ThreadAccount()
    account.tag()
    try:
        assert _C.cuda_malloc(0, 0, 0) == 0
        assert account.usage() == (0, 0)
        _C.cuda_free(0, 0, 0, 0)
        p = _C.cuda_malloc(MiB, 0, 0)
        assert account.usage() == (MiB, MiB)
        _C.cuda_free(p, 0, 0, 0)
    finally:
        ThreadAccount.untag()
        account.close()


def test_an_untagged_threads_allocations_on_a_members_stream_count_to_it(fake):
    # PyTorch runs a CUDA backward on its own device thread: a sharing
    # member's backward is counted by its stream, and never waits.
    use(fake)
    ledger = _C.cuda_accounts()
    account = ThreadAccount(ledger)
    ledger.set_stream_account(7, account.id)
    got = []
    t = threading.Thread(target=lambda: got.append(_C.cuda_malloc(MiB, 0, 7)))
    t.start(), t.join()
    other = _C.cuda_malloc(MiB, 0, 8)  # another stream: not its
    assert account.usage() == (MiB, MiB)
    ledger.join(account.id, 0)
    ledger.set_budget(MiB // 2)  # past the budget already: a stream's allocation still goes on
    t = threading.Thread(target=lambda: got.append(_C.cuda_malloc(MiB, 0, 7)))
    t.start(), t.join()
    assert account.usage()[0] == 2 * MiB
    ledger.set_budget(0)
    ledger.leave(account.id)
    ledger.set_stream_account(7, 0)
    for p in (*got, other):
        _C.cuda_free(p, 0, 0, 0)
    assert account.usage()[0] == 0
    account.close()
