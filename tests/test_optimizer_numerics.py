"""A captured step's update is torch.optim's own, number for number: every
optimizer against its ``step``, bit for bit, at every float type, with the
step counted on the device (a GradScaler's), over complex parameters, and
with foreach set on the CPU."""
import pytest

torch = pytest.importorskip("torch")

from test_optimizer_state import OPTIMIZERS, batches, eager_steps, loss_fn, net  # noqa: E402

import waterwave as ww  # noqa: E402
from conftest import PLANNING_LIMIT  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_every_optimizer_matches_torchs_step_bit_for_bit(kind):
    """On the CPU the captured update runs the operators torch's single-tensor
    implementation runs, in its order, with its scalars: equal, not close.
    RAdam runs 8 steps: plain in its first 5, rectified after."""
    xs = batches(8 if kind.startswith("radam") else 6)
    eager = net()
    eager_opt = OPTIMIZERS[kind](eager.parameters())
    eager_steps(eager, eager_opt, xs)
    model = net()
    opt = OPTIMIZERS[kind](model.parameters())
    job = ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs])
    job.train(len(xs), session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a, b), (kind, name, (a - b).abs().max().item())
    for a, b in zip(eager.parameters(), model.parameters()):
        for key, value in eager_opt.state[a].items():
            assert torch.equal(torch.as_tensor(opt.state[b][key]), torch.as_tensor(value)), key


HALF_SAFE = {  # float16 parameters: an eps that float16 holds (1e-8 is 0 there, as eagerly)
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4, amsgrad=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, eps=1e-4),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, eps=1e-4),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, eps=1e-4, momentum=0.5),
}


@pytest.mark.parametrize("dtype, kind", [
    *[(torch.float64, k) for k in OPTIMIZERS], *[(torch.bfloat16, k) for k in OPTIMIZERS],
    *[(torch.float16, k) for k in HALF_SAFE]])
def test_parameters_of_every_float_type_update_as_torchs_step(dtype, kind):
    """A model kept in float64, bfloat16 or float16 (no autocast) steps as
    torch's single-tensor update does for that type: the bias corrections
    read at the parameters' precision (float64 for float64), and an update
    torch writes as one addcdiv_ computed in float32 for half types and
    rounded once."""
    make = (HALF_SAFE if dtype == torch.float16 else OPTIMIZERS)[kind]
    xs = [x.to(dtype) for x in batches(6)]
    eager = net().to(dtype)
    eager_opt = make(eager.parameters())
    model = net().to(dtype)
    opt = make(model.parameters())
    eager_steps(eager, eager_opt, xs)
    job = ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs])
    job.train(len(xs), session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    assert all(torch.isfinite(p).all() for p in eager.parameters())
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a, b), (name, (a.double() - b.double()).abs().max().item())
    for a, b in zip(eager.parameters(), model.parameters()):
        for key, value in eager_opt.state[a].items():
            assert torch.equal(torch.as_tensor(opt.state[b][key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["adam", "adamax", "nadam", "radam"])
def test_device_counted_steps_serve_every_float_type(kind, dtype):
    """With a GradScaler the bias corrections are computed inside the step
    (``optimizers.device_math.adam_corrections`` and its kin), in float64, and read at
    the parameters' precision; NAdam's mu_product stays a 0-d float32 as
    eager keeps it (the trace once took it as a parameter-shaped tensor, and
    float64 models drifted)."""
    xs = [x.to(dtype) for x in batches(6)]
    eager, model = net().to(dtype), net().to(dtype)
    eager_opt, opt = OPTIMIZERS[kind](eager.parameters()), OPTIMIZERS[kind](model.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    for x in xs:
        eager_opt.zero_grad()
        scalers[0].scale(loss_fn(eager(x))).backward()
        scalers[0].step(eager_opt)
        scalers[0].update()
    job = ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs], grad_scaler=scalers[1])
    job.train(len(xs), session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a, b), (name, (a.double() - b.double()).abs().max().item())
    assert scalers[0].get_scale() == scalers[1].get_scale()


class ComplexNet(torch.nn.Module):
    """A complex weight (its modulus feeds a real head) beside a real one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.weight = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.cfloat, generator=g))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head((x.to(torch.cfloat) @ self.weight).abs())


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_complex_parameters_update_as_torchs_step(kind):
    """torch's updates view a complex parameter, its gradient and its state
    as real pairs (SGD excepted), where each optimizer does: the captured
    update too, bit for bit (it computed complex squares and roots)."""
    xs = batches(6)
    torch.manual_seed(0)
    eager = ComplexNet()
    torch.manual_seed(0)
    model = ComplexNet()
    eager_opt, opt = OPTIMIZERS[kind](eager.parameters()), OPTIMIZERS[kind](model.parameters())
    eager_steps(eager, eager_opt, xs)
    job = ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs])
    job.train(len(xs), session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))

    def identical(a, b):  # bit for bit, NaN where eager's is (SGD maximizing runs away)
        torch.testing.assert_close(torch.as_tensor(b), torch.as_tensor(a), rtol=0, atol=0,
                                   equal_nan=True)

    for a, b in zip(eager.parameters(), model.parameters()):
        identical(a.detach(), b.detach())
        for key, value in eager_opt.state[a].items():
            identical(value, opt.state[b][key])


FOREACH = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      weight_decay=1e-3, maximize=True, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, amsgrad=True,
                                        foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True,
                                              foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                              foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-3, foreach=True),
}


@pytest.mark.parametrize("kind", FOREACH)
def test_foreach_updates_on_the_cpu_match_bit_for_bit(kind):
    """torch's multi-tensor (foreach=True) update of these optimizers rounds
    as the single-tensor one on the CPU: accepted, and exact (NAdam's and
    RAdam's do not, and are refused above)."""
    xs = batches(6)
    eager, model = net(), net()
    eager_opt, opt = FOREACH[kind](eager.parameters()), FOREACH[kind](model.parameters())
    eager_steps(eager, eager_opt, xs)
    ww.Job(model, (xs[0],), loss_fn, opt, data=[(x,) for x in xs]).train(len(xs))
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a, b)
