"""A session that plans nothing (the CPU without a ``memory_limit``) trains a
``Job``'s steps eagerly, as the job's own loop would, and captures nothing
(issue 41, item 3: a short trial through ``job.train`` costs its eager loop
there, not a capture). A job is captured when a plan first needs it, and
then goes on exactly where its eager steps left it. Errors, Ctrl-C and
threads behave as they do for planned steps."""
import copy
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from conftest import PLANNING_LIMIT, assert_same_optimizer_state, start_and_join  # noqa: E402
from test_job_data import eager as eager_loop  # noqa: E402

import waterwave as ww  # noqa: E402
from waterwave.capturing.fake_step import CaptureError  # noqa: E402

loss_fn = torch.nn.functional.cross_entropy  # the eager loop's (test_job_data)


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batches(n=5, seed=0, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g))
            for _ in range(n)]


OPTIMIZERS = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
              "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)}


def eager(model, opt, data, steps):
    """The eager loop over ``data`` with ``opt``, epoch after epoch: its losses."""
    return eager_loop(model, lambda _: opt, data, steps)[0]


def assert_same_model(expected, got):
    for (name, a), (_, b) in zip(expected.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), name


@pytest.fixture
def unplanned():
    """The CPU's training session, with no budget: it plans nothing."""
    session = ww.training_session("cpu", memory_limit=None)
    assert not session.plans
    return session


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_job_where_nothing_is_planned_trains_as_its_eager_loop_and_captures_nothing(
        unplanned, optimizer):
    data = batches()
    model, reference = net(0), net(0)
    opt, ref_opt = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](reference)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data)
    assert not job.captured  # making the Job traced nothing
    before = unplanned.steps_run
    losses = job.train(4)
    for group in opt.param_groups:  # between calls, as a scheduler would
        group["lr"] *= 0.5
    losses += job.train(3)
    expected = eager(reference, ref_opt, data, 4)
    for group in ref_opt.param_groups:
        group["lr"] *= 0.5
    expected += eager(reference, ref_opt, data[4:] + data, 3)
    assert losses == expected  # bit for bit: it is the eager loop
    assert_same_model(reference, model)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)  # the last step's gradients, as the loop leaves them
    assert_same_optimizer_state(ref_opt, opt)
    assert job.stats() == {"steps": 7, "eager_steps": 7, "captures": 0}
    assert not job.captured and unplanned.steps_run == before + 7


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_job_is_captured_when_a_plan_first_needs_it_and_goes_on_as_eager(unplanned, optimizer):
    """Eager steps, then steps planned under a budget (the capture made then,
    from the optimizer's state as the eager steps left it), then eager again:
    the eager loop's, step for step."""
    data = batches(n=3, seed=1)
    model, reference = net(1), net(1)
    opt, ref_opt = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](reference)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data)
    planned = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    losses = job.train(2) + job.train(3, session=planned)
    assert job.captured and job.stats()["captures"] == 1
    losses += job.train(2)
    expected = eager(reference, ref_opt, data, 7)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert job.stats()["eager_steps"] == 4
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert_same_optimizer_state(ref_opt, opt)


def test_a_job_made_while_its_session_plans_is_captured_at_once(cpu_session_plans):
    model = net(2)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=batches())
    assert job.captured and job.stats()["captures"] == 1


class Branches(torch.nn.Module):
    """Python that reads a tensor's value: eager runs it, a capture cannot."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_a_step_no_capture_can_take_trains_unplanned_and_is_refused_when_planned(unplanned):
    data = batches(n=4, seed=2)
    model, reference = Branches(), Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data)
    losses = job.train(4)
    assert losses == eager(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data, 4)
    kept = copy.deepcopy(model.state_dict())
    planned = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    with pytest.raises(CaptureError, match="value"):
        job.train(1, session=planned)
    assert len(job.losses) == 4 and not job.failed  # nothing ran: the model as it was
    assert all(torch.equal(kept[k], v) for k, v in model.state_dict().items())
    assert len(job.train(1)) == 1  # and it trains on where nothing is planned


@pytest.mark.parametrize("limit", [None, PLANNING_LIMIT], ids=["unplanned", "shared"])
def test_batches_of_any_shape_train_eagerly_as_eager(limit):
    """Shapes that change every batch, larger than the first included:
    without a budget, and with one and nothing captured."""
    session = ww.TrainingSession("cpu", memory_limit=limit)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g))
            for rows in (4, 9, 2, 16, 7)]
    model, reference = net(4), net(4)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["adam"](model), data=data)
    assert job.train(10, session=session) == eager(reference, OPTIMIZERS["adam"](reference),
                                                   data, 10)
    assert_same_model(reference, model)


def test_a_job_without_data_trains_its_example_batch_every_step(unplanned):
    x, y = batches(n=1, seed=5)[0]
    model, reference = net(5), net(5)
    job = ww.Job(model, (x,), loss_fn, OPTIMIZERS["sgd"](model), targets=(y,))
    assert job.train(3) == eager(reference, OPTIMIZERS["sgd"](reference), [(x, y)], 3)


def test_a_job_whose_step_raises_stops_alone_and_one_whose_data_raises_goes_on(unplanned):
    calls = {"n": 0}

    def failing_loss(out, y):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("a loss that fails at its third call")
        return loss_fn(out, y)

    model = net(6)
    bad = ww.Job(model, loss_fn=failing_loss, optimizer=OPTIMIZERS["sgd"](model), data=batches())
    with pytest.raises(ValueError, match="third call"):
        bad.train(5)
    assert bad.failed and len(bad.losses) == 2
    with pytest.raises(RuntimeError, match="failed earlier"):
        bad.train(1)

    class Loader:
        """Its second pass fails while fetching its first batch."""
        passes = 0

        def __iter__(self):
            Loader.passes += 1
            if Loader.passes == 2:
                raise OSError("the data's disk went away")
            return iter(batches(n=2, seed=7))

    model = net(7)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=Loader())
    with pytest.raises(OSError, match="went away"):
        job.train(4)
    assert len(job.losses) == 2
    assert len(job.train(2)) == 2  # the error came between steps: the job goes on


class Meet:
    """A step scheduler that holds each job at its first step until all are
    training: they train at once, whatever the threads' timing."""

    def __init__(self, optimizer, barrier):
        self.optimizer, self.barrier, self.met = optimizer, barrier, False

    def step(self):
        if not self.met:
            self.met = True
            self.barrier.wait(30)


def test_jobs_unplanned_train_side_by_side_each_as_alone(unplanned):
    n = 4
    barrier = threading.Barrier(n)
    models = [net(10 + k) for k in range(n)]
    references = [net(10 + k) for k in range(n)]
    data = [batches(seed=10 + k) for k in range(n)]
    jobs = []
    for model, d in zip(models, data):
        opt = OPTIMIZERS["sgd"](model)
        jobs.append(ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=d,
                           step_schedulers=[Meet(opt, barrier)]))
    got = [None] * n

    def train(k):
        got[k] = jobs[k].train(6)

    start_and_join([threading.Thread(target=train, args=(k,)) for k in range(n)], 60,
                   "a job training unplanned hung")
    for k in range(n):
        assert got[k] == eager(references[k], OPTIMIZERS["sgd"](references[k]), data[k], 6)
        assert_same_model(references[k], models[k])
    assert unplanned.most_training >= n


@pytest.mark.parametrize("limit", [None, PLANNING_LIMIT], ids=["unplanned", "shared"])
def test_interrupting_the_session_stops_an_eager_job_at_its_next_step(limit):
    """Without a budget, or with one and nothing captured (its steps in a
    sharing block, test_shared_steps.py)."""
    session = ww.TrainingSession("cpu", memory_limit=limit)
    model = net(8)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=batches())
    outcome = {}

    def train():
        try:
            job.train(10 ** 7, session=session)
        except KeyboardInterrupt as e:
            outcome["stopped"] = (time.monotonic(), str(e))

    t = threading.Thread(target=train)
    t.start()
    while len(job.losses) < 3:
        time.sleep(0.001)
    assert job in session.training
    with pytest.raises(RuntimeError, match="already training"):
        job.train(1, session=session)
    asked = time.monotonic()
    session.interrupt()
    t.join(30)
    assert not t.is_alive(), "an interrupted job went on training"
    at, message = outcome["stopped"]
    assert at - asked < 1 and "training was interrupted" in message
    assert not job.failed and job not in session.training
    assert len(job.train(2, session=session)) == 2  # the next call trains


def test_accumulation_and_clipping_unplanned_train_as_the_eager_loop(unplanned):
    """Two batches a step, each loss halved, the gradients clipped before the
    update: the loop's step, and its loss the batches' mean."""
    data = batches(n=6, seed=9)
    model, reference = net(9), net(9)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model), data=data,
                 accumulate_grad_batches=2, clip_grad_norm=0.5)
    got = job.train(3)
    opt, expected = OPTIMIZERS["sgd"](reference), []
    for step in range(3):
        opt.zero_grad()
        losses = []
        for x, y in data[2 * step:2 * step + 2]:
            loss = loss_fn(reference(x), y)
            (loss / 2).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        expected.append(((losses[0] + losses[1]) / 2).item())
    assert got == expected and not job.captured
    assert_same_model(reference, model)


def test_only_a_plain_step_takes_the_one_closure_path(unplanned):
    """``Job.plain_step`` (one batch a step, no autocast, GradScaler or
    clipping) runs the same operators as ``_eager_step``; any other setting
    keeps ``_eager_step``, and keyword batches go there from the closure."""
    def job(**settings):
        model = net(3)
        return ww.Job(model, loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"](model),
                      data=batches(n=4, seed=3), **settings)

    assert job().plain_step(False) is not None
    for settings in ({"accumulate_grad_batches": 2}, {"clip_grad_norm": 1.0},
                     {"clip_grad_value": 0.5}, {"autocast_dtype": torch.bfloat16}):
        assert job(**settings).plain_step(False) is None, settings
    plain, full = job(), job()
    step = plain.plain_step(keep_grads=False)
    for k in range(3):
        inputs, targets = plain.next_batch()
        full_inputs, full_targets = full.next_batch()
        assert step(inputs, targets, k > 0).item() == full._eager_step(
            full_inputs, full_targets, False, k > 0).item()
        assert all(p.grad is None for p in plain.model.parameters())  # freed, as captured steps
    assert_same_model(full.model, plain.model)
    assert plain.stats()["eager_steps"] == full.stats()["eager_steps"] == 3


def test_a_step_clears_gradients_as_zero_grad_does_and_calls_any_other_zero_grad(monkeypatch):
    """``grads_clearer``: for torch's own ``zero_grad``, each parameter's
    gradient set to None without the method's wrapping, and the method
    itself while the profiler runs (its trace names the call); an
    optimizer's own ``zero_grad`` (a subclass's, or one set on it) is
    called, with ``set_to_none=True``."""
    from waterwave.exec.job import grads_clearer

    def with_grads(optimizer):
        model = net(4)
        opt = optimizer(model)
        model(torch.randn(2, 16)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        return model, opt

    model, opt = with_grads(OPTIMIZERS["adam"])
    extra = torch.nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    clear = grads_clearer(opt)
    opt.add_param_group({"params": [extra]})  # a group added after: cleared too
    clear()
    assert all(p.grad is None for p in model.parameters()) and extra.grad is None

    model, opt = with_grads(OPTIMIZERS["sgd"])
    with torch.profiler.profile() as prof:
        grads_clearer(opt)()
    assert all(p.grad is None for p in model.parameters())
    assert any("zero_grad" in e.name for e in prof.events())

    class Halving(torch.optim.SGD):  # a zero_grad of its own: called as it is
        def zero_grad(self, set_to_none=True):
            self.asked = set_to_none
            for g in self.param_groups:
                for p in g["params"]:
                    p.grad.mul_(0.5)

    model, opt = with_grads(lambda m: Halving(m.parameters(), lr=0.1))
    before = [p.grad.clone() for p in model.parameters()]
    grads_clearer(opt)()
    assert opt.asked is True
    assert all(torch.equal(p.grad, b * 0.5) for p, b in zip(model.parameters(), before))

    model, opt = with_grads(OPTIMIZERS["sgd"])
    calls = []
    opt.zero_grad = lambda set_to_none=True: calls.append(set_to_none)  # set on the optimizer
    grads_clearer(opt)()
    assert calls == [True] and all(p.grad is not None for p in model.parameters())

    # A torch that cannot say whether its profiler runs: torch's method each time.
    model, opt = with_grads(OPTIMIZERS["sgd"])
    called = []
    torch_zero_grad = torch.optim.Optimizer.zero_grad

    def recorded(self, set_to_none=True):
        called.append(set_to_none)
        torch_zero_grad(self, set_to_none)
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", recorded)
    monkeypatch.delattr(torch._C._autograd, "_profiler_enabled")
    grads_clearer(opt)()
    assert called == [True] and all(p.grad is None for p in model.parameters())
