"""A captured step's optimizer is the user's optimizer: its state lives in
``optimizer.state`` (checkpoints and resuming are exact), Adam's learning rate
may change every step, and a hyperparameter the captured update holds as a
constant is never silently ignored when it changes: the next step refuses
it, naming the fix."""
import copy

import pytest
from conftest import PLANNING_LIMIT, assert_same_optimizer_state

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.capturing import CaptureError  # noqa: E402
from waterwave.capturing.optimizers import OptimizerError  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def loss_fn(out):
    return out.square().mean()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, amsgrad=True),
    "adamw-amsgrad-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True,
                                                           maximize=True),
    "sgd-maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                               weight_decay=1e-3, maximize=True),
    "rmsprop-maximize": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, weight_decay=1e-3,
                                                       maximize=True),
    "adagrad-maximize": lambda ps: torch.optim.Adagrad(ps, lr=0.1, maximize=True),
    "adagrad-lr-decay": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05,
                                                       weight_decay=1e-3),
    "adamax-maximize": lambda ps: torch.optim.Adamax(ps, lr=1e-2, maximize=True),
    "nadam-maximize": lambda ps: torch.optim.NAdam(ps, lr=1e-2, maximize=True),
    "radam-maximize": lambda ps: torch.optim.RAdam(ps, lr=1e-2, maximize=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, weight_decay=1e-3),
    "rmsprop-momentum-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9,
                                                                 centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1,
                                              weight_decay=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-3),
    "nadam-decoupled": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2,
                                                    decoupled_weight_decay=True),
    # Rectified from step 6 (betas 0.9, 0.999) and from step 3 (beta2 0.9): both updates run.
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=1e-3),
    "radam-decoupled-early": lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.8, 0.9),
                                                          weight_decay=1e-2,
                                                          decoupled_weight_decay=True),
}


def eager_steps(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        loss_fn(model(x)).backward()
        opt.step()


def assert_same(model_a, opt_a, model_b, opt_b):
    for (n, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6, msg=n)
    assert_same_optimizer_state(opt_a, opt_b)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_state_lives_in_the_optimizer_as_eager_keeps_it(kind):
    xs = batches(4)
    eager = net()
    eager_opt = OPTIMIZERS[kind](eager.parameters())
    eager_steps(eager, eager_opt, xs)
    model = net()
    opt = OPTIMIZERS[kind](model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    for x in xs:
        trainer.step(x)
    assert_same(eager, eager_opt, model, opt)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_checkpoint_resumes_exactly_where_training_was(kind):
    xs = batches(5)
    eager = net()
    eager_opt = OPTIMIZERS[kind](eager.parameters())
    eager_steps(eager, eager_opt, xs)  # five steps, uninterrupted

    first = net()
    first_opt = OPTIMIZERS[kind](first.parameters())
    trainer = ww.optimize(first, (xs[0],), loss_fn, first_opt)
    for x in xs[:3]:
        trainer.step(x)
    checkpoint = copy.deepcopy({"model": first.state_dict(), "opt": first_opt.state_dict()})

    resumed = net()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = OPTIMIZERS[kind](resumed.parameters())
    resumed_opt.load_state_dict(checkpoint["opt"])
    trainer = ww.optimize(resumed, (xs[0],), loss_fn, resumed_opt)
    for x in xs[3:]:
        trainer.step(x)
    assert_same(eager, eager_opt, resumed, resumed_opt)


def test_a_state_loaded_between_steps_is_the_one_trained():
    xs = batches(3)
    eager, model = net(), net()
    eager_opt = OPTIMIZERS["sgd"](eager.parameters())
    opt = OPTIMIZERS["sgd"](model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    eager_steps(eager, eager_opt, xs[:2])
    for x in xs[:2]:
        trainer.step(x)
    reset = copy.deepcopy(eager_opt.state_dict())
    for st in reset["state"].values():
        st["momentum_buffer"].mul_(0.5)  # some other state, loaded into both
    eager_opt.load_state_dict(copy.deepcopy(reset))
    opt.load_state_dict(copy.deepcopy(reset))  # new tensors in opt.state
    eager_steps(eager, eager_opt, xs[2:])
    trainer.step(xs[2])
    assert_same(eager, eager_opt, model, opt)


CHANGES = [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda g: g.update(lr=0.01)),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-3),
     lambda g: g.update(momentum=0.5, dampening=0.2, weight_decay=1e-2, lr=0.3)),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
     lambda g: g.update(lr=0.02, momentum=0.7)),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda g: g.update(lr=1e-3, weight_decay=0.1)),
    (lambda ps: torch.optim.Adam(ps, weight_decay=1e-3), lambda g: g.update(betas=(0.8, 0.99), eps=1e-6)),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.9), lambda g: g.update(alpha=0.9, lr=0.1)),
    (lambda ps: torch.optim.Adagrad(ps), lambda g: g.update(lr=0.5, eps=1e-3)),
    (lambda ps: torch.optim.Adamax(ps), lambda g: g.update(lr=1e-3, betas=(0.8, 0.99))),
    (lambda ps: torch.optim.NAdam(ps), lambda g: g.update(lr=1e-3, momentum_decay=0.01)),
]


@pytest.mark.parametrize("make, change", CHANGES)
@pytest.mark.parametrize("way", ["optimize", "job"])
def test_hyperparameters_that_change_between_steps_are_followed_exactly(make, change, way):
    xs = batches(3)
    eager, model = net(), net()
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    if way == "optimize":
        trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
        step = trainer.step
    else:
        job = ww.Job(model, (xs[0],), loss_fn, opt)
        trainer = ww.ConcurrentTrainer([job])

        def step(x):
            job.step_fn.example = (x,)  # the batch of this step
            trainer.run(1)
            assert job.error is None, job.error
    for i, x in enumerate(xs):
        if i == 1:
            change(eager_opt.param_groups[0])
            change(opt.param_groups[0])
        eager_steps(eager, eager_opt, [x])
        step(x)
    assert_same(eager, eager_opt, model, opt)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.8, 0.9), decoupled_weight_decay=True),
])
def test_decoupled_weight_decay_moves_to_and_from_zero_bit_for_bit(make):
    """Decoupled weight decay multiplies by 1 - lr * wd, exactly 1.0 at zero,
    so the update always holds it: a schedule that starts weight decay at 0,
    raises it and drops it again trains as eager, which skips the
    multiplication at 0, bit for bit."""
    xs = batches(5)
    eager, model = net(), net()
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    for x, wd in zip(xs, [0.0, 0.1, 0.3, 0.0, 0.05]):
        for o in (eager_opt, opt):
            o.param_groups[0]["weight_decay"] = wd
        eager_steps(eager, eager_opt, [x])
        trainer.step(x)
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))
    assert_same_optimizer_state(eager_opt, opt)


SCHEDULED = [
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)), 1e-2 / 6),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), 0.1 / 4),
]


@pytest.mark.parametrize("make, schedule, last_lr", SCHEDULED)
def test_a_learning_rate_schedule_is_followed(make, schedule, last_lr, recwarn):
    xs = batches(5)
    eager, model = net(), net()
    eager_opt, opt = make(eager), make(model)
    scheds = [schedule(o) for o in (eager_opt, opt)]
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    for x in xs:
        eager_steps(eager, eager_opt, [x])
        trainer.step(x)
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(last_lr)
    assert_same(eager, eager_opt, model, opt)
    if isinstance(opt, torch.optim.SGD):  # bit for bit: the constants are eager's alphas
        assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))
    # The scheduler saw the optimizer step, as eagerly: no "scheduler before optimizer" warning.
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("make, change, what", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda g: g.update(momentum=0.9), "momentum != 0"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda g: g.update(nesterov=True),
     "nesterov"),
    (lambda ps: torch.optim.Adam(ps), lambda g: g.update(weight_decay=0.1), "weight_decay != 0"),
    (lambda ps: torch.optim.RMSprop(ps), lambda g: g.update(centered=True), "centered"),
])
def test_a_change_of_the_updates_shape_is_refused_not_ignored(make, change, what):
    xs = batches(2)
    model = net()
    opt = make(model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    trainer.step(xs[0])
    before = [p.detach().clone() for p in model.parameters()]
    change(opt.param_groups[0])
    with pytest.raises(OptimizerError, match=f"{what} is .* captured with .* new one"):
        trainer.step(xs[1])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved


def test_sgds_first_step_with_dampening_is_refused_then_follows_eager():
    xs = batches(3)
    eager, model = net(), net()
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3)  # noqa: E731
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    with pytest.raises(OptimizerError, match="dampening"):
        trainer.step(xs[0])
    eager_steps(eager, eager_opt, xs[:1])
    eager_steps(model, opt, xs[:1])  # the remedy the error names: one eager step first
    eager_steps(eager, eager_opt, xs[1:])
    for x in xs[1:]:
        trainer.step(x)
    assert_same(eager, eager_opt, model, opt)


def test_what_the_update_cannot_do_is_refused():
    model = net()
    x = batches(1)[0]
    # amsgrad set after the first step: torch's Adam finds no max_exp_avg_sq and fails.
    opt = torch.optim.Adam(model.parameters())
    job = ww.Job(model, (x,), loss_fn, opt)
    job.train(1)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(OptimizerError, match="amsgrad was set after the first step"):
        job.train(1)
    eager = net()
    eager_opt = torch.optim.Adam(eager.parameters())
    eager_steps(eager, eager_opt, [x])
    eager_opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        eager_steps(eager, eager_opt, [x])


@pytest.mark.parametrize("make, message", [
    (lambda ps: torch.optim.AdamW(ps, fused=True), r"AdamW\(fused=True\).*rounds differently"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), r"SGD\(fused=True\)"),
    (lambda ps: torch.optim.Adagrad(ps, fused=True), r"Adagrad\(fused=True\)"),
    (lambda ps: torch.optim.Adam(ps, capturable=True), r"capturable=True.*leave capturable"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), r"differentiable=True"),
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01)), r"lr is a Tensor.*lr=float"),
    (lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.01)), r"lr is a Tensor"),
    (lambda ps: torch.optim.Adam(ps, betas=(torch.tensor(0.9), torch.tensor(0.99))),
     r"betas\[0\] is a Tensor.*betas=\(float"),
    # their multi-tensor updates round otherwise on the CPU (1 ulp from step 1)
    (lambda ps: torch.optim.NAdam(ps, foreach=True), r"NAdam\(foreach=True\) on the CPU"),
    (lambda ps: torch.optim.RAdam(ps, foreach=True), r"RAdam\(foreach=True\).*leave foreach"),
])
def test_settings_that_select_another_update_are_refused_at_capture(make, message):
    """Each would make torch's step compute otherwise than the captured
    update (tested: the parameters came out different, silently)."""
    model = net()
    with pytest.raises(CaptureError, match=message):
        ww.capture(model, (batches(1)[0],), loss_fn, make(model.parameters()))


def test_numpy_float64_hyperparameters_train_as_eager_and_float32_is_refused():
    """numpy's float64 is a Python float (it used to break the graph's code:
    its repr is np.float64(...)); its float32 rounds arithmetic in float32."""
    np = pytest.importorskip("numpy")
    model = net()
    with pytest.raises(CaptureError, match="lr is a float32.*lr=float"):
        ww.capture(model, (batches(1)[0],), loss_fn,
                   torch.optim.Adam(model.parameters(), lr=np.float32(1e-2)))
    xs = batches(3)
    eager, model = net(), net()
    make = lambda ps: torch.optim.AdamW(ps, lr=np.float64(1e-2), betas=(np.float64(0.8), 0.99),  # noqa: E731,E501
                                        weight_decay=np.float64(0.1))
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    eager_steps(eager, eager_opt, xs)
    for x in xs:
        trainer.step(x)
    assert_same(eager, eager_opt, model, opt)


class PartlyUnused(torch.nn.Module):
    """A head the loss never reaches, and a scale used without gradient: an
    eager step leaves their .grad None, and optimizer.step() skips them (no
    weight decay, no momentum, no state)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 4)
        self.unused_head = torch.nn.Linear(4, 2)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.body(x) * self.scale.detach()


@pytest.mark.parametrize("way", ["optimize", "train"])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
])
def test_parameters_no_gradient_reaches_are_skipped_as_eager_skips_them(way, make):
    xs = batches(3)
    eager, model = PartlyUnused(), PartlyUnused()
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    for x in xs:
        eager_opt.zero_grad()
        loss_fn(eager(x)).backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        eager_opt.step()
    if way == "optimize":
        trainer = ww.optimize(model, (xs[0],), loss_fn, opt, clip_grad_norm=0.5)
        for x in xs:
            trainer.step(x)
    else:
        job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=[(x,) for x in xs],
                     clip_grad_norm=0.5)
        job.train(3, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert len(opt.state) == 2  # the body's weight and bias, as eager
    assert_same_optimizer_state(eager_opt, opt)


def test_jobs_trained_together_keep_their_state_where_eager_would():
    x = batches(1)[0]
    eagers, jobs = [], []
    for kind in ("sgd", "adam"):
        eager = net()
        eager_opt = OPTIMIZERS[kind](eager.parameters())
        eager_steps(eager, eager_opt, [x] * 3)
        eagers.append((eager, eager_opt))
        model = net()
        jobs.append(ww.Job(model, (x,), loss_fn, OPTIMIZERS[kind](model.parameters())))
    ww.ConcurrentTrainer(jobs).run(3)
    for (eager, eager_opt), job in zip(eagers, jobs):
        assert job.error is None
        assert_same(eager, eager_opt, job.model, job.optimizer)


def test_step_hooks_the_captured_update_would_skip_are_refused():
    xs = batches(2)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    handle = opt.register_step_post_hook(lambda *a: None)
    with pytest.raises(OptimizerError, match="step hook"):
        trainer.step(xs[0])
    handle.remove()
    trainer.step(xs[1])


def test_after_steps_a_hook_or_a_tensor_hyperparameter_is_refused_all_the_same():
    """A captured step checks its optimizer's groups again only where their
    settings changed since the last check (``GroupSettings``): a hook
    registered after steps have run is refused, and so is lr swapped for a
    tensor of the same value, which compares equal to the float but selects
    other code in torch."""
    xs = batches(3)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    trainer.step(xs[0])
    trainer.step(xs[1])
    handle = opt.register_step_pre_hook(lambda *a: None)
    with pytest.raises(OptimizerError, match="step hook"):
        trainer.step(xs[2])
    handle.remove()
    trainer.step(xs[2])
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    with pytest.raises(OptimizerError, match="lr is a Tensor"):
        trainer.step(xs[0])


def test_betas_given_as_a_list_and_changed_in_place_are_followed():
    """Adam's betas as a list, changed in place between steps: the step sees
    the change (its constants follow) and trains as eager does."""
    xs = batches(4)
    model = net()
    eager = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=0.01)
    for o in (opt, eager_opt):
        o.param_groups[0]["betas"] = [0.9, 0.999]  # torch keeps the constructor's as a tuple
    trainer = ww.optimize(model, (xs[0],), loss_fn, opt)
    for k, x in enumerate(xs):
        if k == 2:
            for o in (opt, eager_opt):
                o.param_groups[0]["betas"][0] = 0.5
        trainer.step(x)
        eager_steps(eager, eager_opt, [x])
    assert_same(model, opt, eager, eager_opt)


def eager_clipped(xs, clip):
    """An eager SGD loop over ``xs`` clipping as ``clip`` (Job's settings) says."""
    eager = net()
    eager_opt = OPTIMIZERS["sgd"](eager.parameters())
    for x in xs:
        eager_opt.zero_grad()
        loss_fn(eager(x)).backward()
        if "clip_grad_value" in clip:
            torch.nn.utils.clip_grad_value_(eager.parameters(), clip["clip_grad_value"])
        if "clip_grad_norm" in clip:
            torch.nn.utils.clip_grad_norm_(eager.parameters(), clip["clip_grad_norm"],
                                           norm_type=clip.get("clip_grad_norm_type", 2.0))
        eager_opt.step()
    return eager, eager_opt


@pytest.mark.parametrize("clip", [
    dict(clip_grad_norm=0.05), dict(clip_grad_value=0.01),
    dict(clip_grad_norm=0.05, clip_grad_value=0.01),
    # clip_grad_norm_'s norm_type, "inf" as a string included
    *(dict(clip_grad_norm=0.01, clip_grad_norm_type=t) for t in (1.0, float("inf"), "inf", 3))])
@pytest.mark.parametrize("way", ["optimize", "job"])
def test_gradient_clipping_as_torch_nn_utils_clips(clip, way):
    xs = batches(3)
    eager, eager_opt = eager_clipped(xs, clip)
    model = net()
    opt = OPTIMIZERS["sgd"](model.parameters())
    if way == "optimize":
        trainer = ww.optimize(model, (xs[0],), loss_fn, opt, **clip)
        for x in xs:
            trainer.step(x)
    else:
        job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=[(x,) for x in xs], **clip)
        ww.ConcurrentTrainer([job]).run(3)
        assert job.error is None
    assert_same(eager, eager_opt, model, opt)
    if "clip_grad_norm_type" in clip:  # the norm's order tells: the 2-norm clips otherwise
        euclidean, _ = eager_clipped(xs, {"clip_grad_norm": clip["clip_grad_norm"]})
        assert any(not torch.equal(a, b)
                   for a, b in zip(euclidean.parameters(), model.parameters()))


def test_clipping_settings_are_checked():
    model = net()
    with pytest.raises(OptimizerError, match="max_norm must be a positive number"):
        ww.optimize(model, batches(1), loss_fn, OPTIMIZERS["sgd"](model.parameters()),
                    clip_grad_norm=-1)
    for bad in (float("nan"), True, "two", None):
        with pytest.raises(OptimizerError, match="clip_grad_norm_type must be a number"):
            ww.Job(model, batches(1), loss_fn, OPTIMIZERS["sgd"](model.parameters()),
                   clip_grad_norm=1.0, clip_grad_norm_type=bad)
    frozen = net()
    with pytest.raises(CaptureError, match="which the optimizer does not train"):
        ww.optimize(frozen, batches(1), loss_fn, torch.optim.SGD(frozen[0].parameters(), lr=0.1),
                    clip_grad_norm=1.0)


def test_sgd_without_momentum_leaves_no_state_as_eager():
    """Found by test_exactness: reading optimizer.state (a defaultdict) for
    every parameter left empty entries that eager SGD never makes."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ww.optimize(model, batches(1), loss_fn, opt)
    trainer.step(batches(1)[0])
    assert opt.state_dict()["state"] == {}


def test_an_optimizer_over_parameters_outside_the_model_is_refused():
    """Eager training would update a loss module's temperature or a free
    tensor the optimizer holds; a captured step trains the model's
    parameters, so it says so rather than hold them fixed."""
    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, out):
            return loss_fn(out / self.temperature)

    model, x = net(), batches(1)[0]
    tempered = Tempered()
    opt = torch.optim.SGD([*model.parameters(), *tempered.parameters()], lr=0.1)
    with pytest.raises(CaptureError, match=r"not the model's \(loss_fn\.temperature\).*make "
                                           "them part of the model"):
        ww.Job(model, (x,), tempered, opt)
    scale = torch.nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.Adam([*model.parameters(), scale])
    with pytest.raises(CaptureError, match=r"a tensor of shape \[\]"):
        ww.optimize(model, (x,), lambda out: loss_fn(out * scale), opt)


@pytest.mark.parametrize("how", ["job", "trainer"])
@pytest.mark.parametrize("make, schedule", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2),
     lambda o: [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4)]),
    # cycles SGD's momentum too, and an epoch scheduler's step is the caller's
    (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
     lambda o: [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=12)]),
])
def test_step_schedulers_step_after_every_step_as_an_eager_loop(make, schedule, how):
    """A per-batch scheduler (warm-up, OneCycleLR) in an eager loop steps
    after every optimizer.step(); Job(step_schedulers=...) steps it after
    every step, inside one train() call (train(1) a step would read each
    loss back: a host sync a step on a GPU)."""
    xs = batches(4)
    eager, model = net(), net()
    eager_opt, opt = make(eager.parameters()), make(model.parameters())
    eager_scheds, scheds = schedule(eager_opt), schedule(opt)
    expected = []
    for x in xs * 3:
        eager_opt.zero_grad()
        loss = loss_fn(eager(x))
        loss.backward()
        eager_opt.step()
        for s in eager_scheds:
            s.step()
        expected.append(loss.item())
    job = ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs], step_schedulers=scheds)
    if how == "job":
        got = job.train(5) + job.train(7)
    else:
        trainer = ww.ConcurrentTrainer([job])
        trainer.run(5)
        trainer.run(7)
        got = job.losses
    assert got == expected
    assert opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]
    assert all(a.state_dict() == b.state_dict() for a, b in zip(eager_scheds, scheds))
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_bad_step_schedulers_are_clear_errors():
    model, x = net(), batches(1)[0]
    opt, other = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(net().parameters(),
                                                                             lr=0.1)
    for schedulers, message in [
        ([torch.optim.lr_scheduler.ReduceLROnPlateau(opt)], "steps on a metric"),
        ([torch.optim.lr_scheduler.StepLR(other, 1)], "another optimizer"),
        (torch.optim.lr_scheduler.StepLR(opt, 1), "must be a list"),
        ([0.5], "has no step"),
    ]:
        with pytest.raises(ValueError, match=message):
            ww.Job(model, (x,), loss_fn, opt, step_schedulers=schedulers)
