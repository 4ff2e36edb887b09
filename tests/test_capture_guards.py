"""A captured step runs the model as it was captured; when the model or the
context changed since (train/eval mode, a parameter replaced, a hook added,
autocast), the next step refuses with an error that names the change and the
fix, instead of silently training another model than eager PyTorch would."""
import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.capturing.guards import StaleCaptureError  # noqa: E402


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
    with pytest.raises(StaleCaptureError, match="parameters are not those"):
        step()


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
            return job.train(1, session=ww.TrainingSession("cpu"))
    else:
        step = dict(trainers(model))[way]
    before = [p.detach().clone() for p in model.parameters()]
    for off in (torch.no_grad, torch.inference_mode):
        with off(), pytest.raises(StaleCaptureError, match="gradients are off here"):
            step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained
    step()
