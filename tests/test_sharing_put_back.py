"""A sharing job's step that runs out of memory before its update is undone
and runs again, its passes alone (``job_loop.run_free``,
``rollback.StepStart``, ``Member.run_alone``): the job then trains exactly
as its eager loop. On the CPU a memory limit makes the session gate its
members, and a module's hook raises ``torch.OutOfMemoryError`` where the
allocator would."""
import copy
import importlib
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from test_probe_rollback import Twin  # noqa: E402
from waterwave.exec.batches import BatchFeed  # noqa: E402
from waterwave.pipeline.pass_profile import ALONE_PASSES  # noqa: E402

LIMIT = 64 << 20


def run_out(module, at, where: str = "forward"):
    """``module`` raises the allocator's out-of-memory error at its
    ``at``-th call (1: the first; or at each of a tuple of calls), in its
    forward or its backward, or, ``module`` an optimizer, in its step;
    returns the calls seen."""
    calls = {"n": 0}
    at = at if isinstance(at, tuple) else (at,)

    def hook(*_):
        calls["n"] += 1
        if calls["n"] in at:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    register = {"forward": "register_forward_pre_hook",
                "backward": "register_full_backward_pre_hook",
                "step": "register_step_pre_hook"}[where]
    getattr(module, register)(hook)
    return calls


def session():
    return ww.TrainingSession("cpu", memory_limit=LIMIT)


@pytest.mark.parametrize("where, accumulate", [("forward", 1), ("backward", 1),
                                               ("forward", 2)])
def test_a_step_that_runs_out_before_its_update_runs_again_alone(where, accumulate):
    """The job's third step runs out in its last layer's forward (batch
    norm's statistics moved already) or in its backward (some gradients
    made): undone, it trains 6 steps as its eager loop (losses, parameters,
    batch norm's statistics, Adam's state, the scheduler), its passes alone
    after that step, and the session counts one step put back."""
    s = session()
    twin = Twin(3, 24, accumulate=accumulate)
    calls = run_out(twin.job.model[3], at=3 * accumulate if where == "forward" else 3, where=where)
    twin.job.train(6, session=s)
    twin.check(6)
    assert calls["n"] == 7 * accumulate  # the undone step's calls, and 6 steps'
    assert s.stats()["put_back"] == 1
    # Its passes after the undone one ran alone: the rerun and the 3 after.
    assert member_of(twin.job.model).stats()["alone_passes"] == 4 * accumulate


def test_a_step_undone_beside_another_job_and_both_train_as_their_eager_loops():
    """Two jobs train in threads under one limit; one's step runs out twice
    in its forward, in two calls: each is undone and run again, and both
    jobs match their eager loops."""
    s = session()
    a, b = Twin(4, 24), Twin(5, 40)
    run_out(b.job.model[3], at=(2, 8))
    errors = []

    def trial(twin):
        try:
            for _ in range(2):
                twin.job.train(4, session=s)
        except BaseException as e:  # the test's failure, reported below
            errors.append(e)

    threads = [threading.Thread(target=trial, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    a.check(8)
    b.check(8)
    assert s.stats()["put_back"] == 2


def test_a_step_that_runs_out_in_its_update_stops_the_job():
    """Adam's update has begun (some state may be written): the step is not
    undone, and ``train`` raises the out-of-memory error."""
    s = session()
    twin = Twin(6, 24)
    run_out(twin.job.optimizer, at=2, where="step")
    with pytest.raises(torch.OutOfMemoryError):
        twin.job.train(4, session=s)
    assert s.stats()["put_back"] == 0
    assert len(twin.job.losses) == 1
    assert not twin.job.updating


def test_a_step_that_runs_out_again_alone_stops_the_job():
    """Undone once, the step runs alone; run out there too, the job stops
    with the error, its first step kept."""
    s = session()
    twin = Twin(7, 24)
    calls = run_out(twin.job.model[3], at=2)
    run_out(twin.job.model[3], at=2)  # its count starts after the first's undone call
    with pytest.raises(torch.OutOfMemoryError):
        twin.job.train(4, session=s)
    assert calls["n"] == 3
    assert s.stats()["put_back"] == 1
    assert len(twin.job.losses) == 1


def test_without_a_budget_nothing_is_undone():
    """With no budget (a CPU session without a limit) nothing is gated, and
    an out-of-memory error stops the job as in any loop."""
    s = ww.TrainingSession("cpu")
    twin = Twin(8, 24)
    run_out(twin.job.model[3], at=2)
    with pytest.raises(torch.OutOfMemoryError):
        twin.job.train(4, session=s)
    assert s.stats()["put_back"] == 0


def test_a_batch_given_again_comes_next():
    feed = BatchFeed([(torch.full((1,), float(k)),) for k in range(3)])
    first = feed.next()[0][0].item()
    feed.again()
    assert [feed.next()[0][0].item() for _ in range(3)] == [first, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="again"):
        feed.again()
        feed.again()


@given(step=st.integers(1, 5), layer=st.integers(0, 3), where=st.sampled_from(["forward",
                                                                             "backward"]),
       accumulate=st.integers(1, 2), seed=st.integers(0, 50))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_step_undone_before_its_update_trains_as_the_eager_loop(step, layer, where,
                                                                    accumulate, seed):
    """Out of memory at any layer's forward or backward, in any step of 6,
    with or without accumulated batches: the job still trains as its eager
    loop, one step put back."""
    s = session()
    twin = Twin(seed, 16 + seed % 5 * 8, accumulate=accumulate)
    module = twin.job.model[layer]  # its forward and its backward run once a batch
    calls = run_out(module, at=(step - 1) * accumulate + 1, where=where)
    twin.job.train(6, session=s)
    twin.check(6)
    assert calls["n"] == 6 * accumulate + 1
    assert s.stats()["put_back"] == 1


@pytest.mark.parametrize("norm", [torch.nn.BatchNorm1d, torch.nn.LayerNorm])
def test_a_job_without_data_undoes_its_step_too(norm):
    """A job that trains on its example batch every step (no data): the
    undone step has no batch to give back, and the job trains as its loop;
    with layer norm, a model with no buffers to put back."""
    s = session()
    torch.manual_seed(9)
    net = torch.nn.Sequential(torch.nn.Linear(12, 20), norm(20), torch.nn.ReLU(),
                              torch.nn.Linear(20, 3))
    eager = copy.deepcopy(net)
    x, y = torch.randn(16, 12), torch.randint(0, 3, (16,))
    job = ww.Job(net, (x,), torch.nn.functional.cross_entropy,
                 torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), targets=(y,))
    run_out(net[3], at=2)
    losses = job.train(4, session=s)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for _ in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(eager(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
    for a, b in zip(eager.state_dict().values(), net.state_dict().values()):
        torch.testing.assert_close(b, a)
    assert s.stats()["put_back"] == 1


def test_after_its_passes_alone_the_job_shares_again_and_a_second_undo_doubles_them():
    """A call of 30 steps: the step undone at its second step runs its
    next 8 passes alone (ALONE_PASSES), then shares again; run out again
    there, it is undone again (not stopped) and runs 16 alone. The job
    trains as its eager loop."""
    s = session()
    twin = Twin(14, 24)
    calls = run_out(twin.job.model[3], at=(2, 15))
    twin.job.train(30, session=s)
    twin.check(30)
    assert calls["n"] == 32
    assert s.stats()["put_back"] == 2
    assert member_of(twin.job.model).stats()["alone_passes"] == ALONE_PASSES * 3


def member_of(model):
    """The sharing member a model's job.train calls made (its stats)."""
    return importlib.import_module("waterwave.exec.sharing")._members[model]
