"""A session with a budget that captures nothing (``capture=False``, the
default) trains each ``Job``'s steps eagerly, each call one
``waterwave.sharing`` block: the job's memory is counted and gated with the
other members' under the budget, and its results are its eager loop's
because it is its eager loop (issue 41: captured steps trained an Optuna
search at half the rate of eager members on an H200). Gradients are freed
after each step, as a captured step leaves them; a model no capture can
take trains; a budget too small fails the job with the budget named; a
failing job stops alone; a capturing session still pipelines. (Ctrl-C and
batches of every shape: test_unplanned_steps.py, with and without a
budget.)"""
import threading
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from conftest import PLANNING_LIMIT, assert_same_optimizer_state, start_and_join  # noqa: E402
from test_unplanned_steps import (OPTIMIZERS, Branches, assert_same_model, batches,  # noqa: E402
                                  eager, loss_fn, net)

import waterwave as ww  # noqa: E402


@dataclass
class Peek:
    """A step scheduler that calls ``look`` after each step."""
    optimizer: object
    look: object

    def step(self):
        self.look()


@pytest.fixture
def shared():
    """A CPU session with a budget that captures nothing."""
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT)
    assert session.plans and not session.captures and not session.capture
    return session


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_jobs_under_a_budget_train_side_by_side_as_sharing_members_each_as_its_eager_loop(
        shared, optimizer):
    n = 4
    models = [net(20 + k) for k in range(n)]
    references = [net(20 + k) for k in range(n)]
    data = [batches(seed=20 + k) for k in range(n)]
    jobs, seen = [], []
    for k, (model, d) in enumerate(zip(models, data)):
        opt = OPTIMIZERS[optimizer](model)
        # Job 0's steps see the session: it is a sharing member while it trains
        peek = [Peek(opt, lambda: seen.append((shared.stats()["sharing"], shared.training)))
                ] if k == 0 else []
        jobs.append(ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=d, name=f"trial {k}",
                           step_schedulers=peek))
    assert not any(job.captured for job in jobs)  # made under a session that captures nothing
    got = [None] * n

    def train(k):
        got[k] = jobs[k].train(4, session=shared)
        got[k] += jobs[k].train(3, session=shared)

    start_and_join([threading.Thread(target=train, args=(k,)) for k in range(n)], 60,
                   "a shared job hung")
    for k in range(n):
        ref_opt = OPTIMIZERS[optimizer](references[k])
        assert got[k] == eager(references[k], ref_opt, data[k], 7)  # bit for bit
        assert_same_model(references[k], models[k])
        assert_same_optimizer_state(ref_opt, jobs[k].optimizer)
        assert all(p.grad is None for p in models[k].parameters())  # freed after each step
        assert jobs[k].stats() == {"steps": 7, "eager_steps": 7, "captures": 0}
    stats = shared.stats()
    assert stats["capture"] is False and stats["steps_run"] == 7 * n
    assert stats["peak_bytes"] > 0  # the members' memory was counted
    assert len(seen) == 7 and all("trial 0" in names for names, _ in seen)
    # Each training job listed once, as itself, not again as a member's name
    assert all(jobs[0] in training and "trial 0" not in training for _, training in seen)
    assert 1 <= shared.most_training <= n  # each job counted once, not as a job and a member
    assert shared.training == [] and stats["sharing"] == []


def test_a_plain_job_tells_its_member_of_its_steps_and_hooks_no_optimizer(shared, monkeypatch):
    """``job.train``'s usual step (``Job.steps_plain``) calls the model and
    steps the optimizer itself: its block (``job_sharing``) puts no forward
    pre-hook on the model, which would take torch's slower call path, and
    registers no global optimizer hook, which every optimizer's step in the
    process would run. The job tells its member instead: each call of the
    model begins a pass (the member's ``boundary``), and the step still is a
    point of the member's measured first pass. A job of other settings
    (accumulation) keeps the hooks. (Its step comes in the second batch's
    pass, predicted from the first: no point there.)"""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from waterwave.exec.sharing import Member, _members

    told = []
    real = Member.optimizer_step
    monkeypatch.setattr(Member, "optimizer_step", lambda self: (told.append(1), real(self))[1])
    hooks_seen = []

    def loss(output, target):
        hooks_seen.append((len(_global_optimizer_pre_hooks), len(model._forward_pre_hooks)))
        return loss_fn(output, target)

    for settings, hooks, points, passes in (({}, 0, True, 2),
                                            ({"accumulate_grad_batches": 2}, 1, False, 4)):
        told.clear()
        hooks_seen.clear()
        model = net(5)
        job = ww.Job(model, loss_fn=loss, optimizer=OPTIMIZERS["sgd"](model),
                     data=batches(n=4, seed=5), **settings)
        assert job.steps_plain == (not settings)
        job.train(2, session=shared)
        assert set(hooks_seen) == {(hooks, hooks)}, settings
        assert bool(told) == points, settings  # the measured first pass's step point
        assert _members[model].passes == passes, settings  # a pass at each call of the model
        assert not _global_optimizer_pre_hooks and not model._forward_pre_hooks  # none left


def test_a_jobs_calls_go_on_from_its_steady_pass(shared, monkeypatch):
    """A steady pass one ``job.train`` call leaves open goes on into the
    next, whose block asks at its start what that pass asked and has no
    pass of its own before the model's first call (``BLOCK_START``: the
    job allocates nothing there but its batch, as each step does): once
    its passes are learned, every step of a call, the first too, takes the
    C++ steady path and none starts a pass in the member's Python. A
    ``ww.sharing`` block of the user's own in between (an evaluation) ends
    that pass, and the next call starts afresh, from a block-start pass.
    The losses stay the eager loop's."""
    from waterwave.exec.sharing import BLOCK_START, Member, _members

    started = []
    real = Member._start_pass
    monkeypatch.setattr(Member, "_start_pass",
                        lambda self, signature, *a: (started.append(signature),
                                                     real(self, signature, *a))[1])
    model, reference = net(6), net(6)
    data = batches(n=4, seed=6)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=data)
    for _ in range(6):  # its passes measured, then learned
        job.train(4, session=shared)
    assert started[0] == BLOCK_START and started.count(BLOCK_START) < 6
    member = _members[model]
    started.clear()
    job.train(4, session=shared)
    job.train(4, session=shared)
    assert started == [] and member._steady is not None  # each step steady, across calls
    with ww.sharing(model, shared), torch.no_grad():  # the user's evaluation
        model(data[0][0])
    assert member._steady is None
    started.clear()
    job.train(4, session=shared)
    assert started[0] == BLOCK_START
    assert job.losses == eager(reference, OPTIMIZERS["sgd"](reference), data, steps=36)


def test_a_model_no_capture_can_take_trains_under_a_budget(shared):
    data = batches(n=4, seed=2)
    model, reference = Branches(), Branches()
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    got = job.train(4, session=shared)
    assert got == eager(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data, 4)
    assert not job.captured


def test_a_budget_below_a_step_fails_the_job_naming_the_budget():
    model = net(3)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=batches())
    session = ww.TrainingSession("cpu", memory_limit=1)
    with pytest.raises(torch.OutOfMemoryError, match="memory_limit=1 bytes"):
        job.train(1, session=session)
    assert job.failed and session.training == [] and session.stats()["sharing"] == []


def test_a_failed_job_gives_its_memory_back_when_its_trial_drops_it():
    """A job that failed under the budget keeps its error, not the frames
    that raised it: they hold the job, its model and its optimizer, and
    that cycle kept a failed trial's memory, counted against every other
    trial's budget, until Python's cycle collector ran (four trials under
    a budget that fits two all failed). Dropped by its trial, the job goes
    at once, cycle collector off."""
    import gc
    import weakref

    OPTIMIZERS["sgd"](net(0))  # the process's first optimizer stays in torch's import frames
    session = ww.TrainingSession("cpu", memory_limit=1 << 20)
    before = session.ledger().share_stats()["members_live"]  # the process's CPU ledger
    held = {}

    def trial():  # as an Optuna objective: the model is made inside, dropped at the end
        model = net(3)
        job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model),
                     data=batches(rows=4096))
        held.update(model=weakref.ref(model), job=weakref.ref(job))
        try:
            job.train(2, session=session)
        except torch.OutOfMemoryError as e:
            held["error"] = e
            assert job.failed and isinstance(job.error, torch.OutOfMemoryError)
            assert str(job.error) == str(e) and job.error.__traceback__ is None
            with pytest.raises(RuntimeError, match="failed earlier"):
                job.train(1, session=session)

    gc.disable()
    try:
        trial()
        assert "error" in held, "the step fitted the budget: the test needs one it does not"
        held.pop("error")
        assert held["job"]() is None and held["model"]() is None
        assert session.ledger().share_stats()["members_live"] == before
    finally:
        gc.enable()


def test_capture_is_a_setting_checked_and_changed_between_trainings():
    with pytest.raises(ValueError, match="capture must be True .* or False"):
        ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture="yes")
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT)
    model = net(5)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=batches())
    job.train(2, session=session)
    assert not job.captured and session.most_training == 1  # a job, not a job and a member
    session.configure(capture=True)
    assert session.captures and "capture=True" in repr(session)
    job.train(2, session=session)  # now captured, planned and pipelined
    assert job.captured and job.stats()["eager_steps"] == 2
    assert ww.TrainingSession("cpu", capture=True).captures is False  # nothing to plan for


def test_a_shared_job_that_fails_stops_alone_and_the_others_train_on(shared):
    good_model, reference = net(30), net(30)
    good = ww.Job(good_model, loss_fn=loss_fn, optimizer=OPTIMIZERS["adam"](good_model),
                  data=batches(seed=30))
    bad_model = net(31)
    bad_data = batches(n=2, seed=31) + [(torch.randn(8, 5), torch.randint(0, 4, (8,)))]
    bad = ww.Job(bad_model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](bad_model),
                 data=bad_data)  # its third batch is the wrong width
    got = {}

    def train(name, job, steps):
        try:
            got[name] = job.train(steps, session=shared)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            got[name] = e

    start_and_join([threading.Thread(target=train, args=("good", good, 12)),
                    threading.Thread(target=train, args=("bad", bad, 6))], 60,
                   "a shared job hung beside a failing one")
    assert isinstance(got["bad"], RuntimeError) and bad.failed
    bad_reference = net(31)
    assert bad.losses == eager(bad_reference, OPTIMIZERS["sgd"](bad_reference), bad_data, 2)
    assert got["good"] == eager(reference, OPTIMIZERS["adam"](reference), batches(seed=30), 12)
    assert not good.failed and shared.training == [] and shared.stats()["sharing"] == []
    with pytest.raises(RuntimeError, match="failed earlier"):
        bad.train(1, session=shared)
