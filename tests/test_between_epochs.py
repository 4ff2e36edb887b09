"""What a training script changes between epochs, followed by ``Job.train``
as eager training follows it: layers frozen or unfrozen (``requires_grad``),
``add_param_group``, a hyperparameter that reshapes the update (momentum set
from zero), a checkpoint whose parameters counted their steps apart. Each
is a new capture (``CapturedStep.variant_now``), bit for bit with the eager
loop on the CPU; ``ConcurrentTrainer`` and ``waterwave.optimize``, which
train one capture, refuse the change, naming it and the fix."""
import copy

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.capturing.guards import StaleCaptureError  # noqa: E402
from waterwave.capturing.optimizers import OptimizerError  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def data(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


loss_fn = torch.nn.functional.cross_entropy

# Every optimizer that counts steps (bias corrections per step count), and SGD.
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    # beta2 0.9: rectified from step 3, so the cohort that starts late runs
    # the plain update while the other runs the rectified one.
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.8, 0.9)),
}


class Eager:
    """The eager loop over the same batches, a call's steps at a time."""

    def __init__(self, model, opt, batches):
        self.model, self.opt, self.batches, self.i = model, opt, batches, 0

    def train(self, steps):
        losses = []
        for _ in range(steps):
            x, y = self.batches[self.i % len(self.batches)]
            self.i += 1
            self.opt.zero_grad()
            loss = loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        return losses


def assert_identical(eager, model, eager_opt, opt):
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    sa, sb = eager_opt.state_dict(), opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k, state in sa["state"].items():
        assert state.keys() == sb["state"][k].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][k][name])), \
                (k, name)


def both(make_opt, frozen=()):
    """An eager model and a Job's, alike, with the layers ``frozen``."""
    out = []
    for _ in range(2):
        model = net()
        for i in frozen:
            model[i].requires_grad_(False)
        out.append((model, make_opt(model)))
    return out


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_layer_unfrozen_and_frozen_again_trains_as_eager(kind):
    """Fine-tuning's usual schedule: the head alone first, then everything,
    with one optimizer over all the parameters (eager skips the frozen ones,
    which start their state, and their step count, when they thaw)."""
    batches = data()
    (eager, eager_opt), (model, opt) = both(lambda m: OPTIMIZERS[kind](m.parameters()), [0])
    reference = Eager(eager, eager_opt, batches)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches)
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    for thaw, steps in [(None, 2), (True, 3), (False, 2), (True, 2)]:
        if thaw is not None:
            for m in (eager, model):
                m[0].requires_grad_(thaw)
        assert job.train(steps, session=session) == reference.train(steps)
    assert_identical(eager, model, eager_opt, opt)
    assert len(job._by_variant) == 1  # frozen and thawed captured once each


def test_a_parameter_group_added_between_calls_trains_as_eager():
    batches = data()

    def head_only(model):
        return torch.optim.Adam(model[2].parameters(), lr=1e-2)

    (eager, eager_opt), (model, opt) = both(head_only, [0])
    reference = Eager(eager, eager_opt, batches)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches)
    assert job.train(2) == reference.train(2)
    for m, o in ((eager, eager_opt), (model, opt)):
        m[0].requires_grad_(True)
        o.add_param_group({"params": list(m[0].parameters()), "lr": 1e-3})
    assert job.train(3) == reference.train(3)
    assert_identical(eager, model, eager_opt, opt)


@pytest.mark.parametrize("change", [
    lambda g: g.update(momentum=0.9),                      # momentum set from zero
    lambda g: g.update(momentum=0.9, nesterov=True),
    lambda g: g.update(weight_decay=5e-4),                 # weight decay set from zero
])
def test_a_hyperparameter_that_reshapes_the_update_is_followed(change):
    batches = data()
    (eager, eager_opt), (model, opt) = both(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05))
    reference = Eager(eager, eager_opt, batches)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches)
    assert job.train(2) == reference.train(2)
    for o in (eager_opt, opt):
        change(o.param_groups[0])
    assert job.train(3) == reference.train(3)
    assert_identical(eager, model, eager_opt, opt)


def test_a_checkpoint_whose_parameters_counted_apart_resumes_exactly():
    """A checkpoint of fine-tuning (the first layer thawed two steps after
    the rest) loaded into a Job captured before it: the step counts of one
    group differ, and each goes on from its own count, as eager Adam's."""
    batches = data()
    (eager, eager_opt), _ = both(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), [0])
    reference = Eager(eager, eager_opt, batches)
    reference.train(2)
    eager[0].requires_grad_(True)
    reference.train(2)
    # A copy, as torch.save writes it: a loaded state holds the tensors it is given.
    checkpoint = copy.deepcopy((eager.state_dict(), eager_opt.state_dict()))
    steps = {float(s["step"]) for s in eager_opt.state_dict()["state"].values()}
    assert steps == {2.0, 4.0}

    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches)  # captured: no state
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    assert job.train(3) == reference.train(3)
    assert_identical(eager, model, eager_opt, opt)


def test_optimize_and_the_trainer_refuse_what_a_job_follows():
    batches = data()
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = ww.optimize(model, (batches[0][0],), loss_fn, opt, example_targets=batches[0][1])
    trainer.step(batches[0][0], targets=batches[0][1])
    model[2].weight.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StaleCaptureError, match=r"parameter 2\.weight is frozen .* set "
                                                r"requires_grad back, or make a new Job"):
        trainer.step(batches[1][0], targets=batches[1][1])
    model[2].weight.requires_grad_(True)
    # One parameter's count moved apart (a checkpoint of another run, say).
    opt.state[model[0].bias]["step"] += 5
    with pytest.raises(OptimizerError, match="steps 1 and 6 now .* make a new Job"):
        trainer.step(batches[1][0], targets=batches[1][1])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved

    model = net()
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=batches)
    trainer = ww.ConcurrentTrainer([job])
    trainer.run(1)
    model[0].requires_grad_(False)
    with pytest.raises(StaleCaptureError, match=r"parameter 0\.weight is frozen"):
        trainer.run(1)
