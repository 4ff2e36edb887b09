"""Jobs train on their data as an eager loop does: a batch a step, drawn from
a DataLoader or a list, epoch after epoch, a short last batch from a capture
of its own; a batch the job's plan cannot hold, or data that runs out, is a
clear error naming the fix."""
import copy

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import waterwave as ww  # noqa: E402
from waterwave.capturing.fake_step import CaptureError  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def dataset(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


loss_fn = torch.nn.functional.cross_entropy


def eager(model, make_opt, loader, steps):
    """The eager loop: epoch after epoch until ``steps`` steps; its losses."""
    opt, losses = make_opt(model), []
    while len(losses) < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses, opt


MAKERS = [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
          lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)]


@pytest.mark.parametrize("schedule", ["waterwave", "lockstep"])
def test_jobs_train_on_their_loaders_epoch_after_epoch_as_eager(schedule):
    loaders = [DataLoader(dataset(seed=k), batch_size=8) for k in range(2)]  # 3 batches an epoch
    steps = 7  # two epochs and a bit
    models = [net(k) for k in range(2)]
    expected = [eager(copy.deepcopy(m), make, loader, steps)
                for m, make, loader in zip(models, MAKERS, loaders)]
    jobs = [ww.Job(m, loss_fn=loss_fn, optimizer=make(m), data=loader)
            for m, make, loader in zip(models, MAKERS, loaders)]
    trainer = ww.ConcurrentTrainer(jobs, schedule=schedule)
    trainer.run(4)
    trainer.run(steps - 4)  # the next run goes on with the next batches
    for job, (losses, opt) in zip(jobs, expected):
        assert job.error is None
        torch.testing.assert_close(job.losses, losses, rtol=1e-5, atol=1e-6)
        assert job.batches.epoch == 3


def test_a_list_of_batches_with_several_targets():
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g),
                torch.rand(4, 4, generator=g)) for _ in range(2)]

    def weighted(out, target, weight):
        return ((out - target) ** 2 * weight).mean()

    model = net(3)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y, w in batches * 2:
        opt.zero_grad()
        weighted(reference(x), y, w).backward()
        opt.step()
    job = ww.Job(model, loss_fn=weighted, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=batches)
    ww.ConcurrentTrainer([job]).run(4)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach())


@pytest.mark.parametrize("how", ["trainer", "train"])
def test_a_short_last_batch_trains_from_its_own_capture_as_eager(how):
    """DataLoader's short last batch (20 samples in 8, 8, 4): the step at
    batch 4 is captured once, cut into the same groups, and every epoch's
    last step runs it, exactly as eager, optimizer state shared."""
    loader = DataLoader(dataset(n=20), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(3))
    model = net(0)
    ref_loader = DataLoader(dataset(n=20), batch_size=8, shuffle=True,
                            generator=torch.Generator().manual_seed(3))
    losses, ref_opt = eager(copy.deepcopy(model), MAKERS[0], ref_loader, 8)
    opt = MAKERS[0](model)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=loader)
    if how == "trainer":
        ww.ConcurrentTrainer([job], memory_limit=1 << 20).run(8)
        got = job.losses
    else:
        got = job.train(3) + job.train(5)  # epochs 1, 2 and a bit
    assert job.error is None
    torch.testing.assert_close(got, losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_opt.param_groups[0]["params"], opt.param_groups[0]["params"]):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[b]["momentum_buffer"],
                                   ref_opt.state[a]["momentum_buffer"], rtol=1e-5, atol=1e-6)
    assert len(job._other_shapes) == 1  # captured once, for batch 4


def eager_losses(model, opt, batches, loss=None):
    """The eager loop over ``batches`` (tuples of input, targets...)."""
    loss = loss or loss_fn
    out = []
    for x, *targets in batches:
        opt.zero_grad()
        value = loss(model(x), *targets)
        value.backward()
        opt.step()
        out.append(value.item())
    return out


def test_a_batch_larger_than_the_first_trains_eagerly():
    # Issue 39: dynamic padding made batches larger than the captured one
    # fail partway through training; such a step now runs eagerly.
    data = [(torch.randn(4, 16), torch.randint(0, 4, (4,))),
            (torch.randn(8, 16), torch.randint(0, 4, (8,)))]
    model = net(0)
    reference = copy.deepcopy(model)
    expected = eager_losses(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data * 2)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    assert job.train(4, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)) == expected
    assert job.stats() == {"steps": 4, "eager_steps": 2, "captures": 1}
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
        assert b.grad is None  # as a captured step leaves it


def test_a_batch_with_another_number_of_items_runs_as_the_eager_loop_would():
    data = [(torch.randn(4, 16), torch.randint(0, 4, (4,))),
            (torch.randn(4, 16), torch.randint(0, 4, (4,)), torch.ones(4))]
    model = net(0)
    reference = copy.deepcopy(model)
    # The loop's loss takes the third item as cross_entropy's class weights.
    expected = eager_losses(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    ww.ConcurrentTrainer([job]).run(2)
    assert job.error is None and job.losses == expected
    job = ww.Job(model, loss_fn=lambda out, y: loss_fn(out, y),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data)
    ww.ConcurrentTrainer([job]).run(2)
    # A loss taking one target: the eager loop would fail there too.
    assert isinstance(job.error, TypeError) and "positional argument" in str(job.error)
    assert len(job.losses) == 1


def weighted_loss(out, y, weight):
    return loss_fn(out, y) * weight


def test_a_non_tensor_item_that_changes_from_batch_to_batch_is_captured_per_value():
    """A Python number in a batch (a loss weight) is a constant of the
    captured step: each value gets a capture of its own, as eager reads it
    afresh every batch (it was once held at the first batch's value)."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g), w)
            for w in (0.5, 2.0, 0.5)]
    model = net(0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for x, y, w in data * 2:
        ref_opt.zero_grad()
        loss = weighted_loss(reference(x), y, w)
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    job = ww.Job(model, loss_fn=weighted_loss, optimizer=torch.optim.SGD(model.parameters(),
                                                                          lr=0.1), data=data)
    assert job.train(6) == expected
    assert len(job._other_shapes) == 1  # 2.0's; 0.5 is the first batch's


def test_non_tensor_items_a_capture_cannot_follow_train_eagerly(monkeypatch):
    from waterwave.exec import job as job_module

    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    model = net(0)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    named = lambda out, y, names: loss_fn(out, y)  # noqa: E731
    data = [(x, y, 1.0), (x, y, ["a", "b"])]  # a list: no capture can key it
    job = ww.Job(model, loss_fn=named, optimizer=opt, data=data)
    assert job.train(2) == eager_losses(reference, ref_opt, data, named)
    assert job.stats()["eager_steps"] == 1
    monkeypatch.setattr(job_module, "MAX_OTHER_CAPTURES", 2)
    data = [(x, y, float(w)) for w in range(4)]
    job = ww.Job(model, loss_fn=weighted_loss, optimizer=opt, data=data)
    assert job.train(4) == eager_losses(reference, ref_opt, data, weighted_loss)
    assert job.stats() == {"steps": 4, "eager_steps": 1, "captures": 3}
    trainer = ww.optimize(model, (x,), weighted_loss, opt, example_targets=(y, 1.0))
    trainer.step(x, targets=(y, 1.0))
    with pytest.raises(ValueError, match="batch item 2 is 3.0; the step was captured with 1.0"):
        trainer.step(x, targets=(y, 3.0))


def test_a_loss_that_cannot_take_the_batchs_targets_says_what_it_was_given():
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    model = net(0)
    with pytest.raises(CaptureError, match=r"takes 2 positional arguments.*loss_fn\(output, "
                                           r"\*targets\).*2 here"):
        ww.Job(model, loss_fn=lambda out, y: loss_fn(out, y), data=[(x, y, torch.arange(4))],
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_data_that_runs_out_says_to_pass_a_re_iterable():
    model = net(0)
    data = iter([(torch.randn(4, 16), torch.randint(0, 4, (4,))) for _ in range(2)])
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    ww.ConcurrentTrainer([job]).run(3)
    assert "DataLoader or a list" in str(job.error) and len(job.losses) == 2


@pytest.mark.parametrize("args, message", [
    (dict(), "needs data .* or example_inputs"),
    (dict(data=["text"]), "a tuple .* or a dict"),
    (dict(data=[]), "yields no batch"),
    (dict(data=5), "iterable of batches"),
])
def test_bad_data_is_a_clear_error(args, message):
    model = net(0)
    with pytest.raises(ValueError, match=message):
        ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               **args)


def test_a_model_returning_a_named_tuple_gives_the_loss_its_output_as_returned():
    """torchvision's GoogLeNet and Inception-v3 return (logits, aux...) named
    tuples in training; the loss gets the output as the model returns it."""
    import collections

    Out = collections.namedtuple("Out", "logits aux")

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return Out(self.a(h), self.b(h))

    def loss(out, y):
        return loss_fn(out.logits, y) + 0.4 * loss_fn(out.aux, y)

    torch.manual_seed(0)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    data = list(DataLoader(dataset(n=16), batch_size=8))
    job = ww.Job(model, loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    got = job.train(4, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    opt, expected = torch.optim.SGD(reference.parameters(), lr=0.1), []
    for i in range(4):
        x, y = data[i % 2]
        opt.zero_grad()
        value = loss(reference(x), y)
        value.backward()
        opt.step()
        expected.append(value.item())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_the_cli_default_loss_takes_googlenets_main_output():
    from waterwave.tools import models

    model, inputs, loss = models.build("googlenet", 1)
    assert model.training and model.aux_logits  # it returns (logits, aux2, aux1) in training
    graph = ww.capture(model, inputs, loss, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(graph.nodes) > 100
    assert models.main_output(("logits", "aux")) == "logits" and models.main_output(3) == 3


def test_training_in_eval_mode_follows_the_modes_set_when_train_is_called():
    """Eager code may train with batch norm frozen (model.eval(), or one
    module's): train() captures the step in the modes the model is in when
    it is called, and goes back when they do."""
    def bn_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 4))

    data = list(DataLoader(dataset(n=24), batch_size=8))
    model, reference = bn_net(), bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data)
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    plan = [("train", 2), ("eval", 2), ("bn-frozen", 2), ("train", 1)]
    got, expected, i = [], [], 0
    for mode, n in plan:
        for m in (model, reference):
            m.train(mode != "eval")
            if mode == "bn-frozen":
                m[1].eval()
        got += job.train(n, session=session)
        for _ in range(n):
            x, y = data[i % 3]
            i += 1
            ref_opt.zero_grad()
            loss = loss_fn(reference(x), y)
            loss.backward()
            ref_opt.step()
            expected.append(loss.item())
    assert got == expected
    for a, b in zip(reference.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)  # parameters and batch norm's running statistics
    assert len(job._by_variant) == 2  # three sets of modes captured, one in use


def test_instance_norms_running_statistics_move_as_eager():
    """ATen's instance_norm updates a repeat of the running mean inside
    native_batch_norm, whose schema marks no write, then averages it into
    the buffer: the ordering edge comes from ``UNMARKED_WRITES`` (without it
    the node groups averaged before the update, and the statistics never
    moved, silently)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.group = torch.nn.GroupNorm(2, 8)
            self.inst = torch.nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.inst(self.group(self.conv(x))).mean((2, 3)))

    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 4, (4,), generator=g))]
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    expected, ref_opt = eager(reference, MAKERS[1], data, 3)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=MAKERS[1](model), data=data)
    assert job.train(3) == expected
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.inst.running_mean, torch.zeros(8))


@pytest.mark.parametrize("how", ["job", "optimize"])
def test_a_loss_that_reads_the_models_parameters_trains_as_eager(how):
    """An L2 penalty over model.parameters() in the loss: the capture swaps
    the model's tensors for the step's around the loss too, so the penalty
    reads and backpropagates into what is trained (it was a constant of the
    trace, and its gradient was lost, silently)."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(2)]
    model = net(0)
    reference = copy.deepcopy(model)

    def penalized(m):
        return lambda out, y: loss_fn(out, y) + 0.05 * sum(p.square().sum()
                                                             for p in m.parameters())

    expected = []
    ref_opt = MAKERS[1](reference)
    for x, y in data * 2:
        ref_opt.zero_grad()
        loss = penalized(reference)(reference(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    opt = MAKERS[1](model)
    if how == "job":
        got = ww.Job(model, loss_fn=penalized(model), optimizer=opt, data=data).train(4)
    else:
        trainer = ww.optimize(model, (data[0][0],), penalized(model), opt,
                              example_targets=data[0][1])
        got = [float(trainer.step(x, targets=y)) for x, y in data * 2]
    assert got == expected
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_random_operators_and_shuffling_draw_from_torchs_generator_as_eager():
    """Dropout in the step and a shuffling DataLoader between steps draw from
    torch's global generator in eager's order: a job trained alone, a call
    an epoch, equals the eager loop after the same seed, and leaves the
    generator where eager leaves it."""
    def dropout_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3),
                                   torch.nn.Linear(32, 4))

    loader = DataLoader(dataset(n=24), batch_size=8, shuffle=True)
    reference, model = dropout_net(), dropout_net()
    torch.manual_seed(7)
    expected, ref_opt = eager(reference, MAKERS[1], loader, 9)
    after_eager = torch.get_rng_state()
    torch.manual_seed(7)  # before the Job, which draws the first epoch's order when made
    job = ww.Job(model, loss_fn=loss_fn, optimizer=MAKERS[1](model), data=loader)
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    got = [loss for _ in range(3) for loss in job.train(len(loader), session=session)]
    assert got == expected
    assert torch.equal(torch.get_rng_state(), after_eager)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_thread_with_a_smaller_openmp_team_trains_as_an_eager_loop_with_it():
    """The guide's advice for k trials on a CPU: torch.set_num_threads(cores // k)
    before their threads start. Each thread then runs its operators with
    that team, and job.train, which runs a job's groups on the calling
    thread, trains as the eager loop on such a thread does, bit for bit;
    with another team size the roundings differ (so the check can tell)."""
    import threading

    torchvision = pytest.importorskip("torchvision")

    def train(how, team):
        out = []

        def body():
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - raised on the test's thread below
                out.append(e)

        def run():
            torch.manual_seed(0)
            model = torchvision.models.resnet18(num_classes=10)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(1)
            data = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
                    for _ in range(2)]
            if how == "job":
                ww.Job(model, loss_fn=torch.nn.functional.cross_entropy, optimizer=opt,
                       data=data).train(2)
            else:
                for x, y in data:
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
            out.append([p.detach().clone() for p in model.parameters()])
        before = torch.get_num_threads()
        torch.set_num_threads(team)  # the team a thread started after this takes
        try:
            t = threading.Thread(target=body)
            t.start()
            t.join()
        finally:
            torch.set_num_threads(before)
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    one_eager, one_job = train("eager", 1), train("job", 1)
    assert all(torch.equal(a, b) for a, b in zip(one_eager, one_job))
    full_eager = train("eager", 2)  # the suite's own processes run a team of 1 (conftest)
    assert not all(torch.equal(a, b) for a, b in zip(one_eager, full_eager))


def test_batches_already_on_the_device_are_counted_as_held_beside_the_steps():
    """A job's data of batches put on its device beforehand is memory the
    job holds between steps that no step allocates (on a GPU, a session's
    budget must count it): its storages' bytes, views of one storage once,
    less the largest batch (the step's input, counted by its capture). A
    DataLoader's batches are made as they are drawn: nothing is held."""
    from waterwave.exec.batches import BatchFeed

    cpu = torch.device("cpu")
    xs = [torch.zeros(8, 16) for _ in range(3)]
    ys = [torch.zeros(8, dtype=torch.long) for _ in range(3)]
    batch = 8 * 16 * 4 + 8 * 8
    assert BatchFeed(list(zip(xs, ys)), device=cpu).resident_bytes() == 2 * batch
    whole = torch.zeros(4, 8, 16)  # four batches, views of one storage
    assert BatchFeed([(whole[i], ys[0]) for i in range(4)], device=cpu).resident_bytes() == (
        whole.untyped_storage().nbytes() + ys[0].untyped_storage().nbytes() - 8 * 16 * 4 - 8 * 8)
    dicts = [{"x": x, "y": y} for x, y in zip(xs, ys)]
    assert BatchFeed(dicts, device=cpu, target_keys=["y"]).resident_bytes() == 2 * batch
    assert BatchFeed(list(zip(xs, ys)), device=torch.device("meta")).resident_bytes() == 0
    assert BatchFeed(DataLoader(dataset(), batch_size=8), device=cpu).resident_bytes() == 0
    assert BatchFeed(list(zip(xs, ys))).resident_bytes() == 0  # no device: nothing moved


def test_a_cpu_jobs_batch_on_the_cpu_is_handed_out_as_it_is_and_any_other_is_moved():
    """``BatchFeed.next`` on the CPU: a batch whose tensors are all on the
    CPU (or that holds non-tensors) is the batch itself, not a copy; one
    tensor elsewhere sends the batch through ``x.to(device)`` (a meta
    tensor, which cannot be copied out, says so)."""
    from waterwave.exec.batches import BatchFeed

    cpu = torch.device("cpu")
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    inputs, targets = BatchFeed([(x, 0.5, y)], n_inputs=2, device=cpu).next()
    assert inputs[0] is x and inputs[1] == 0.5 and targets[0] is y
    with pytest.raises(NotImplementedError, match="meta"):
        BatchFeed([(x, torch.zeros(4, device="meta"), y)], n_inputs=2, device=cpu).next()
