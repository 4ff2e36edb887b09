"""Capturing real training steps on the CPU with fake tensors."""
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

from waterwave.capturing import CaptureError, capture  # noqa: E402
from waterwave.graph import Graph  # noqa: E402
from waterwave.planner import check_plan, plan  # noqa: E402
from waterwave.planner.baseline import replay  # noqa: E402


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_adam_step_has_persistent_moments_and_inplace_updates():
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = capture(m, (torch.randn(32, 64),), lambda o: o.square().mean(), opt)
    kinds = {}
    for t in g.tensors:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    # 4 x (exp_avg, exp_avg_sq), plus Adam's two per-step scalars
    assert kinds["param"] == 4 and kinds["optimizer_state"] == 10 and kinds["input"] == 1
    assert kinds["grad"] == 4
    assert all(t.persistent for t in g.tensors if t.kind in ("param", "optimizer_state"))
    # Weight sizes: 128x64 floats = 32 KiB, rounded to 512.
    w = next(t for t in g.tensors if t.name == "0.weight")
    assert w.size == 128 * 64 * 4
    bias = next(t for t in g.tensors if t.name == "2.bias")
    assert bias.size == 512  # 40 bytes, rounded as the CUDA caching allocator does
    # Every parameter is updated in place, after all its readers.
    updated = {t for n in g.nodes for t in n.mutates}
    assert {t.id for t in g.tensors if t.kind == "param"} <= updated
    for n in g.nodes:
        for t in n.mutates:
            readers = [r.id for r in g.nodes if t in r.inputs and r.id < n.id and r.id != n.id
                       and not r.mutates]
            for r in readers:
                assert r in n.deps or r in _ancestors(g, n.id)
    # The loss is kept as a graph output.
    assert len(g.meta["outputs"]) == 1


def _ancestors(g, v):
    seen, stack = set(), [v]
    while stack:
        for p in g.preds(stack.pop()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def test_views_add_no_tensors_and_pointwise_ops_allow_inplace():
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 8), torch.nn.ReLU())
    g = capture(m, (torch.randn(4, 3, 4, 4),), None, torch.optim.SGD(m.parameters(), lr=0.1))
    assert not any("view" in n.op or "t.default" == n.op.split("aten.")[-1] for n in g.nodes)
    relu = next(n for n in g.nodes if "relu" in n.op)
    assert relu.inplace_ok == [relu.inputs[0]]  # pointwise, same size, and aten.relu_ exists
    # Pointwise too, but with no in-place overload the runtime could run.
    backward = next(n for n in g.nodes if "threshold_backward" in n.op)
    assert backward.inplace_ok == []


def test_resnet18_train_step_round_trips_and_plans(tmp_path):
    m = torchvision.models.resnet18()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    g = capture(m, (torch.randn(2, 3, 64, 64),), None, opt, name="resnet18")
    params = sum(p.numel() for p in m.parameters())
    persistent = sum(t.size for t in g.tensors if t.kind in ("param", "optimizer_state"))
    assert persistent >= 2 * params * 4  # weights + momentum, before rounding
    assert sum(1 for t in g.tensors if t.kind == "buffer") == 60  # BN running stats
    g.save(tmp_path / "r.json")
    g2 = Graph.load(tmp_path / "r.json")
    for strategy in ("pytorch", "greedy", "mxnet", "paddle"):
        check_plan(g2, plan(g2, strategy))
    base = replay(g2)
    assert plan(g2, "greedy").arena_size < base.peak_reserved


def test_unsupported_optimizer_is_a_clear_error():
    m = mlp()
    with pytest.raises(CaptureError, match="supports the optimizers"):
        capture(m, (torch.randn(2, 64),), None, torch.optim.LBFGS(m.parameters()))


@pytest.mark.parametrize("loss_fn, message", [
    (lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
     r"the loss has shape \[2\].*reduce it"),
    (lambda out, y: (torch.nn.functional.cross_entropy(out, y), {"acc": 1.0}),
     r"returned a tuple.*the loss tensor alone"),
])
def test_a_loss_that_is_not_one_number_is_a_clear_error(loss_fn, message):
    m = mlp()
    with pytest.raises(CaptureError, match=message):
        capture(m, (torch.randn(2, 64),), loss_fn, targets=torch.tensor([0, 1]))


def test_no_real_memory_is_used_for_activations():
    # A batch whose activations would need ~6 GiB is captured without them.
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8))
    x = torch.empty(1, 1024).expand(200_000, 1024)  # no real memory behind the batch
    g = capture(m, (x,), None, torch.optim.SGD(m.parameters(), lr=0.1))
    biggest = max(t.size for t in g.tensors)
    assert biggest >= 200_000 * 4096 * 4


def test_targets_need_a_loss_function():
    m = mlp()
    with pytest.raises(CaptureError, match="targets need a loss_fn"):
        capture(m, (torch.randn(2, 64),), None, torch.optim.SGD(m.parameters(), lr=0.1),
                targets=torch.zeros(2, dtype=torch.long))
