"""A GPU session's budget without a memory_limit: what the allocator can
still give, measured when a block starts and when a member's pass does,
beside members that allocate meanwhile. The allocator is a patched
MemoryProbe: no GPU is needed.
"""
import time

import waterwave as ww


def patch_probe(monkeypatch, free: list, during: list = ()) -> type:
    """The session's MemoryProbe replaced: what the allocator can still give
    is ``free[0]``, read after each of ``during`` runs (what members do
    meanwhile). Returns the class."""
    import waterwave.exec.session as session_module

    class Probe:
        def __init__(self, device):
            pass

        def available(self):
            for act in during:
                act()
            return free[0]

    monkeypatch.setattr(session_module, "MemoryProbe", Probe)
    return Probe


def test_a_gpu_session_without_a_limit_probes_what_is_free_at_every_block_start(monkeypatch):
    """On a GPU with no memory_limit, the members' budget is what the
    allocator can still give plus what the members hold. It is probed again
    whenever a block starts, not only when the first does: memory a thread
    took outside every block since (a new trial's model and data on the
    GPU) is in no account, and a budget probed before it would count it as
    free, so that the allocator, not the gates, ran out (4 resnet50 trials
    under a 12 GiB cap on an H200 lost 3 of 8 trials that way). The joining
    member's model is counted once, in the ledger."""
    import types

    from waterwave.alloc.thread_account import ThreadAccount
    from waterwave.pipeline.pass_profile import GPU_MARGIN

    MiB = 1 << 20
    free = [100 * MiB]
    patch_probe(monkeypatch, free)
    session = ww.TrainingSession("cuda:0")
    ledger = session.ledger()
    members = [types.SimpleNamespace(account=ThreadAccount(ledger), name=f"trial {k}")
               for k in range(2)]
    try:
        first = session.join_sharing(members[0], 4 * MiB)
        assert first == int((100 + 4) * MiB * (1 - GPU_MARGIN))
        free[0] = 60 * MiB  # another trial built its model (8 MiB) and data (32 MiB)
        second = session.join_sharing(members[1], 8 * MiB)
        assert second == int((60 + 4 + 8) * MiB * (1 - GPU_MARGIN))
        assert ledger.share_stats()["budget"] == second
        assert session.stats()["budget"] == (60 + 4 + 8) * MiB
    finally:
        for member in members:
            session.leave_sharing(member)
            member.account.close()


def test_a_gpu_probe_collects_garbage_at_most_every_few_seconds(monkeypatch):
    """Probing a GPU's free memory first collects reference cycles (a
    finished trial's job can sit in one), but a full collection costs
    0.2-0.4 s in a process holding torch and sharing probes at every
    block's start: it collects at the first probe, then at most every
    COLLECT_EVERY_S seconds."""
    import waterwave.exec.session as session_module

    collected = []
    monkeypatch.setattr(session_module.gc, "collect", lambda: collected.append(1))

    class Probe:
        def available(self):
            return 1 << 20

    session = ww.TrainingSession("cuda:0")
    assert session._probe_capacity(Probe()) == 1 << 20
    assert session._probe_capacity(Probe()) == 1 << 20
    assert len(collected) == 1
    session._collected_at -= session_module.COLLECT_EVERY_S
    session._probe_capacity(Probe())
    assert len(collected) == 2


def test_a_gpu_session_without_a_limit_probes_again_when_a_pass_starts(monkeypatch):
    """Memory taken outside every block while members train (a new trial's
    model and data) shrinks the members' budget at the next pass's start,
    not only at the next block's: probed at block starts alone, 4 resnet50
    trials under a 12 GiB cap on an H200 lost 4 of 8 to the allocator. A
    pass's probe collects no garbage (the member waits for it), and a
    session with a memory_limit keeps its budget. A measured budget is
    marked so: a tie among members past it asks the device rather than
    failing an allocation; the user's limit is kept."""
    import types

    import waterwave.exec.session as session_module
    from waterwave.alloc.thread_account import ThreadAccount
    from waterwave.pipeline.pass_profile import GPU_MARGIN

    MiB = 1 << 20
    free = [100 * MiB]
    collected = []
    monkeypatch.setattr(session_module.gc, "collect", lambda: collected.append(1))
    patch_probe(monkeypatch, free)
    session = ww.TrainingSession("cuda:0")
    ledger = session.ledger()
    member = types.SimpleNamespace(account=ThreadAccount(ledger), name="trial 0")
    monkeypatch.setattr(session_module, "PASS_PROBE_EVERY_S", 0.0)  # every pass here
    try:
        session.join_sharing(member, 4 * MiB)
        assert len(collected) == 1
        free[0] = 40 * MiB  # another trial's model and data, outside every block
        session.probe_sharing_budget()
        assert ledger.share_stats()["budget"] == int((40 + 4) * MiB * (1 - GPU_MARGIN))
        assert ledger.share_stats()["measured"]  # a tie asks the device (shared_budget.cpp)
        assert session.stats()["budget"] == (40 + 4) * MiB
        session._collected_at -= session_module.COLLECT_EVERY_S
        session.probe_sharing_budget()
        assert len(collected) == 1
        session.leave_sharing(member)
        session.configure(memory_limit=64 * MiB)
        session.join_sharing(member, 4 * MiB)
        free[0] = 10 * MiB
        session.probe_sharing_budget()
        assert ledger.share_stats()["budget"] == int(64 * MiB * (1 - GPU_MARGIN))
        assert not ledger.share_stats()["measured"]  # the user's: a tie fails an allocation
    finally:
        session.leave_sharing(member)
        member.account.close()


def test_passes_measure_the_gpu_budget_at_most_every_few_milliseconds(monkeypatch):
    """A measure costs about 30 us of Python: passes take one at most every
    PASS_PROBE_EVERY_S, where a block's start always takes one."""
    import types

    import waterwave.exec.session as session_module
    from waterwave.alloc.thread_account import ThreadAccount

    MiB = 1 << 20
    free = [100 * MiB]
    patch_probe(monkeypatch, free)
    monkeypatch.setattr(session_module, "PASS_PROBE_EVERY_S", 3600.0)
    session = ww.TrainingSession("cuda:0")
    member = types.SimpleNamespace(account=ThreadAccount(session.ledger()), name="trial 0")
    try:
        session._pass_probed_at = time.monotonic()  # a pass measured just now
        session.join_sharing(member, 4 * MiB)  # a block's start measures all the same
        assert session.stats()["budget"] == (100 + 4) * MiB
        free[0] = 40 * MiB
        session.probe_sharing_budget()  # too soon after the last pass's
        assert session.stats()["budget"] == (100 + 4) * MiB
        session._pass_probed_at -= 3600.0
        session.probe_sharing_budget()
        assert session.stats()["budget"] == (40 + 4) * MiB
    finally:
        session.leave_sharing(member)
        member.account.close()


def test_a_probe_beside_members_allocating_and_freeing_errs_small(monkeypatch):
    """The members' bytes are read before and after what the allocator can
    still give, the fewer kept: a member's allocation while the probe reads
    leaves the budget smaller than the truth by that allocation, a free
    leaves it exact; neither makes it larger (the room the others would
    then be admitted into would not be there)."""
    import types

    from waterwave.alloc.thread_account import ThreadAccount

    MiB = 1 << 20
    free = [100 * MiB]
    during = []  # what a member does while the allocator is read
    Probe = patch_probe(monkeypatch, free, during)
    session = ww.TrainingSession("cuda:0")
    ledger = session.ledger()
    member = types.SimpleNamespace(account=ThreadAccount(ledger), name="trial 0")
    try:
        session.join_sharing(member, 0)
        ledger.count(member.account.id, 0x1000, 10 * MiB)  # its activations so far
        truth = 100 * MiB + 10 * MiB

        def allocate():  # 20 MiB more: the allocator's room shrinks by as much
            ledger.count(member.account.id, 0x2000, 20 * MiB)
            free[0] -= 20 * MiB
        during[:] = [allocate]
        assert session._probe_capacity(Probe(None), collect=False) == truth - 20 * MiB

        def release():  # the 20 MiB back
            ledger.free(0x2000)
            free[0] += 20 * MiB
        during[:] = [release]
        assert session._probe_capacity(Probe(None), collect=False) == truth
        during.clear()
        assert session._probe_capacity(Probe(None), collect=False) == truth
    finally:
        ledger.free(0x1000)
        session.leave_sharing(member)
        member.account.close()


def test_a_job_made_on_the_gpu_counts_as_taken_until_it_first_trains(monkeypatch):
    """A new trial's model and batches land on the GPU before its job
    trains, and its capture takes seconds in between: the session counts
    them as taken from the job's making (``job_made``), beside the jobs
    and members training, and adds them back when it measures what is free
    (the allocator no longer has them), so a budget measured before or
    after they landed is the same. Once the job trains it counts as the
    session's job; a job dropped untrained leaves with its bytes."""
    import gc
    import types

    from waterwave.alloc.thread_account import ThreadAccount
    from waterwave.exec import awaiting_jobs
    from waterwave.pipeline.pass_profile import GPU_MARGIN

    MiB = 1 << 20
    free = [100 * MiB]
    patch_probe(monkeypatch, free)
    session = ww.TrainingSession("cuda:0")
    ledger = session.ledger()
    member = types.SimpleNamespace(account=ThreadAccount(ledger), name="trial 0")

    class NewJob:  # what the registry keeps of a Job: a weak reference
        pass

    try:
        session.join_sharing(member, 4 * MiB)  # the members share 104 MiB
        assert ledger.share_stats()["budget"] == int(104 * MiB * (1 - GPU_MARGIN))
        job = NewJob()
        free[0] -= 30 * MiB  # its model and batches land...
        session.job_made(job, 30 * MiB)  # ...and count as taken beside the members
        assert ledger.share_stats()["outside"] == 30 * MiB
        assert awaiting_jobs.held_on("cuda:0") == 30 * MiB
        assert awaiting_jobs.held_on("cuda:1") == 0
        session.probe_sharing_budget()  # measured after they landed: the same budget
        assert session.stats()["budget"] == 104 * MiB
        assert ledger.share_stats()["outside"] == 30 * MiB
        awaiting_jobs.trained(job)  # its own figures count from here (PipelinedJob)
        assert awaiting_jobs.held_on("cuda:0") == 0
        other = NewJob()
        session.job_made(other, 8 * MiB)
        del other
        gc.collect()
        assert awaiting_jobs.held_on("cuda:0") == 0  # dropped untrained
    finally:
        session.leave_sharing(member)
        member.account.close()


def test_what_a_job_holds_on_its_device_before_it_trains():
    """``Job.bytes_on_device``: its parameters and buffers, each storage once
    (tied weights), and its batches already there less the largest, which
    its step counts as its input."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied: one storage, counted once
    data = [(torch.randn(4, 8), torch.randint(0, 8, (4,))) for _ in range(3)]
    job = ww.Job(model, loss_fn=F.cross_entropy,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data)
    params = (8 * 8 + 8 + 8) * 4 + (8 + 8 + 8 + 8) * 4 + 8  # weights, biases; BatchNorm's
    batch = 4 * 8 * 4 + 4 * 8
    assert job.bytes_on_device() == params + 2 * batch
