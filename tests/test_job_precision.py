"""Jobs train with the eager loop's precision and accumulation settings:
gradient accumulation over k batches, autocast's mixed precision, and a
GradScaler that scales, skips and updates as eager's does, without a host
sync; each against the loop people write."""
import copy

import pytest

torch = pytest.importorskip("torch")

from test_job_data import dataset, eager, loss_fn, net  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import waterwave as ww  # noqa: E402
from waterwave.capturing.fake_step import CaptureError  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


@pytest.mark.parametrize("how", ["trainer", "train", "optimize"])
def test_gradient_accumulation_over_k_batches_trains_as_the_eager_loop(how):
    """accumulate_grad_batches=3: each step is three batches, each loss / 3
    backpropagated, the gradients summed, clipped, one update; two epochs
    of six batches, shuffled, against the loop people write."""
    k = 3

    def loader():
        return DataLoader(dataset(n=48), batch_size=8, shuffle=True,
                          generator=torch.Generator().manual_seed(5))

    model = net(0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    expected, pending = [], []
    ref_data = loader()
    for _ in range(2):
        for i, (x, y) in enumerate(ref_data):
            loss = loss_fn(reference(x), y)
            (loss / k).backward()
            pending.append(loss.detach())
            if (i + 1) % k == 0:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
                ref_opt.step()
                ref_opt.zero_grad()
                expected.append((sum(pending[1:], pending[0]) / k).item())
                pending = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    if how == "optimize":  # waterwave.optimize's trainer: a step takes the k batches
        data = loader()
        x0, y0 = next(iter(loader()))
        trainer = ww.optimize(model, (x0,), loss_fn, opt, example_targets=(y0,),
                              accumulate_grad_batches=k, clip_grad_norm=0.5)
        got = []
        for _ in range(2):
            batches = list(data)
            for i in range(0, len(batches), k):
                xs, ys = zip(*batches[i:i + k])
                got.append(trainer.step(*xs, targets=ys).item())
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a, b)
        return
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=loader(), accumulate_grad_batches=k,
                 clip_grad_norm=0.5)
    if how == "trainer":
        ww.ConcurrentTrainer([job], memory_limit=1 << 20).run(4)
        got = job.losses
    else:
        got = job.train(2, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)) + job.train(2)
    assert job.error is None and len(got) == 4
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(ref_opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])


@pytest.mark.parametrize("args, message", [
    ({"accumulate_grad_batches": 0}, "at least 1"),
    ({"accumulate_grad_batches": 2, "data": None}, "needs data"),
    ({"accumulate_grad_batches": 4}, "not a multiple of accumulate_grad_batches=4"),
])
def test_bad_accumulation_is_a_clear_error(args, message):
    model = net(0)
    kwargs = {"data": list(DataLoader(dataset(n=24), batch_size=8)), **args}  # 3 batches
    example = (torch.randn(8, 16),) if kwargs["data"] is None else None
    with pytest.raises(ValueError, match=message):
        ww.Job(model, example, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_runs_the_forward_pass_in_autocast_as_eager(dtype):
    """autocast_dtype: the forward pass and the loss inside torch.autocast,
    backward and the update outside, as the eager loop runs them."""
    dtype = getattr(torch, dtype)
    data = list(DataLoader(dataset(n=24), batch_size=8))
    model = net(0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for i in range(5):
        x, y = data[i % 3]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data, autocast_dtype=dtype)
    assert any("bfloat16" in n.op or n.op.startswith("aten._to_copy") for n in job.graph.nodes)
    got = job.train(5, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    assert got == expected
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    other = net(1)
    with pytest.raises(CaptureError, match="autocast_dtype must be"):
        ww.Job(other, loss_fn=loss_fn, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
               data=data, autocast_dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast around train(): the fix named
        with pytest.raises(ww.capturing.guards.StaleCaptureError, match="autocast_dtype="):
            job.train(1, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))


def test_optimize_and_capture_take_autocast_too():
    data = list(DataLoader(dataset(n=16), batch_size=8))
    model = net(0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ww.optimize(model, (data[0][0],), loss_fn, opt, example_targets=(data[0][1],),
                          autocast_dtype=torch.bfloat16)
    for x, y in data * 2:
        trainer.step(x, targets=(y,))
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    full = ww.capture(net(0), (data[0][0],), loss_fn, targets=(data[0][1],))
    half = ww.capture(net(0), (data[0][0],), loss_fn, targets=(data[0][1],),
                      autocast_dtype=torch.bfloat16)
    assert half.meta["kernels"] == full.meta["kernels"]
    assert len(half.nodes) > len(full.nodes)  # the casts autocast adds


def test_a_batch_the_model_cannot_take_raises_as_the_eager_loop_would():
    data = [(torch.randn(4, 16), torch.randint(0, 4, (4,))),
            (torch.randn(4, 7), torch.randint(0, 4, (4,)))]  # 7 features, not 16
    model = net(0)
    job = ww.Job(model, loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 data=data)
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied \(4x7 and 16x"):
        job.train(2, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))


SCALED = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
          "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
          "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
          # its running maximum is undone with the rest of a skipped step
          "adam-amsgrad-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True,
                                                               maximize=True),
          "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
          "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=1e-3),
          "adagrad-lr-decay": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05),
          "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-3),
          "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-3),
          # 6 steps counted (one skipped): plain for 5, rectified at the 6th
          "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=1e-3)}


@pytest.mark.parametrize("how", ["job", "optimize"])
@pytest.mark.parametrize("kind", SCALED)
def test_a_grad_scaler_scales_skips_and_updates_as_eager_without_a_host_sync(kind, how):
    """float16 autocast with a GradScaler: the eager recipe (scale, backward,
    unscale_, clip, step, update), against Job(grad_scaler=...). One batch
    holds an inf, so that step is skipped and the scale backs off; the
    scale grows after growth_interval good steps."""
    data = list(DataLoader(dataset(n=24), batch_size=8))
    bad = data[1][0].clone()
    bad[0, 0] = float("inf")
    data = [data[0], (bad, data[1][1]), data[2]]
    model = net(0)
    reference = copy.deepcopy(model)

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)

    ref_opt = SCALED[kind](reference.parameters())
    ref_scaler, expected, scales = scaler(), [], []
    for i in range(7):
        x, y = data[i % 3]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(reference(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        expected.append(loss.item())
        scales.append(ref_scaler.get_scale())
    assert len(set(scales)) > 1  # it backed off, and grew
    opt, our_scaler = SCALED[kind](model.parameters()), scaler()
    if how == "optimize":
        trainer = ww.optimize(model, (data[0][0],), loss_fn, opt, example_targets=(data[0][1],),
                              autocast_dtype=torch.float16, grad_scaler=our_scaler,
                              clip_grad_norm=1.0)
        got = [trainer.step(data[i % 3][0], targets=data[i % 3][1]).item() for i in range(7)]
    else:
        job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data,
                     autocast_dtype=torch.float16, grad_scaler=our_scaler, clip_grad_norm=1.0)
        got = job.train(7, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert our_scaler.get_scale() == ref_scaler.get_scale()
    assert our_scaler.state_dict() == ref_scaler.state_dict()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
        for key, value in ref_opt.state[a].items():  # Adam's step: the skipped one not counted
            assert torch.equal(torch.as_tensor(opt.state[b][key]), value), key



def _state_as_eager(ref_opt, opt, reference, model):
    """The two optimizers hold state for the same parameters, and equal state."""
    assert [a in ref_opt.state for a in reference.parameters()] == [
        b in opt.state for b in model.parameters()]
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
        if a in ref_opt.state:
            assert ref_opt.state[a].keys() == opt.state[b].keys()
            for key, value in ref_opt.state[a].items():
                assert torch.equal(torch.as_tensor(opt.state[b][key]), torch.as_tensor(value))


@pytest.mark.parametrize("how", ["job", "optimize"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adagrad", "nadam"])
def test_steps_a_grad_scaler_skipped_leave_no_optimizer_state_as_eager_leaves_none(kind, how):
    """A GradScaler skips a step whose gradients hold an inf (common in a
    float16 run's first steps, while the scale settles), and eager then
    never calls optimizer.step(): the optimizer makes no state. A call whose
    every step was skipped leaves none either; the next call's good step
    makes it, as eager's first real step does."""
    data = list(DataLoader(dataset(n=16), batch_size=8))
    bad = data[0][0].clone()
    bad[0, 0] = float("inf")
    data = [(bad, data[0][1]), data[1]]
    model = net(0)
    reference = copy.deepcopy(model)

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)

    ref_opt, ref_scaler = SCALED[kind](reference.parameters()), scaler()
    opt, our_scaler = SCALED[kind](model.parameters()), scaler()
    if how == "optimize":
        trainer = ww.optimize(model, (data[1][0],), loss_fn, opt, example_targets=(data[1][1],),
                              autocast_dtype=torch.float16, grad_scaler=our_scaler)

        def train_one(i):
            return trainer.step(data[i][0], targets=data[i][1]).item()
    else:
        job = ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data,
                     autocast_dtype=torch.float16, grad_scaler=our_scaler)
        session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)

        def train_one(i):
            return job.train(1, session=session)[0]
    for i in range(2):  # the first step is skipped, the second is not
        x, y = data[i]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(reference(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        got = train_one(i)
        torch.testing.assert_close(got, loss.item(), equal_nan=True)
        assert our_scaler.state_dict() == ref_scaler.state_dict()
        # Eager makes no state until a good step (Adagrad's, when it is made).
        assert kind == "adagrad" or (len(ref_opt.state) == 0) == (i == 0)
        _state_as_eager(ref_opt, opt, reference, model)


def test_a_grad_scaler_over_float16_parameters_is_refused_as_eager_refuses_it():
    model = net(0).half()
    x, y = torch.randn(4, 16).half(), torch.randint(0, 4, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="unscale FP16"):  # eagerly
        scaler.scale(loss_fn(model(x).float(), y)).backward()
        scaler.step(opt)
    with pytest.raises(CaptureError, match=r"parameter 0\.weight is float16.*autocast_dtype"):
        ww.Job(model, loss_fn=lambda out, y: loss_fn(out.float(), y), optimizer=opt,
               data=[(x, y)], grad_scaler=torch.amp.GradScaler("cpu"))
