"""``waterwave.optimize``: training in the planned order gives the same loss
and parameters as eager PyTorch training."""
import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

from waterwave.exec import optimize


def train_both(model, make_opt, batches, loss_fn, strategy="greedy"):
    eager = copy.deepcopy(model)
    opt = make_opt(eager)
    planned = copy.deepcopy(model)
    trainer = optimize(planned, (batches[0],), loss_fn, make_opt(planned), strategy=strategy)
    for x in batches:
        opt.zero_grad()
        l1 = loss_fn(eager(x))
        l1.backward()
        opt.step()
        l2 = trainer.step(x)
        torch.testing.assert_close(l2, l1.detach(), rtol=1e-5, atol=1e-6)
    for (n, p1), p2 in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(p2, p1.detach(), rtol=1e-4, atol=1e-5, msg=n)
    for (n, b1), b2 in zip(eager.named_buffers(), planned.buffers()):
        torch.testing.assert_close(b2, b1, rtol=1e-4, atol=1e-5, msg=n)
    return trainer


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8))


def square(out):
    return out.square().mean()


def batches(shape, n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def test_sgd_momentum_weight_decay_matches_eager():
    train_both(mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                weight_decay=1e-3), batches((16, 32)), square)


def mlp_plain():
    # No BatchNorm after a bias here: such a bias has a zero true gradient,
    # and Adam turns its rounding noise into full-size updates whose sign
    # depends on the order of floating-point operations.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_adam_matches_eager_across_steps(cls):
    # Bias corrections change each step: they are inputs, not constants.
    make = lambda m: getattr(torch.optim, cls)(m.parameters(), lr=1e-2, weight_decay=1e-2)
    train_both(mlp_plain(), make, batches((16, 32), n=4), square)


def test_resnet_in_a_reordered_schedule_matches_eager():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    trainer = train_both(model, make, batches((2, 3, 32, 32), n=2), square)
    program = [n.name for n in trainer.graph.nodes]
    assert trainer.order != program  # the plan really changed the order
    assert trainer.plan.arena_size < __import__("waterwave.planner", fromlist=["plan"]).plan(
        trainer.graph, "pytorch").arena_size


def test_planned_in_place_operators_run_in_place_and_match_eager():
    """Sigmoid and tanh may overwrite their inputs, which die there: the plan
    shares those storages, and the trainer runs the operators in place
    (aten.sigmoid_ on the linear layer's output) with eager's results."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Sigmoid(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 8))
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    trainer = train_both(model, make, batches((16, 32)), square)
    assert trainer.plan.inplace
    assert trainer.plan.arena_size < trainer.plan.stats["arena_without_inplace"]
    ran_in_place = {str(n.target) for n in trainer.module.graph.nodes if n.op == "call_function"}
    assert "aten.sigmoid_.default" in ran_in_place and "aten.tanh_.default" in ran_in_place


def groups_by_kind(model):
    """Two parameter groups, as training recipes often have them: weight
    decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return decay, rest


def test_sgd_with_two_parameter_groups_matches_eager():
    """Each group's own learning rate, momentum (none in one) and weight
    decay; a group without momentum keeps no momentum buffers."""
    def make(m):
        decay, rest = groups_by_kind(m)
        return torch.optim.SGD([{"params": decay, "weight_decay": 1e-2, "momentum": 0.9},
                                {"params": rest, "lr": 0.01}], lr=0.05)
    trainer = train_both(mlp(), make, batches((16, 32)), square)
    states = [t for t in trainer.graph.tensors if t.kind == "optimizer_state"]
    assert len(states) == len(groups_by_kind(trainer.model)[0])  # momentum for the decay group only


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_adam_with_two_parameter_groups_matches_eager(cls):
    def make(m):
        decay, rest = groups_by_kind(m)
        return getattr(torch.optim, cls)([{"params": decay, "weight_decay": 1e-2},
                                          {"params": rest, "weight_decay": 0.0, "lr": 3e-3,
                                           "betas": (0.8, 0.99)}], lr=1e-2)
    train_both(mlp_plain(), make, batches((16, 32), n=4), square)


def test_a_loss_with_targets_matches_eager():
    """Classification as people write it: cross entropy against labels,
    which are graph inputs like the batch."""
    model = mlp()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    opt = make(eager)
    xs = batches((16, 32))
    labels = [torch.randint(0, 8, (16,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    loss_fn = torch.nn.functional.cross_entropy
    trainer = optimize(planned, (xs[0],), loss_fn, make(planned), example_targets=labels[0])
    assert sum(t.kind == "input" for t in trainer.graph.tensors) == 2  # the batch and its labels
    for x, y in zip(xs, labels):
        opt.zero_grad()
        l1 = loss_fn(eager(x), y)
        l1.backward()
        opt.step()
        torch.testing.assert_close(trainer.step(x, targets=y), l1.detach(), rtol=1e-5, atol=1e-6)
    for p1, p2 in zip(eager.parameters(), planned.parameters()):
        torch.testing.assert_close(p2, p1.detach(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pass targets= to step"):
        trainer.step(xs[0])


@pytest.mark.parametrize("arena_fits", [True, False])
def test_planned_steps_warm_up_record_then_follow_the_plan(monkeypatch, arena_fits):
    """The trainer's GPU schedule, with waterwave.cuda stubbed (the real
    calls are covered by the fake-driver and GPU tests): step 1 warms up,
    step 2 is recorded and becomes the plan, later steps begin planned
    steps. An arena that does not fit costs the plan, never a step."""
    import waterwave as ww
    from waterwave import cuda
    from waterwave.exec import trainer as trainer_module

    calls = []
    monkeypatch.setattr(cuda, "start_recording", lambda device: calls.append("record"))
    monkeypatch.setattr(cuda, "stop_recording", lambda device: calls.append("stop") or [(512, 0, 1)])
    monkeypatch.setattr(trainer_module, "plan_from_trace",
                        lambda trace: ([(512, 0)], 512, {"bound": 512, "status": "optimal"}))

    def set_plan(slots, arena, device, scope):
        assert scope == "device"  # the plan is the step's, whatever stream allocates
        calls.append("set_plan")
        if not arena_fits:
            raise ww.OutOfMemoryError("out of memory: the plan's arena does not fit")

    monkeypatch.setattr(cuda, "set_plan", set_plan)
    monkeypatch.setattr(cuda, "begin_step", lambda device: calls.append("begin"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    eager = copy.deepcopy(net)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    trainer = optimize(net, (x,), lambda out: out.square().mean(),
                       torch.optim.SGD(net.parameters(), lr=0.1))
    trainer._plan_device, trainer._loss_to_cpu = 0, True  # as on a GPU with the allocator
    with pytest.warns(UserWarning, match="without the plan") if not arena_fits else \
            contextlib.nullcontext():
        for _ in range(4):
            opt.zero_grad()
            loss = eager(x).square().mean()
            loss.backward()
            opt.step()
            torch.testing.assert_close(trainer.step(x), loss.detach())
    if arena_fits:
        assert calls == ["record", "stop", "set_plan", "begin", "begin"]
        assert trainer.trace_plan["status"] == "optimal" and trainer.planned_device == 0
    else:
        assert calls == ["record", "stop", "set_plan"] and trainer.planned_device is None
