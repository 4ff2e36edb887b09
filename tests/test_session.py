"""Training sessions (issue 24, item 1): ``Job.train(steps)`` from many
threads, jobs joining and leaving the pipeline as their calls begin and
end, each trained exactly as eager PyTorch trains it alone, with the loop
around each call (a scheduler, evaluation) the caller's own."""
import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from conftest import PLANNING_LIMIT, start_and_join  # noqa: E402
from test_exactness import (  # noqa: E402
    OPTIMIZERS,
    assert_trains_as_eager,
    change_lr,
    eager_step,
    job_settings,
    job_specs,
    loss_fn,
    model_and_data,
    warmups,
)

import waterwave as ww  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")


def eager_calls(model, spec, data, calls):
    """Eager training in ``calls`` runs of steps, the learning rate changed
    between runs (as a scheduler stepped between epochs would)."""
    opt = OPTIMIZERS[spec["optimizer"]](model.parameters(), spec["hyper"])
    schedulers = warmups(opt, spec)
    losses, i = [], 0
    for c, n in enumerate(calls):
        thaw(model, spec, c)
        if c:
            change_lr(opt, spec)
        for _ in range(n):
            losses.append(eager_step(model, opt, spec, *data[i % len(data)]))
            for s in schedulers:
                s.step()
            i += 1
    return losses, opt


def thaw(model, spec, call):
    """A spec that fine-tunes trains its first layer frozen in the first
    call and thawed after (the job captures its step again)."""
    if spec["fine_tune"]:
        model[0].requires_grad_(call > 0)


def run_in_threads(fns):
    """Each function on a thread of its own; their results, or what they raised."""
    out = [None] * len(fns)

    def call(k):
        try:
            out[k] = fns[k]()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[k] = e

    start_and_join([threading.Thread(target=call, args=(k,), daemon=True)
                    for k in range(len(fns))], 120, "a train() call hung")
    return out


@settings(max_examples=10)
@given(specs=st.lists(job_specs(), min_size=1, max_size=4).filter(lambda s: len(s) in (1, 2, 4)),
       limit=st.sampled_from([None, 64 << 10, 1 << 30]),
       schedule=st.sampled_from(["waterwave", "lockstep"]), capture=st.booleans(),
       data=st.data())
def test_threads_calling_train_each_train_exactly_as_eager_alone(specs, limit, schedule, capture,
                                                                 data):
    """Each job on its own thread, in 1-3 calls of 1-3 steps with the learning
    rate changed between calls (and, fine-tuning, the first layer thawed
    after the first call: a new capture); the jobs join and leave whenever
    their calls begin and end (a tight limit makes them take turns)."""
    session = ww.TrainingSession("cpu", memory_limit=limit, schedule=schedule, capture=capture)
    jobs, expected, calls = [], [], []
    for k, spec in enumerate(specs):
        model, batches = model_and_data(k, spec)
        c = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3), label=f"calls of job {k}")
        calls.append(c)
        expected.append(eager_calls(model_and_data(k, spec)[0], spec, batches, c))
        opt = OPTIMIZERS[spec["optimizer"]](model.parameters(), spec["hyper"])
        jobs.append(ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=batches,
                           step_schedulers=warmups(opt, spec), **job_settings(spec)))

    def trial(job, spec, c):
        losses = []
        for i, n in enumerate(c):
            thaw(job.model, spec, i)
            if i:
                change_lr(job.optimizer, spec)
            losses += job.train(n, session=session)
        return losses

    results = run_in_threads([lambda j=j, s=s, c=c: trial(j, s, c)
                              for j, s, c in zip(jobs, specs, calls)])
    for job, (losses, eager_opt), got in zip(jobs, expected, results):
        assert not isinstance(got, BaseException), got
        assert_trains_as_eager(job, losses, eager_opt, got)
    assert session.training == [] and session.stats()["steps_run"] == sum(map(sum, calls))


def mlp_job(seed, batches=3, name=None, **job_args):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(batches)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return ww.Job(model, loss_fn=loss_fn, optimizer=opt, data=data, name=name, **job_args)


def test_a_job_joins_while_another_trains_and_evaluates_between_calls():
    """A long job trains while a second calls train(2) three times with eager
    evaluation and a scheduler between: both train as eager, the second
    joins and leaves three times, and the session is empty after."""
    session = ww.TrainingSession("cpu", memory_limit=256 << 10, capture=True)
    long_job, short_job = mlp_job(1, name="long"), mlp_job(2, name="short")
    sched = torch.optim.lr_scheduler.StepLR(short_job.optimizer, step_size=1, gamma=0.5)
    seen_training = []

    def short():
        out = []
        for _ in range(3):
            out += short_job.train(2, session=session)
            seen_training.append([j.name for j in session.training])
            sched.step()
            with torch.no_grad():  # evaluation between calls, plain PyTorch
                short_job.model(torch.randn(4, 16)).sum().item()
        return out

    long_losses, short_losses = run_in_threads([lambda: long_job.train(40, session=session), short])
    ref_long, ref_short = mlp_job(1), mlp_job(2)
    # Eager references of the same models, data and schedule.
    expected = []
    for ref, calls, gamma in ((ref_long, [40], None), (ref_short, [2, 2, 2], 0.5)):
        opt = ref.step_fn.optimizer
        data = ref.batches.data
        losses, i = [], 0
        for c, n in enumerate(calls):
            if c and gamma:
                for g in opt.param_groups:
                    g["lr"] *= gamma
            for _ in range(n):
                x, y = data[i % len(data)]
                i += 1
                opt.zero_grad()
                loss = loss_fn(ref.model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        expected.append((losses, opt))
    assert_trains_as_eager(long_job, *expected[0], long_losses)
    assert_trains_as_eager(short_job, *expected[1], short_losses)
    assert all(names in (["long"], []) for names in seen_training)  # short had left
    assert session.training == [] and session.stats()["steps_run"] == 46


def test_a_job_that_fails_raises_in_its_own_call_and_the_others_finish():
    session = ww.TrainingSession("cpu", memory_limit=256 << 10, capture=True)
    good = mlp_job(3, name="good")
    bad = mlp_job(4, name="bad")
    bad.batches.data.append((torch.randn(8, 5), torch.randint(0, 4, (8,))))  # wrong width
    good_losses, bad_result = run_in_threads([lambda: good.train(12, session=session),
                                              lambda: bad.train(12, session=session)])
    assert isinstance(bad_result, Exception) and bad.failed
    assert len(good_losses) == 12 and not good.failed
    with pytest.raises(RuntimeError, match="failed earlier"):
        bad.train(1, session=session)
    assert session.training == []
    assert len(good.train(2, session=session)) == 2  # the session goes on


def test_one_job_from_two_threads_at_once_is_refused():
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    job = mlp_job(5)
    started = threading.Event()
    original = job.next_batch

    def slow_batch():
        started.set()
        time.sleep(0.3)
        return original()

    job.next_batch = slow_batch
    results = run_in_threads([lambda: job.train(2, session=session),
                              lambda: (started.wait(10), job.train(1, session=session))])
    assert len(results[0]) == 2
    assert isinstance(results[1], RuntimeError) and "already training" in str(results[1])


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "3", None])
def test_steps_must_be_a_whole_number(steps):
    with pytest.raises(ValueError, match="whole number of steps"):
        mlp_job(6).train(steps, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True))


@pytest.mark.parametrize("settings_, message", [
    ({"memory_limit": -5}, "positive number of bytes"),
    ({"memory_limit": float("inf")}, "positive number of bytes"),
    ({"schedule": "waterwave-alg1"}, "use ConcurrentTrainer"),
    ({"schedule": "nope"}, "unknown schedule"),
    ({"split_size": 0}, "split_size"),
])
def test_bad_session_settings_are_clear_errors(settings_, message):
    with pytest.raises(ValueError, match=message):
        ww.TrainingSession("cpu", **settings_)


def test_the_device_session_is_one_per_device_and_settings_wait_for_no_one_training():
    a = ww.training_session("cpu")
    assert ww.training_session(torch.device("cpu")) is a
    with pytest.raises(ValueError, match="not a device"):
        ww.training_session("gpu:banana")
    job = mlp_job(7)
    assert len(job.train(2)) == 2 and a.member(job).job is job  # the job's own device's session
    assert ww.training_session("cpu", memory_limit=1 << 30).memory_limit == 1 << 30
    ww.training_session("cpu", memory_limit=None)


def test_ctrl_c_stops_every_thread_training_and_the_next_call_works():
    """Ctrl-C while jobs train from the main thread and a worker thread (as
    Optuna's n_jobs runs trials): KeyboardInterrupt in both within a second,
    nothing trains on, the next train() works, nothing aborts at exit."""
    from conftest import run_python

    r = run_python("""
        import json, os, signal, threading, time
        # Python leaves SIGINT ignored when it starts ignored (a background
        # job's, as CI may run it): take Ctrl-C as an interactive run does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch, waterwave as ww
        watchdog = threading.Timer(60, os._exit, (3,))
        watchdog.daemon = True
        watchdog.start()

        def job(seed):
            torch.manual_seed(seed)
            net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
            return ww.Job(net, (torch.randn(16, 32),), None, torch.optim.SGD(net.parameters(), lr=0.01))

        main_job, other = job(0), job(1)
        caught = {}

        def worker():
            try:
                other.train(10**7)
            except KeyboardInterrupt as e:
                caught["worker"] = (time.monotonic(), str(e))

        t = threading.Thread(target=worker)
        t.start()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            main_job.train(10**7)
            raise SystemExit("train() ended without the interrupt")
        except KeyboardInterrupt:
            at = time.monotonic()
        t.join(10)
        steps = [len(main_job.losses), len(other.losses)]
        time.sleep(0.3)
        still = [len(main_job.losses), len(other.losses)]
        after = [len(main_job.train(2)), len(other.train(3))]
        print(json.dumps({"worker_after": caught["worker"][0] - at, "message": caught["worker"][1],
                          "alive": t.is_alive(), "steps": steps, "still": still, "after": after,
                          "training": len(ww.training_session("cpu").training)}))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Aborted" not in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["worker_after"] < 1 and not out["alive"] and "interrupted" in out["message"]
    assert out["steps"] == out["still"] and min(out["steps"]) > 0
    assert out["after"] == [2, 3] and out["training"] == 0


def test_ctrl_c_reaches_a_session_made_directly_too():
    """What Ctrl-C runs (``interrupt_all``) stops the jobs of a session a
    user made and passed to ``train``, not only the devices' sessions."""
    from waterwave.exec.session import interrupt_all

    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)
    job = mlp_job(9)
    caught = {}

    def worker():
        try:
            job.train(10**7, session=session)
        except KeyboardInterrupt:
            caught["at"] = time.monotonic()

    t = threading.Thread(target=worker)
    t.start()
    deadline = time.monotonic() + 30
    while not job.losses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.losses, "the job did not start training"
    asked = time.monotonic()
    interrupt_all()
    t.join(10)
    stopped = not t.is_alive()
    if not stopped:  # never leave it training past the test
        session.interrupt()
        t.join(10)
    assert stopped and caught["at"] - asked < 1
    assert session.training == [] and len(job.train(2, session=session)) == 2


def test_no_stale_gradient_is_left_in_grad_after_training():
    """The captured step's gradients live inside the step, so a ``.grad``
    from before (here an eager backward) would silently outlive training:
    each way of training sets it to None, as ``optimizer.zero_grad()``
    does, and the parameters still train exactly as eagerly."""
    import torch.nn.functional as F

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        data = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(2)]
        F.cross_entropy(model(data[0][0]), data[0][1]).backward()  # a stale .grad
        assert all(p.grad is not None for p in model.parameters())
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data

    eager, opt, data = fresh()
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        opt.step()

    model, opt, data = fresh()
    ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=data).train(2)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))

    model, opt, data = fresh()
    ww.ConcurrentTrainer([ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt,
                                 data=data)]).run(2)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))

    model, opt, data = fresh()
    trainer = ww.optimize(model, (data[0][0],), F.cross_entropy, opt,
                          example_targets=(data[0][1],))
    for x, y in data:
        trainer.step(x, targets=y)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))


@pytest.mark.parametrize("layer", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_layers_train_as_eager(layer):
    """A captured step runs in the grad mode it was traced in: mkldnn's LSTM
    kernel on the CPU leaves out the workspace its backward needs when
    gradients are off, and the step failed."""
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = layer(4, 6, batch_first=True)
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(5, 7, 4, generator=g), torch.randint(0, 3, (5,), generator=g))
            for _ in range(3)]
    torch.manual_seed(0)
    eager, by_job, by_optimize = Tagger(), Tagger(), Tagger()
    by_job.load_state_dict(eager.state_dict())
    by_optimize.load_state_dict(eager.state_dict())
    cross_entropy = torch.nn.functional.cross_entropy
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, by_job, by_optimize)]
    losses = []
    for x, y in data * 2:
        opts[0].zero_grad()
        loss = cross_entropy(eager(x), y)
        loss.backward()
        opts[0].step()
        losses.append(loss.item())
    job = ww.Job(by_job, loss_fn=cross_entropy, optimizer=opts[1], data=data)
    assert job.train(6, session=ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT, capture=True)) == losses
    trainer = ww.optimize(by_optimize, (data[0][0],), cross_entropy, opts[2],
                          example_targets=(data[0][1],))
    assert [trainer.step(x, targets=(y,)).item() for x, y in data * 2] == losses
    for m in (by_job, by_optimize):
        assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), m.parameters()))


def test_sharing_on_a_second_cuda_device_at_once_is_refused_and_the_first_keeps_the_budget():
    """The CUDA runtime's thread accounts are one ledger, one budget, for
    every device: while trials share cuda:0, a sharing block on cuda:1 is
    refused with the fix, and cuda:1's captured jobs leave the ledger's
    budget to cuda:0's members."""
    first = ww.TrainingSession("cuda:0", memory_limit=1 << 30)
    second = ww.TrainingSession("cuda:1", memory_limit=1 << 29)
    first._sharing[1] = object()  # a member of cuda:0 in its block now
    try:
        with pytest.raises(RuntimeError, match="one CUDA device of a process at a time"):
            second.join_sharing(object(), 0)
        assert second._sharing == {}
        assert second._share_budget_locked() == 0  # cuda:0's budget stays in the ledger
    finally:
        first._sharing.clear()
