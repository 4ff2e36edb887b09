"""A captured step runs the model as it was captured; when the model or the
context changed since (train/eval mode, a parameter replaced, a hook added,
autocast, a Python value its modules' code read), the next step refuses with an error that names the change and the
fix, instead of silently training another model than eager PyTorch would."""
import copy
import io

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.capturing.guards import StaleCaptureError  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1),
                               torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))


def loss_fn(out):
    return out.square().mean()


X = torch.randn(8, 16)


def trainers(model):
    """The two ways a captured step runs: optimize's trainer and a job."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    yield "optimize", (lambda t=ww.optimize(model, (X,), loss_fn, opt): t.step(X))
    job = ww.Job(model, (X,), loss_fn, torch.optim.SGD(model.parameters(), lr=0.01))
    yield "job", (lambda tr=ww.ConcurrentTrainer([job]): tr.run(1) and job.error and
                  (_ for _ in ()).throw(job.error))


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_eval_mode_after_a_train_mode_capture_is_refused(way):
    model = net()
    step = dict(trainers(model))[way]
    step()
    model.eval()
    with pytest.raises(StaleCaptureError, match=r"eval mode.*captured in train mode.*model\.train\(\)"):
        step()
    model.train()
    step()


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_a_replaced_parameter_or_a_new_hook_is_refused(way):
    model = net()
    step = dict(trainers(model))[way]
    handle = model[0].register_forward_hook(lambda *a: None)
    with pytest.raises(StaleCaptureError, match="hooks changed"):
        step()
    handle.remove()
    step()
    model[3].weight = torch.nn.Parameter(torch.zeros_like(model[3].weight))
    with pytest.raises(StaleCaptureError, match="parameters are not those.*optimizer trains"):
        step()


@pytest.mark.parametrize("way", ["optimize", "train"])
def test_buffers_replaced_alike_are_followed_as_eager_follows_them(way):
    """A running mean reset by assignment, a model moved there and back
    (``_apply`` replaces buffers): the next steps use the new buffers."""
    eager, model = Scaled(), Scaled()
    for m in (eager, model):
        m.body.insert(2, torch.nn.BatchNorm1d(32))
    step = _step_of(way, model)
    opt = torch.optim.SGD(eager.parameters(), lr=0.01)

    def change(m, i):
        if i == 1:
            m.body[2].running_mean = torch.full((32,), 0.5)
        if i == 2:
            m.double().float()

    torch.manual_seed(5)
    for i in range(4):
        change(eager, i)
        opt.zero_grad()
        loss_fn(eager(X)).backward()
        opt.step()
    torch.manual_seed(5)
    for i in range(4):
        change(model, i)
        step()
    for a, b in zip([*eager.parameters(), *eager.buffers()], [*model.parameters(), *model.buffers()]):
        assert torch.equal(a, b)
    model.body[2].register_buffer("extra", torch.zeros(1))
    with pytest.raises(StaleCaptureError, match="parameters or buffers were added or removed"):
        step()


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_a_replaced_module_is_refused(way):
    """A module with no parameters (an activation) swapped for another: the
    step would still run the one it traced."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    step = dict(trainers(model))[way]
    step()
    model[1] = torch.nn.GELU()
    with pytest.raises(StaleCaptureError, match=r"module 1 was replaced.*make a new Job"):
        step()
    model.append(torch.nn.Tanh())
    with pytest.raises(StaleCaptureError, match="modules were added or removed"):
        step()


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_a_model_cast_or_moved_in_place_is_refused_and_cast_back_trains_again(way):
    model = net()
    step = dict(trainers(model))[way]
    step()
    model.double()  # the same parameters, their data now float64
    with pytest.raises(StaleCaptureError, match=r"parameter 0\.weight is float64 of shape "
                                                r"\[32, 16\] on cpu now; .* float32"):
        step()
    model.float()
    step()


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_a_gradient_hook_on_a_parameter_is_refused(way):
    """Eager backward runs a parameter's own hooks (register_hook,
    register_post_accumulate_grad_hook); a captured step's gradients are
    its own, so such a hook would silently not run."""
    model = net()
    handle = model[0].weight.register_hook(lambda g: g * 0)
    with pytest.raises(ww.capturing.CaptureError, match=r"parameter 0\.weight has a gradient "
                                                       r"hook.*remove it"):
        dict(trainers(model))[way]
    handle.remove()
    step = dict(trainers(model))[way]
    step()
    handle = model[3].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(StaleCaptureError, match=r"parameter 3\.bias has a gradient hook now"):
        step()
    handle.remove()
    step()


class WithAuxiliaryLoss(torch.nn.Module):
    """Keeps a term of its loss as ``self.aux``, for the loss to read."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def forward(self, x):
        out = self.layer(x)
        self.aux = out.square().mean()
        return out


def test_an_attribute_the_forward_pass_sets_is_the_steps_and_is_not_guarded():
    """An auxiliary loss kept on the module (as mixture-of-experts layers
    keep theirs) is the step's own inside the loss; an evaluation between
    calls that sets it again is no change to refuse (it was refused, and the
    trace's fake tensor was left on the module)."""
    torch.manual_seed(0)
    model = WithAuxiliaryLoss()
    reference = copy.deepcopy(model)

    def loss_of(m):
        return lambda out: loss_fn(out) + 0.5 * m.aux

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    job = ww.Job(model, (X,), loss_of(model), torch.optim.SGD(model.parameters(), lr=0.05))
    assert not hasattr(model, "aux")  # the capture's value is not left behind
    expected, got = [], []
    for _ in range(2):
        for _ in range(2):
            ref_opt.zero_grad()
            loss = loss_of(reference)(reference(X))
            loss.backward()
            ref_opt.step()
            expected.append(loss.item())
        got += job.train(2)
        # The steps keep their aux inside: what is there says so when used,
        # rather than pass for the last step's (the evaluation's before).
        assert isinstance(model.aux, ww.capturing.guards.SetInsideCapturedStep)
        with pytest.raises(AttributeError, match=r"the model's attribute 'aux' is set by the "
                                                 r"forward pass inside the captured.*return it"):
            model.aux.item()
        with pytest.raises(TypeError, match="not carry it out"):
            float(model.aux)
        with pytest.raises(TypeError, match="not carry it out"):
            f"{model.aux:.3f}"
        assert "not carried out" in repr(model.aux)
        with torch.no_grad():  # evaluation between calls sets aux again
            reference(X)
            model(X)
        assert torch.equal(model.aux, reference.aux)
    assert got == expected
    assert torch.equal(reference.layer.weight, model.layer.weight)
    job.train(1)
    twin = copy.deepcopy(model)  # a model holding the marker copies with it
    assert "not carried out" in repr(twin.aux)
    # and pickles with None there: a model saved whole loads without waterwave
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"waterwave" not in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.aux is None and torch.equal(loaded.layer.weight, model.layer.weight)


def test_an_attribute_the_loss_module_sets_is_marked_after_optimize_steps():
    """The same for a loss module's attribute, through optimize's trainer:
    the last value eager code would read is the step's, which stays inside."""
    class LoggedLoss(torch.nn.Module):
        def forward(self, out):
            self.last = out.square().mean()
            return self.last

    torch.manual_seed(0)
    model, loss = net(), LoggedLoss()
    loss.last = torch.tensor(-1.0)  # as set before, by an evaluation
    trainer = ww.optimize(model, (X,), loss, torch.optim.SGD(model.parameters(), lr=0.05))
    assert float(loss.last) == -1.0  # the capture puts it back
    trainer.step(X)
    with pytest.raises(AttributeError, match=r"module loss_fn's attribute 'last' is set"):
        loss.last.detach()


def test_a_running_value_kept_as_a_plain_tensor_attribute_is_refused():
    class Running(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 4)
            self.average = torch.zeros(())

        def forward(self, x):
            out = self.layer(x)
            self.average = 0.9 * self.average + 0.1 * out.mean().detach()
            return out

    model = Running()
    with pytest.raises(ww.capturing.CaptureError, match=r"the model's attribute 'average' is "
                                                       r"read and then set.*register_buffer"):
        ww.Job(model, (X,), loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.average.shape == () and float(model.average) == 0.0  # put back


def test_models_a_capture_cannot_trace_are_refused_with_the_fix():
    model = net()
    with pytest.raises(ww.capturing.CaptureError, match=r"torch\.compile.*model\._orig_mod"):
        ww.Job(torch.compile(model), (X,), loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten())
    with pytest.raises(ww.capturing.CaptureError, match=r"module 0 \(Embedding\) makes sparse "
                                                       r"gradients.*sparse=False"):
        ww.Job(sparse, (torch.randint(0, 10, (8, 2)),), loss_fn,
               torch.optim.SGD(sparse.parameters(), lr=0.1))


@pytest.mark.parametrize("way", ["optimize", "job"])
def test_autocast_around_a_step_captured_without_it_is_refused(way):
    model = net()
    step = dict(trainers(model))[way]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(StaleCaptureError, match="autocast is on here and was off"):
            step()
    step()


@pytest.mark.parametrize("way", ["optimize", "job", "train"])
def test_a_step_asked_for_without_gradients_is_refused(way):
    """Eager code inside torch.no_grad() cannot backpropagate; a captured
    step there would have trained anyway: refused, naming the fix."""
    model = net()
    if way == "train":
        job = ww.Job(model, (X,), loss_fn, torch.optim.SGD(model.parameters(), lr=0.01))

        def step():
            return job.train(1, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    else:
        step = dict(trainers(model))[way]
    before = [p.detach().clone() for p in model.parameters()]
    for off in (torch.no_grad, torch.inference_mode):
        with off(), pytest.raises(StaleCaptureError, match="gradients are off here"):
            step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained
    step()


class Scaled(torch.nn.Module):
    """A model whose forward reads Python values kept as attributes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(32, 4))
        self.scale, self.shift = 1.0, (0.0,)
        self.mask = torch.ones(4)
        self.epoch = 0  # bookkeeping its forward never reads

    def forward(self, x):
        return self.body(x) * self.scale * self.mask + self.shift[0]


def _step_of(way, model, loss=loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if way == "optimize":
        trainer = ww.optimize(model, (X,), loss, opt)
        return lambda: trainer.step(X)
    job = ww.Job(model, (X,), loss, opt)
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    return lambda: job.train(1, session=session)


@pytest.mark.parametrize("way", ["optimize", "train"])
@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m, "scale", 2.0), r"the model's scale is 2\.0 now; it was 1\.0"),
    (lambda m: setattr(m, "shift", (0.5,)), r"shift is \(0\.5,\) now; it was \(0\.0,\)"),
    (lambda m: setattr(m.body[1], "p", 0.5), r"body\.1\.p is 0\.5 now; it was 0\.1"),
    (lambda m: setattr(m, "mask", torch.zeros(4)), r"mask is tensor.* it was another tensor"),
    (lambda m: delattr(m, "scale"), r"scale is deleted now"),
])
def test_a_python_value_the_trace_read_that_changed_is_refused(way, change, message):
    """A dropout's p, a scale kept as an attribute: the trace holds what they
    were, so a step after a change would silently train the old model."""
    model = Scaled()
    step = _step_of(way, model)
    step()
    before = [p.detach().clone() for p in model.parameters()]
    change(model)
    with pytest.raises(StaleCaptureError, match=message + ".*make a new Job"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained


@pytest.mark.parametrize("way", ["optimize", "train"])
def test_values_the_trace_did_not_read_may_change_and_in_place_edits_are_followed(way):
    eager, model = Scaled(), Scaled()
    step = _step_of(way, model)
    opt = torch.optim.SGD(eager.parameters(), lr=0.01)
    torch.manual_seed(5)
    for epoch in range(3):
        opt.zero_grad()
        loss_fn(eager(X)).backward()
        opt.step()
        eager.epoch = epoch
        eager.mask[epoch] = 0.5  # the same tensor, edited in place
    torch.manual_seed(5)
    for epoch in range(3):
        step()
        model.epoch = epoch
        model.mask[epoch] = 0.5
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert type(model) is Scaled and type(model.body[0]) is torch.nn.Linear  # classes restored


def test_a_loss_modules_setting_is_guarded_too():
    model = Scaled()
    loss = torch.nn.MSELoss(reduction="mean")
    step = _step_of("train", model, lambda out, loss=loss: loss(out, torch.zeros_like(out)))
    step()  # a function closing over a module: not a module, not guarded

    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    job = ww.Job(model, (X,), criterion, torch.optim.SGD(model.parameters(), lr=0.01),
                 targets=torch.zeros(8, dtype=torch.long))
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    job.train(1, session=session)
    criterion.label_smoothing = 0.2
    with pytest.raises(StaleCaptureError, match=r"loss_fn\.label_smoothing is 0\.2 now; it was 0\.1"):
        job.train(1, session=session)


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x):
        if x.mean() > 0:  # a branch on the batch's values
            return self.lin(x)
        return -self.lin(x)


class Masks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x)[x[:, 0] > 0]  # as many rows as the batch has positive


@pytest.mark.parametrize("model, message", [
    (Branches, r"reads a tensor's value in Python at .*test_capture_guards\.py:\d+ in forward: "
               r"if x\.mean\(\) > 0.*torch\.where.*train this model eagerly"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4, momentum=None)),
     r"reads a tensor's value .*batchnorm\.py:\d+ in forward: .*num_batches_tracked.*give batch "
     r"norm a momentum"),
    (Masks, r"aten\.index\.Tensor makes a tensor whose size depends on the values.*torch\.where"),
])
def test_python_that_reads_a_tensors_value_is_a_clear_error_at_capture(model, message):
    """Data-dependent control flow and sizes: torch's symbolic-shape error
    becomes one that says where, in the model's code, and the fix."""
    m = model()
    with pytest.raises(ww.capturing.CaptureError, match=message):
        ww.Job(m, (X,), loss_fn, torch.optim.SGD(m.parameters(), lr=0.01))
