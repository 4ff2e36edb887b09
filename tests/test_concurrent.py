"""ConcurrentTrainer training several jobs exactly as each trains alone,
under every schedule of the NodeGroup pipeline (its parts are tested in
test_pipeline_parts.py)."""
import copy
import gc
import json
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.pipeline import SCHEDULES as TABLE  # noqa: E402
from waterwave.pipeline.nodegroups import partition  # noqa: E402
from waterwave.exec.job_loop import OwnPeaks  # noqa: E402
from waterwave.pipeline.pairing import (JobGroups, JobPlan, SegmentSpare,  # noqa: E402
                                        graph_plan, step_peak)

MiB = 1 << 20
SCHEDULES = ["waterwave", "waterwave-alg1", "waterwave-s", "lockstep", "turns", "sequential", "session"]


def mlp(seed, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 8))


def cnn(seed):
    torch.manual_seed(seed)
    # No bias before the BatchNorm: its true gradient is zero, and Adam turns
    # rounding noise into full-size updates (see test_optimize.py).
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 4))


def square(out):
    return out.square().mean()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
}


class Pair:
    """A job and its solo twin, trained eagerly for reference."""

    def __init__(self, model, x, opt, name):
        self.x, self.name = x, name
        self.solo = copy.deepcopy(model)
        self.solo_opt = OPTIMIZERS[opt](self.solo.parameters())
        self.job = ww.Job(model, (x,), square, OPTIMIZERS[opt](model.parameters()), name=name)

    def solo_steps(self, n):
        out = []
        for _ in range(n):
            self.solo_opt.zero_grad()
            loss = square(self.solo(self.x))
            loss.backward()
            self.solo_opt.step()
            out.append(loss.item())
        return out

    def check(self, losses, n):
        expected = self.solo_steps(n)
        assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6), self.name
        for (k, a), b in zip(self.solo.named_parameters(), self.job.model.parameters()):
            torch.testing.assert_close(b, a.detach(), rtol=1e-4, atol=1e-5, msg=k)


def pairs():
    g = torch.Generator().manual_seed(3)
    return [Pair(mlp(0), torch.randn(16, 32, generator=g), "sgd", "mlp-sgd"),
            Pair(cnn(1), torch.randn(4, 3, 12, 12, generator=g), "adam", "cnn-adam"),
            Pair(mlp(2, 48), torch.randn(8, 32, generator=g), "adamw", "mlp-adamw")]


def budget(trainer):
    """A limit that fits one job's step beside the others' persistent memory,
    so the pairing must take turns."""
    return sum(m.job.persistent_bytes() for m in trainer.members) + max(
        max(0, m.partition.peak) for m in trainer.members) + 4096


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("window", [None, 1])
def test_three_jobs_train_as_each_trains_alone(schedule, window, monkeypatch):
    """``window``: steps planned at a time; 1 makes a run of seven steps go
    through seven windows, the jobs going on from one to the next as from
    one round to the next."""
    steps = 3
    if window:
        monkeypatch.setattr("waterwave.pipeline.round_feed.WINDOW_STEPS", window)
        steps = 7
    ps = pairs()
    jobs = [p.job for p in ps]
    trainer = ww.ConcurrentTrainer(jobs, split_size=4096, schedule=schedule)
    trainer.memory_limit = budget(trainer)
    losses = trainer.run(steps)
    for p, got in zip(ps, losses):
        p.check(got, steps)
    s = trainer.stats()
    assert [j["steps"] for j in s["jobs"]] == [steps] * 3 and s["schedule"] == schedule
    if schedule == "waterwave":  # the budget holds one step at a time: the jobs take turns
        assert s["rounds_run"] > steps * max(j["groups"] for j in s["jobs"])
    assert all(j["error"] is None for j in s["jobs"])


def test_a_loss_closing_over_its_targets_trains_as_alone():
    """A loss that closes over its targets (as ``waterwave.tools.models``
    builds them) captures them as FX ``get_attr`` constants, which the
    trainer must fetch, not call."""
    torch.manual_seed(4)
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))

    def loss(out):
        return torch.nn.functional.cross_entropy(out, y)

    model = mlp(5)
    solo = copy.deepcopy(model)
    solo_opt = torch.optim.SGD(solo.parameters(), lr=0.1, momentum=0.9)
    job = ww.Job(model, (x,), loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert any(n.op == "get_attr" for n in job.step_fn.gm.graph.nodes)
    got = ww.ConcurrentTrainer([job, pairs()[0].job], split_size=4096).run(3)[0]
    expected = []
    for _ in range(3):
        solo_opt.zero_grad()
        value = loss(solo(x))
        value.backward()
        solo_opt.step()
        expected.append(value.item())
    assert job.error is None and got == pytest.approx(expected, rel=1e-4)


def test_jobs_leave_and_join_between_steps():
    a, b, c = pairs()
    trainer = ww.ConcurrentTrainer([a.job, b.job], memory_limit=1 << 30)
    first = trainer.step()
    assert len(first) == 2 and all(isinstance(x, float) for x in first)
    trainer.run(1)
    trainer.remove(b.job)
    trainer.add(c.job)
    losses = trainer.run(2)
    a.check(losses[0], 4)
    b.check(b.job.losses, 2)
    c.check(losses[1], 2)
    with pytest.raises(ValueError, match="already training"):
        trainer.add(a.job)


@pytest.mark.parametrize("schedule", ["waterwave", "waterwave-alg1"])
def test_a_job_failing_in_any_group_stops_alone(schedule):
    """A job raises in group k, for every k: it stops with its error, its
    tensors are dropped, the barrier never waits on it, the others finish."""
    probe = ww.ConcurrentTrainer([pairs()[0].job], split_size=4096)
    groups = len(probe.members[0].partition.groups)
    assert groups >= 4
    checked = 0  # tensors a failed job held when it raised
    for k in range(groups):
        bad, good, other = pairs()
        trainer = ww.ConcurrentTrainer([bad.job, good.job, other.job], split_size=4096,
                                       schedule=schedule)
        trainer.memory_limit = budget(trainer)
        run_group = trainer.member(bad.job).runner.run_group
        held = []

        inputs = trainer.member(bad.job).runner.placeholders

        def failing(group, env, k=k, run_group=run_group):
            run_group(group, env)
            if group == k:
                runner = trainer.member(bad.job).runner
                made = [runner.value(env, n) for n in runner.stages[group].nodes
                        if isinstance(runner.value(env, n), torch.Tensor)]
                theirs = {runner.value(env, n).untyped_storage().data_ptr() for n in inputs}
                held.extend(weakref.ref(t) for t in made
                            if t.untyped_storage().data_ptr() not in theirs)
                raise RuntimeError(f"boom in group {group}")

        trainer.member(bad.job).runner.run_group = failing
        done = threading.Event()
        result = []
        worker = threading.Thread(target=lambda: (result.append(trainer.run(2)), done.set()))
        worker.start()
        worker.join(60)
        assert done.is_set(), f"the barrier deadlocked when a job failed in group {k}"
        assert isinstance(bad.job.error, RuntimeError) and f"group {k}" in str(bad.job.error)
        assert bad.job.losses == []
        good.check(result[0][1], 2)
        other.check(result[0][2], 2)
        gc.collect()
        assert all(ref() is None for ref in held), "the failed job kept its tensors"
        checked += len(held)
        assert trainer.stats()["jobs"][0]["error"].startswith("RuntimeError")
        assert trainer.step()[0] is None  # a failed job takes no more steps
    assert checked > 0


class FakeProbe:
    """What the allocator's counters say of each group on a GPU: here every
    group holds nothing after it but rises ``rise`` bytes while it runs (a
    workspace the graph cannot show); its stream's own segments peak at
    ``own`` (reserved, allocated) bytes in every group (None: torch's
    allocator, which does not count them)."""

    def __init__(self, rise, available=None, own=None):
        self.rise, self.groups, self.free, self.own = rise, 0, available, own

    def start(self):
        return 0

    def since(self, start):
        self.groups += 1
        return 0, self.rise

    def own_peaks(self, stream):
        return None if self.own is None else OwnPeaks(*self.own)

    def available(self):
        return self.free


def test_on_a_gpu_the_first_step_alone_measures_the_groups_the_pairing_plans_from():
    """On a GPU (a probe standing in for the allocator's counters) each job's
    first step runs alone and is measured; the pairing then plans from the
    measurements: rises the graph does not show make the jobs take turns,
    where the graph's bytes let them run free. Training is as alone."""
    rise = 1 << 20
    free, measured = pairs()[:2], pairs()[:2]
    persistent = sum(graph_plan(0, p.job.graph, partition(p.job.graph, 4096)).persistent
                     for p in free)
    limit = int((persistent + 1.5 * rise) / 0.97)
    plain = ww.ConcurrentTrainer([p.job for p in free], split_size=4096, memory_limit=limit)
    plain.run(3)
    assert plain.rounds_run == 1  # the graph's bytes fit at once: no barrier
    trainer = ww.ConcurrentTrainer([p.job for p in measured], split_size=4096, memory_limit=limit)
    probe = FakeProbe(rise)
    trainer._memory_probe = lambda jobs: probe
    losses = trainer.run(3)
    for p, got in zip(measured, losses):
        p.check(got, 3)
        assert trainer.member(p.job).measured == [(0, rise)] * len(trainer.member(p.job).partition.groups)
    assert probe.groups == sum(len(trainer.member(p.job).partition.groups) for p in measured)  # one step each
    groups = [len(trainer.member(p.job).partition.groups) for p in measured]
    assert trainer.rounds_run == 2 * sum(groups)  # two steps, one group at a time
    assert all(j["measured"] for j in trainer.stats()["jobs"])
    trainer.run(1)  # measured once
    assert probe.groups == sum(groups)


@pytest.mark.parametrize("own, room, free", [
    (None, 0, False),  # not measured: 5% of the bytes
    ((8 * MiB, 8 * MiB, 2 * MiB, 2 * MiB), 2 * MiB, True),  # no spare: the shared small segment
    ((8 * MiB, 8 * MiB, 2 * MiB, 2 * MiB), 0, False),
    ((12 * MiB, 8 * MiB, 2 * MiB, 2 * MiB), 2 * MiB, False),  # 4 MiB spare a job
    ((10 * MiB, 8 * MiB, 4 * MiB, 2 * MiB), 4 * MiB, True),  # 2 MiB a job, small: no shared one
    ((10 * MiB, 8 * MiB, 4 * MiB, 2 * MiB), 4 * MiB - 64 * 1024, False)])
def test_the_segment_spare_measured_alone_decides_whether_the_jobs_run_free(own, room, free):
    """Where the allocator counts what a job's stream's own segments held
    beyond its blocks in its measured step (in all and in the small pool),
    the pairing runs the jobs free when their steps and those spares fit
    the limit, with a small-pool segment more where their small segments
    left less than one spare (``shared_small_pool``); where it does not
    count them (torch's allocator), a margin of their bytes stands in.
    Under a limit of the steps' bytes, 1% and ``room`` more."""
    rise = 1 << 20
    jobs = pairs()[:2]
    trainer = ww.ConcurrentTrainer([p.job for p in jobs], split_size=4096, memory_limit=1 << 40)
    trainer._memory_probe = lambda members: FakeProbe(rise, own=own)
    trainer.run(1)  # the measured step
    members = trainer.active
    spare = None if own is None else SegmentSpare(own[0] - own[1], own[2] - own[3])
    assert [m.segment_spare for m in members] == [spare] * 2
    assert [(j["segment_spare"], j["small_pool_spare"]) for j in trainer.stats()["jobs"]] == [
        (None, None) if own is None else (spare.total, spare.small_pool)] * 2
    held = sum(step_peak(m.pairing_plan(k)) for k, m in enumerate(members))  # as measured
    trainer.memory_limit = int(held * 1.01) + room
    assert trainer._planner(members, 2).free is free
    losses = trainer.run(2)
    for p, got in zip(jobs, losses):
        p.check(got, 3)


@pytest.mark.parametrize("room", ["little", "plenty"])
def test_without_a_limit_a_gpu_budget_is_what_the_allocator_can_still_give(room):
    """No memory_limit on a GPU: the jobs may hold what they hold already plus
    what the allocator can still give (its cache, the driver's free memory
    within its fraction). Little room beside their measured rises makes the
    jobs take turns; plenty lets them run free."""
    rise = 1 << 20
    jobs = pairs()[:2]
    persistent = sum(graph_plan(0, p.job.graph, partition(p.job.graph, 4096)).persistent
                     for p in jobs)
    available = int((persistent + 1.5 * rise) / 0.97) - persistent if room == "little" else 1 << 40
    trainer = ww.ConcurrentTrainer([p.job for p in jobs], split_size=4096)
    trainer._memory_probe = lambda jobs: FakeProbe(rise, available)
    losses = trainer.run(3)
    for p, got in zip(jobs, losses):
        p.check(got, 3)
    groups = sum(len(trainer.member(p.job).partition.groups) for p in jobs)
    assert trainer.rounds_run == (2 * groups if room == "little" else 1)
    assert trainer.stats()["budget"] == available + persistent


def test_a_job_failing_in_its_measured_step_stops_alone():
    bad, good = pairs()[:2]
    trainer = ww.ConcurrentTrainer([bad.job, good.job], split_size=4096, memory_limit=1 << 30)
    trainer._memory_probe = lambda jobs: FakeProbe(1024)

    def failing(group, env):
        raise RuntimeError("out of memory in the measured step")

    trainer.member(bad.job).runner.run_group = failing
    losses = trainer.run(3)
    assert "measured step" in str(bad.job.error) and trainer.member(bad.job).measured is None
    good.check(losses[1], 3)


def test_bad_arguments_are_clear_errors():
    job = pairs()[0].job
    with pytest.raises(ValueError, match="unknown schedule"):
        ww.ConcurrentTrainer([job], schedule="sideways")
    with pytest.raises(ValueError, match="split_size must be a positive number of bytes"):
        ww.ConcurrentTrainer([job], split_size=0)
    for steps in (0, 2.5, "3", True, torch.tensor(2.0)):
        with pytest.raises(ValueError, match="steps must be a whole number of steps, at least 1"):
            ww.ConcurrentTrainer([job]).run(steps)
    with pytest.raises(ValueError, match="memory_limit must be a positive number of bytes"):
        ww.ConcurrentTrainer([job], memory_limit=0)
    small = ww.ConcurrentTrainer([job, pairs()[1].job], memory_limit=1024)
    with pytest.raises(ValueError, match="does not even hold the jobs' persistent tensors"):
        small.run(1)
    assert job.losses == [] and job.error is None  # nothing ran


def test_the_trainer_and_the_simulator_run_one_table_of_schedules():
    """Each schedule is one row of waterwave.pipeline.SCHEDULES: the trainer
    cuts a job's step as the simulator cuts its trace, and pairs by the same
    planner."""
    from waterwave.sim.schedules import ALLOCATORS, NAMES, NodeGroupSchedule

    assert sorted(TABLE) == sorted(SCHEDULES) and set(TABLE) <= set(NAMES) <= set(ALLOCATORS)
    job = pairs()[1].job
    for name, spec in TABLE.items():
        trainer = ww.ConcurrentTrainer([job], schedule=name)
        assert trainer.plan_schedule is spec
        ours = [g.nodes for g in trainer.member(job).partition.groups]
        assert ours == [g.nodes for g in spec.partition(job.graph).groups]
        if name != "lockstep":  # the simulator runs lockstep on whole traces
            sim = NodeGroupSchedule(name)
            assert sim.spec is spec and [g.nodes for g in sim.partition(job.graph).groups] == ours
        assert ALLOCATORS[name] == (spec.policy, spec.config)
        trainer.remove(job)
    # Each pairing reads its part of the jobs' PairingInput: the free one
    # puts every group in round 0, whatever the plans say.
    from waterwave.pipeline.pairing import JobGroups, JobPlan
    from waterwave.pipeline.schedules import PairingInput

    free = TABLE["lockstep"].round_planner(2, None, [PairingInput(JobPlan(0, 0, []),
                                                                   JobGroups(0, 1, 3, 0, 1))])
    assert free.window(2)[0] == [(0, s, g) for s in range(2) for g in range(3)]
    with pytest.raises(ValueError, match="choose one of waterwave, waterwave-alg1"):
        ww.ConcurrentTrainer([job], schedule="sideways")


@pytest.mark.gpu
def test_concurrent_jobs_on_a_gpu_train_as_alone():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ps = []
    for p in pairs()[:2]:
        model = p.job.model.cuda()
        ps.append(Pair(model, p.x.cuda(), "sgd", p.name))
    trainer = ww.ConcurrentTrainer([p.job for p in ps])
    losses = trainer.run(3)
    for p, got in zip(ps, losses):
        p.check(got, 3)


@pytest.mark.parametrize("schedule", ["waterwave", "lockstep"])
def test_ctrl_c_reaches_the_caller_and_stops_every_job(schedule):
    """Ctrl-C during run(): KeyboardInterrupt in the caller, whichever thread
    the signal lands on; every job thread stopped, nothing trains on behind
    the caller; the next run works; nothing aborts at exit."""
    from conftest import run_python

    r = run_python(f"""
        import json, os, signal, threading, time, torch, waterwave as ww
        # Python leaves SIGINT ignored when it starts ignored (a background
        # job's, as CI may run it): take Ctrl-C as an interactive run does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        watchdog = threading.Timer(60, os._exit, (3,))  # a hang fails fast, with exit 3
        watchdog.daemon = True
        watchdog.start()
        torch.manual_seed(0)
        jobs = []
        for k in range(2):
            net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
            jobs.append(ww.Job(net, (torch.randn(16, 32),), None,
                               torch.optim.SGD(net.parameters(), lr=0.01)))
        trainer = ww.ConcurrentTrainer(jobs, schedule={schedule!r})
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            trainer.run(10**7)
            raise SystemExit("run() ended without the interrupt")
        except KeyboardInterrupt:
            waited = time.monotonic() - start
        left = [t.name for t in threading.enumerate() if t.name.startswith("waterwave job")]
        steps = [len(j.losses) for j in jobs]
        time.sleep(0.3)
        still = [len(j.losses) for j in jobs]
        trainer.run(2)
        print(json.dumps({{"waited": waited, "left": left, "steps": steps, "still": still,
                          "after": [len(j.losses) for j in jobs],
                          "errors": [repr(j.error) for j in jobs if j.failed]}}))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Aborted" not in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["waited"] < 5 and out["left"] == [] and out["errors"] == []
    assert out["steps"] == out["still"]  # nothing trained on behind the caller
    assert out["after"] == [n + 2 for n in out["steps"]]


@pytest.mark.parametrize("schedule", ["waterwave", "session"])
def test_interrupt_stops_a_run_on_another_thread_and_the_next_run_works(schedule):
    """trainer.interrupt() from another thread (what Ctrl-C runs for a
    trainer whose caller is off the main thread): the caller gets
    KeyboardInterrupt within a second, nothing trains on, the next run
    works. The session schedule is stopped in whichever phase it is."""
    import time

    jobs = []
    for k in range(2):
        net = mlp(k)
        jobs.append(ww.Job(net, (torch.randn(16, 32),), None,
                           torch.optim.SGD(net.parameters(), lr=0.01)))
    trainer = ww.ConcurrentTrainer(jobs, schedule=schedule)
    caught = {}

    def run():
        try:  # long enough to be interrupted, short enough to end if it is not
            trainer.run(20_000)
        except KeyboardInterrupt as e:
            caught["at"], caught["message"] = time.monotonic(), str(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while min(len(j.losses) for j in jobs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    asked = time.monotonic()
    trainer.interrupt()
    t.join(10)
    stopped = not t.is_alive()
    t.join(120)  # a run the interrupt missed ends by itself
    assert stopped and caught["at"] - asked < 1 and "interrupted" in caught["message"]
    steps = [len(j.losses) for j in jobs]
    time.sleep(0.2)
    assert [len(j.losses) for j in jobs] == steps  # nothing trains on
    assert [len(x) for x in trainer.run(2)] == [n + 2 for n in steps]
    assert not any(j.failed for j in jobs)


def test_removing_a_job_that_is_not_there_names_the_jobs_that_are():
    torch = pytest.importorskip("torch")
    net = torch.nn.Linear(4, 2)
    job = ww.Job(net, (torch.randn(3, 4),), None, torch.optim.SGD(net.parameters(), lr=0.1))
    trainer = ww.ConcurrentTrainer([])
    with pytest.raises(ValueError, match="is not training here: this trainer has no jobs"):
        trainer.remove(job)


@pytest.fixture
def cpu_session(cpu_session_plans):
    """The CPU's training session, planning its jobs' steps (conftest), its
    limit lifted again after the test."""
    return cpu_session_plans


def test_a_trainer_is_its_device_sessions_fixed_set_of_jobs_under_one_budget(cpu_session,
                                                                            monkeypatch):
    """A trainer's jobs are its device's session's fixed set (issue 39,
    item 4): a run may hold the session's memory_limit less what the
    session's other jobs hold (here one that trained by job.train keeps its
    parameters and optimizer state between calls); the session, and so its
    sharing members' budget, counts the run's budget while it runs and the
    jobs' persistent bytes between runs; and they train as alone."""
    limit = 4 << 20
    cpu_session.configure(memory_limit=limit)
    ps = pairs()
    ps[0].check(ps[0].job.train(2), 2)
    others = cpu_session.stats()["held_between_calls"]  # the job.train job, and any left here
    assert others >= ps[0].job.persistent_bytes()
    holds, outside = [], []  # each hold, and the sharing members' ledger after it
    hold = cpu_session.hold_for_trainer

    def spy(trainer, held, running=0):
        hold(trainer, held, running)
        holds.append((held, running))
        outside.append(cpu_session.ledger().share_stats()["outside"])
    monkeypatch.setattr(cpu_session, "hold_for_trainer", spy)
    trainer = ww.ConcurrentTrainer([ps[1].job, ps[2].job], split_size=4096)
    between = sum(m.held() for m in trainer.members)
    assert between > 0 and holds[-1] == (between, 0)
    stats = cpu_session.stats()
    assert {"training": 0, "bytes": between} in stats["trainers"]
    assert stats["held_between_calls"] == others + between
    assert cpu_session.ledger().share_stats()["outside"] == others + between  # members see it

    losses = trainer.run(3)
    for p, got in zip(ps[1:], losses):
        p.check(got, 3)
    assert trainer.stats()["budget"] == limit - others
    peaks = sum(m.step_peak() for m in trainer.members)
    running = holds.index((min(limit - others, peaks), 2))  # while it ran: both, their budget
    assert outside[running] == others + min(limit - others, peaks)
    assert holds[-1] == (between, 0) and cpu_session.stats()["held_between_calls"] == \
        others + between

    trainer.memory_limit = 2 * limit  # its own limit, above what the session leaves
    trainer.run(1)
    assert trainer.stats()["budget"] == limit - others
    trainer.memory_limit = limit - others - 1024  # below it: its own
    trainer.run(1)
    assert trainer.stats()["budget"] == limit - others - 1024


def test_a_trainer_the_session_leaves_too_little_is_refused_naming_the_session(cpu_session):
    ps = pairs()
    ps[0].job.train(1)
    others = cpu_session.stats()["held_between_calls"]
    trainer = ww.ConcurrentTrainer([ps[1].job], memory_limit=1 << 30)
    one_step = trainer.members[0].step_peak()
    cpu_session.configure(memory_limit=others + one_step - 1)
    with pytest.raises(ValueError, match=r"the training session of cpu has memory_limit=.* other "
                                         r"jobs and sharing members hold [0-9,]+ of them, so "
                                         r"this trainer may hold [0-9,]+: .*below one step"):
        trainer.run(1)
    assert ps[1].job.losses == []  # nothing ran
    cpu_session.configure(memory_limit=others + one_step)
    ps[1].check(trainer.run(1)[0], 1)


def test_a_gpu_sessions_free_memory_counts_a_trainers_bytes_once():
    """A GPU session without a limit takes its budget from what the
    allocator can still give, which already leaves out what a trainer's jobs
    hold; the trainer's bytes, also counted as taken, are added back, as
    a job.train job's are, so that nothing is taken twice."""
    session = ww.TrainingSession("cuda:0")
    trainer = object.__new__(ww.ConcurrentTrainer)  # only a key for its hold here

    class Probe:
        def available(self):
            return 5 << 20

    assert session._probe_capacity(Probe()) == 5 << 20
    session.hold_for_trainer(trainer, 3 << 20)
    assert session._probe_capacity(Probe()) == 8 << 20
    assert session.stats()["trainers"] == [{"training": 0, "bytes": 3 << 20}]
    session.hold_for_trainer(trainer, 0)
    assert session.stats()["trainers"] == []
