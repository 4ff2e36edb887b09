"""A trainer's probe of side by side whose step runs out of memory puts the
job back (``waterwave/exec/rollback.py``, ``ConcurrentTrainer._probe_side_by_side``):
the job then trains exactly as its eager loop, as if the undone steps never
ran. On the CPU nothing runs out, so the probe runs as on a GPU (every way
probed) and a job's group raises ``torch.OutOfMemoryError`` as the
allocator would."""
import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402
from waterwave.exec import concurrent  # noqa: E402
from waterwave.exec.device_segments import peak_alone  # noqa: E402
from waterwave.exec.batches import BatchFeed  # noqa: E402
from waterwave.exec.job_loop import MemoryProbe  # noqa: E402
from waterwave.exec.rollback import JobCheckpoint, ran_out_of_memory  # noqa: E402
from waterwave.pipeline.pairing import step_peak  # noqa: E402
from waterwave.pipeline.schedules import FREE, MEMORY, SEQUENTIAL, TURNS  # noqa: E402
from waterwave.exec.concurrent import PROBE_STEPS, SIDE_BY_SIDE_PROBE_STEPS  # noqa: E402
from waterwave.pipeline.session_choice import (CPU_PROBES, GUARD_CHUNK,  # noqa: E402
                                               GUARD_CHUNK_MOST, GUARDED_STEPS, PROBED,
                                               Choice, guard_chunk)


def model(seed: int, width: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.BatchNorm1d(width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 3))


def data(seed: int, batches: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(batches)]


LOSS = torch.nn.functional.cross_entropy


class Twin:
    """A job (Adam, a per-step scheduler, batch norm) and the same loop run
    eagerly for reference. ``accumulate``: batches a step, each batch's
    loss over that many backpropagated, as the eager recipe does."""

    def __init__(self, seed: int, width: int, batches: list | None = None, accumulate: int = 1):
        self.data = data(seed) if batches is None else batches
        self.accumulate = accumulate
        net = model(seed, width)
        self.eager = copy.deepcopy(net)
        self.eager_opt = torch.optim.Adam(self.eager.parameters(), lr=0.02)
        self.eager_sched = torch.optim.lr_scheduler.StepLR(self.eager_opt, 2, gamma=0.5)
        opt = torch.optim.Adam(net.parameters(), lr=0.02)
        self.sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        self.job = ww.Job(net, loss_fn=LOSS, optimizer=opt, data=self.data,
                          step_schedulers=[self.sched], accumulate_grad_batches=accumulate,
                          name=f"w{width}")

    def check(self, steps: int):
        losses = []
        for k in range(steps):
            self.eager_opt.zero_grad()
            total = 0.0
            for j in range(self.accumulate):
                x, y = self.data[(k * self.accumulate + j) % len(self.data)]
                loss = LOSS(self.eager(x), y) / self.accumulate
                loss.backward()
                total += loss.item()
            self.eager_opt.step()
            self.eager_sched.step()
            losses.append(total)
        assert self.job.losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
        for (name, a), b in zip(self.eager.state_dict().items(), self.job.model.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        for p, q in zip(self.eager.parameters(), self.job.model.parameters()):
            ours, theirs = self.job.optimizer.state[q], self.eager_opt.state[p]
            assert set(ours) == set(theirs)
            for key in theirs:
                torch.testing.assert_close(torch.as_tensor(ours[key]),
                                           torch.as_tensor(theirs[key]), msg=key)
        assert self.sched.last_epoch == self.eager_sched.last_epoch
        assert self.job.optimizer.param_groups[0]["lr"] == self.eager_opt.param_groups[0]["lr"]


def as_on_a_gpu(monkeypatch):
    """The trainer probes every way, side by side too, as on a GPU."""
    monkeypatch.setattr(concurrent.ConcurrentTrainer, "_probed", lambda self, members: PROBED)


def run_out_in_free_probe(trainer, job, at_call: int, also=None):
    """``job``'s ``at_call``-th group in the side-by-side runs raises the
    allocator's out-of-memory error, ``also()`` called first; returns the
    groups it ran there."""
    member = trainer.member(job)
    run_group = member.runner.run_group
    state = {"armed": False, "calls": 0}

    def group(k, env):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == at_call:
                if also is not None:
                    also()
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        run_group(k, env)

    member.runner.run_group = group
    run_rounds = trainer._run_rounds

    def rounds(members, steps, sched=None):
        state["armed"] = sched is not None and sched.pairing == FREE
        try:
            run_rounds(members, steps, sched)
        finally:
            state["armed"] = False

    trainer._run_rounds = rounds
    return state


def tight(trainer) -> int:
    return sum(step_peak(trainer.member(j).plan) for j in trainer.jobs) - 1


@pytest.mark.parametrize("step, group", [(0, 2), (1, -1), (3, 0)])
def test_a_job_that_runs_out_in_the_side_by_side_probe_trains_as_its_eager_loop(monkeypatch, step,
                                                                                 group):
    """The second job's step ``step`` of the probe runs out of memory in its
    group ``group`` (-1: its last, the optimizer's update, some parameters
    updated already): it is put back as it was before the probe and trains
    the probe's steps again alone. Side by side is not chosen; each job
    trains 13 steps exactly as its eager loop would (losses, parameters,
    batch norm's statistics, Adam's state, the scheduler)."""
    as_on_a_gpu(monkeypatch)
    a, b = Twin(1, 24), Twin(2, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    trainer.memory_limit = tight(trainer)
    groups = len(trainer.member(b.job).partition.groups)
    at = step * groups + (group % groups) + 1
    state = run_out_in_free_probe(trainer, b.job, at)
    trainer.run(13)
    assert state["calls"] == at, "the probe did not reach the group that runs out"
    assert trainer.stats()["put_back"] == 1
    chose = trainer.stats()["session"]
    assert "free did not fit" in chose["why"] and chose["ran"] in (TURNS, SEQUENTIAL, MEMORY)
    assert b.job.error is None and not b.job.failed
    a.check(13)
    b.check(13)


def test_a_side_by_side_probe_that_fits_is_kept_where_fastest(monkeypatch):
    """Nothing runs out: the probe's steps stand, and side by side is among
    the ways compared (chosen where fastest); every job trains as eager."""
    as_on_a_gpu(monkeypatch)
    a, b = Twin(3, 24), Twin(4, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    trainer.memory_limit = tight(trainer)
    trainer.run(13)
    chose = trainer.stats()["session"]
    assert trainer.stats()["put_back"] == 0
    assert chose["why"].startswith("fastest of the probes") and "free did not fit" not in chose["why"]
    assert "free " in chose["why"]
    a.check(13)
    b.check(13)


def test_on_the_cpu_the_trainer_does_not_probe_side_by_side():
    """Nothing holds a budget on the CPU: side by side runs only where the
    peaks fit, and the probes are the others."""
    a, b = Twin(5, 24), Twin(6, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    assert trainer._probed(trainer.members) == CPU_PROBES
    assert FREE not in CPU_PROBES and set(PROBED) == {FREE, *CPU_PROBES}
    trainer.memory_limit = tight(trainer)
    trainer.run(9)
    why = trainer.stats()["session"]["why"]
    assert "free" not in why and all(w in why for w in (TURNS, SEQUENTIAL, MEMORY))
    a.check(9)
    b.check(9)


def test_a_checkpoint_puts_the_state_a_step_changed_back_in_place():
    """Taken between steps and restored after two eager steps: every
    parameter, buffer and optimizer state tensor holds its values again (the
    same tensor objects), state made since is gone, the scheduler and the
    learning rate are back, the losses are cut, and the two steps' batches
    come next."""
    twin = Twin(7, 16)
    job = twin.job
    job.train(1)
    tensors = {id(t): t.detach().clone() for t in (*job.model.parameters(), *job.model.buffers())}
    state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in job.optimizer.state.items()}
    objects = [id(v) for s in job.optimizer.state.values() for v in s.values()]
    lr, epoch = job.optimizer.param_groups[0]["lr"], twin.sched.last_epoch
    kept = JobCheckpoint(job)
    job.train(2)
    assert len(job.losses) == 3 and twin.sched.last_epoch == epoch + 2
    kept.restore()
    assert len(job.losses) == 1 and twin.sched.last_epoch == epoch
    assert job.optimizer.param_groups[0]["lr"] == lr
    for t in (*job.model.parameters(), *job.model.buffers()):
        assert torch.equal(t, tensors[id(t)])
    assert [id(v) for s in job.optimizer.state.values() for v in s.values()] == objects
    for p, s in state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(job.optimizer.state[p][k]), torch.as_tensor(v))
    job.train(8)
    twin.check(9)


def test_a_batch_feed_gives_back_the_steps_recorded_in_order():
    feed = BatchFeed([torch.tensor(k) for k in range(5)])

    def drawn(n=1):
        return [int(feed.next()[0][0]) for _ in range(n)]

    assert drawn() == [0]
    feed.record()
    assert int(feed.peek()[0][0]) == 1
    assert drawn(2) == [1, 2] and int(feed.peek()[0][0]) == 3
    feed.rewind()
    assert drawn(5) == [1, 2, 3, 4, 0]
    with pytest.raises(RuntimeError, match="without record"):
        feed.rewind()
    feed.record()
    drawn()
    feed.stop_recording()
    with pytest.raises(RuntimeError, match="without record"):
        feed.rewind()


def test_only_out_of_memory_errors_are_rolled_back():
    from waterwave._C import OutOfMemoryError

    assert ran_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert ran_out_of_memory(OutOfMemoryError("out of memory"))
    assert not ran_out_of_memory(RuntimeError("out of memory"))
    assert not ran_out_of_memory(None)


class Stats:
    """An allocator's cap, as ``MemoryProbe`` reads and sets it."""

    def __init__(self, fraction: float, total: int):
        self.fraction, self.total, self.set = fraction, total, []

    def mem_get_info(self, device):
        return self.total // 2, self.total

    def get_per_process_memory_fraction(self, device):
        return self.fraction

    def set_per_process_memory_fraction(self, fraction, device):
        self.set.append(fraction)
        self.fraction = fraction


def test_a_probe_caps_the_allocator_for_the_block_and_puts_its_cap_back():
    total = 79 * 2**30
    probe = MemoryProbe.__new__(MemoryProbe)
    probe.stats, probe.device = Stats(1.0, total), 0
    with probe.capped_at(646 * 2**20):
        assert int(probe.stats.fraction * total) == 646 * 2**20  # exactly, not a byte short
    assert probe.stats.fraction == 1.0 and len(probe.stats.set) == 2
    probe.stats = Stats(0.25, total)
    with pytest.raises(KeyError):
        with probe.capped_at(total // 2):  # above the cap already there: left alone
            assert probe.stats.set == []
            raise KeyError("the block's error")
    assert probe.stats.set == [] and probe.stats.fraction == 0.25


class CappingProbe:
    """A GPU's allocator as the trainer's probe sees it: each group measured
    (nothing held after it, 1 MiB risen while it ran), the bytes allocated
    in all, and each cap a block ran under."""

    def __init__(self, allocated):
        self.allocated, self.caps, self.device, self.inside = allocated, [], 0, False
        self.stats = self

    def start(self):
        return 0

    def since(self, start):
        return 0, 1 << 20  # a workspace in every group

    def own_peaks(self, stream):
        return None

    def available(self):
        return 1 << 40

    def memory_allocated(self, device):
        return self.allocated()

    @contextlib.contextmanager
    def capped_at(self, cap):
        self.caps.append(cap)
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_the_side_by_side_probe_runs_under_the_budget_beside_what_the_process_holds(monkeypatch):
    """The allocator is capped for each run side by side (the probe, and
    the guarded steps after it where it is chosen) at the trainer's limit
    beside what the process holds outside the jobs (all it holds less what
    they hold between steps), and only for those."""
    as_on_a_gpu(monkeypatch)
    a, b = Twin(8, 24), Twin(9, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    outside = 5 << 20
    probe = CappingProbe(lambda: outside + sum(m.held() for m in trainer.members))
    trainer._memory_probe = lambda members: probe
    trainer.run(1)  # measured alone; no limit, so side by side
    limit = trainer.memory_limit = sum(peak_alone(m) for m in trainer.members) - 1
    capped = []
    run_rounds = trainer._run_rounds

    def rounds(members, steps, sched=None):
        capped.append((sched.pairing if sched else None, probe.inside))
        run_rounds(members, steps, sched)

    trainer._run_rounds = rounds
    trainer.run(12)
    assert capped[0] == (FREE, True) and len(probe.caps) >= 1
    assert probe.caps == [limit + outside] * len(probe.caps)
    assert all(inside == (way == FREE) for way, inside in capped)
    assert len(probe.caps) == sum(way == FREE for way, _ in capped)
    a.check(13)
    b.check(13)


def test_side_by_side_is_not_probed_while_anything_else_trains_on_the_device(cpu_session_plans):
    """A sharing member training beside the trainer could allocate past
    what the cap set for the probe counts for it, in a step that cannot be
    put back: while one trains, the trainer probes as on the CPU."""
    cpu_session_plans.configure(memory_limit=64 << 20)
    a, b = Twin(10, 24), Twin(11, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    for m in trainer.members:  # their steps as on a GPU
        m.step_fn.device = "cuda"
    try:
        assert not cpu_session_plans.others_training(trainer)
        assert trainer._probed(trainer.members) == PROBED
        beside = model(12, 8)
        with ww.sharing(beside, cpu_session_plans):
            assert cpu_session_plans.others_training(trainer)
            assert trainer._probed(trainer.members) == CPU_PROBES
        assert trainer._probed(trainer.members) == PROBED
    finally:
        for m in trainer.members:
            m.step_fn.device = "cpu"


def free_when_it_fits(monkeypatch):
    """The session takes side by side wherever its probe fitted (on the
    CPU the fastest way is the machine's to say)."""
    real = concurrent.choose

    def choose(alone, limit, probes=None):
        if probes and probes.get(FREE) is not None and set(probes) == set(PROBED):
            return Choice(FREE, "fastest of the probes (free, as the test takes it)")
        return real(alone, limit, probes)

    monkeypatch.setattr(concurrent, "choose", choose)


def free_runs(trainer) -> list:
    """The steps of each side-by-side run of ``trainer``, in order."""
    runs, run_rounds = [], trainer._run_rounds

    def rounds(members, steps, sched=None):
        if sched is not None and sched.pairing == FREE:
            runs.append(steps)
        run_rounds(members, steps, sched)

    trainer._run_rounds = rounds
    return runs


# The steps a session trainer takes to choose (each job alone, then its
# probes), and its side-by-side runs up to the end of its first guarded steps.
PROBING = 1 + SIDE_BY_SIDE_PROBE_STEPS + 3 * PROBE_STEPS
FIRST_RUNS = [SIDE_BY_SIDE_PROBE_STEPS] + [GUARD_CHUNK] * (GUARDED_STEPS // GUARD_CHUNK)


def guarded_pair(monkeypatch, seeds: tuple[int, int]):
    """Two twins under a session trainer that chooses side by side from its
    probe, as on a GPU, under a tight limit."""
    as_on_a_gpu(monkeypatch)
    free_when_it_fits(monkeypatch)
    a, b = Twin(seeds[0], 24), Twin(seeds[1], 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    trainer.memory_limit = tight(trainer)
    return a, b, trainer


def test_side_by_side_chosen_from_its_probe_runs_guarded_in_chunks_doubling(monkeypatch):
    """Chosen from its probe, side by side runs every later step from
    checkpoints: GUARDED_STEPS steps GUARD_CHUNK at a time, then chunks
    twice as long each (the last cut to the steps asked)."""
    a, b, trainer = guarded_pair(monkeypatch, (13, 14))
    runs = free_runs(trainer)
    kept = []

    def checkpoint(job):
        kept.append(job)
        return JobCheckpoint(job)

    monkeypatch.setattr(concurrent, "JobCheckpoint", checkpoint)
    steps = PROBING + GUARDED_STEPS + 2 * GUARD_CHUNK + 4 * GUARD_CHUNK + 5
    trainer.run(steps)
    assert trainer.stats()["session"]["ran"] == FREE
    assert runs == FIRST_RUNS + [2 * GUARD_CHUNK, 4 * GUARD_CHUNK, 5]
    assert len(kept) == 2 * len(runs)  # every side-by-side run from both jobs' checkpoints
    a.check(steps)
    b.check(steps)


def test_guarded_chunks_double_up_to_the_most():
    chunks, guarded = [], 0
    while guarded < 20 * GUARD_CHUNK_MOST:
        chunks.append(guard_chunk(guarded))
        guarded += chunks[-1]
    first = len(FIRST_RUNS) - 1  # the probe's run is no chunk
    assert chunks[:first] == FIRST_RUNS[1:]
    doubling = chunks[first:]
    assert doubling[0] == 2 * GUARD_CHUNK
    assert all(b == min(2 * a, GUARD_CHUNK_MOST) for a, b in zip(doubling, doubling[1:]))
    assert doubling[-1] == GUARD_CHUNK_MOST
    # A chunk cut short by the steps asked: the next is no shorter.
    assert guard_chunk(GUARDED_STEPS + 5) == 2 * GUARD_CHUNK
    assert guard_chunk(GUARDED_STEPS + 2 * GUARD_CHUNK + 1) == 4 * GUARD_CHUNK


def test_a_job_that_runs_out_in_a_guarded_step_is_put_back_and_side_by_side_dropped(monkeypatch):
    """The second job runs out in the second guarded chunk: it is put back
    to the chunk's start and trains it again alone; side by side no longer
    counts, the fastest other probe runs the rest; both jobs train exactly
    as their eager loops."""
    a, b, trainer = guarded_pair(monkeypatch, (15, 16))
    groups = len(trainer.member(b.job).partition.groups)
    # Armed in every side-by-side run: the probe's 4 steps, the first chunk's 8,
    # then the second chunk's third step.
    at = (SIDE_BY_SIDE_PROBE_STEPS + GUARD_CHUNK + 2) * groups + 2
    state = run_out_in_free_probe(trainer, b.job, at)
    runs = free_runs(trainer)
    steps = PROBING + 3 * GUARD_CHUNK
    trainer.run(steps)
    assert state["calls"] == at
    assert runs == [SIDE_BY_SIDE_PROBE_STEPS, GUARD_CHUNK, GUARD_CHUNK]  # then no more
    assert trainer.stats()["put_back"] == 1
    chose = trainer.stats()["session"]
    assert chose["ran"] != FREE and "free did not fit" in chose["why"]
    assert not b.job.failed
    a.check(steps)
    b.check(steps)


def test_a_job_that_runs_out_long_after_the_first_guarded_steps_is_put_back(monkeypatch):
    """The first job runs out in the third step of the chunk after the
    first GUARDED_STEPS (a chunk of 2 * GUARD_CHUNK): it is put back to that
    chunk's start and trains it again alone, side by side is dropped, and
    both jobs train exactly as their eager loops."""
    a, b, trainer = guarded_pair(monkeypatch, (17, 18))
    groups = len(trainer.member(a.job).partition.groups)
    at = (SIDE_BY_SIDE_PROBE_STEPS + GUARDED_STEPS + 2) * groups + 1
    state = run_out_in_free_probe(trainer, a.job, at)
    runs = free_runs(trainer)
    steps = PROBING + GUARDED_STEPS + 2 * GUARD_CHUNK + 6
    trainer.run(steps)
    assert state["calls"] == at
    assert runs == FIRST_RUNS + [2 * GUARD_CHUNK]  # then no more
    assert trainer.stats()["put_back"] == 1
    assert trainer.stats()["session"]["ran"] != FREE
    assert not a.job.failed
    a.check(steps)
    b.check(steps)


def accumulating_twin(seed: int, width: int) -> Twin:
    """A job that accumulates two batches a step, its data's last batch
    shorter (a capture of its own), and its eager loop."""
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g))
               for n in (16, 16, 16, 16, 16, 10)]
    return Twin(seed, width, batches, accumulate=2)


def test_an_accumulating_job_put_back_trains_its_batches_again_in_order(monkeypatch):
    """Accumulating two batches a step, with a short last batch: the job
    put back after running out in the probe's last step (its second step
    took the short batch, through a capture of its own, whose groups the
    count here leaves out) trains the same batches again, each step's pair
    together, as its eager loop does."""
    as_on_a_gpu(monkeypatch)
    a, b = Twin(17, 24), accumulating_twin(18, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    trainer.memory_limit = tight(trainer)
    groups = len(trainer.member(b.job).partition.groups)
    state = run_out_in_free_probe(trainer, b.job, 2 * groups + 3)
    trainer.run(13)
    assert state["calls"] == 2 * groups + 3
    assert "free did not fit" in trainer.stats()["session"]["why"]
    a.check(13)
    b.check(13)


def test_an_interrupt_in_the_probe_still_puts_back_a_job_that_ran_out(monkeypatch):
    """Ctrl-C (``interrupt()``) arrives as a job runs out of memory in the
    side-by-side probe: the caller gets KeyboardInterrupt, the job is put
    back rather than failed, its data keeps nothing more for the probe, and
    the next run trains it on exactly as its eager loop."""
    as_on_a_gpu(monkeypatch)
    a, b = Twin(19, 24), Twin(20, 40)
    trainer = ww.ConcurrentTrainer([a.job, b.job], schedule="session")
    trainer.memory_limit = tight(trainer)
    run_out_in_free_probe(trainer, b.job, 3, also=trainer.interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(13)
    assert not b.job.failed and b.job.batches._recorded is None
    assert trainer.stats()["put_back"] == 1
    assert a.job.batches._recorded is None
    done = len(b.job.losses)
    trainer.run(13)
    assert len(b.job.losses) == done + 13
    b.check(done + 13)


def test_a_job_with_a_grad_scaler_put_back_scales_as_its_eager_recipe(monkeypatch):
    """float16 autocast with a GradScaler, one batch in three holding an
    inf (that step skipped, the scale halved): put back after its probe's
    steps halved the scale, the job's scale, losses, parameters and Adam's
    state end as the eager recipe's."""
    as_on_a_gpu(monkeypatch)
    g = torch.Generator().manual_seed(21)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]
    bad = data[1][0].clone()
    bad[0, 0] = float("inf")
    data[1] = (bad, data[1][1])
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    reference = copy.deepcopy(net)

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)

    ref_opt, ref_scaler, expected = torch.optim.Adam(reference.parameters(), lr=0.01), scaler(), []
    steps = 13
    for i in range(steps):
        x, y = data[i % 3]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = LOSS(reference(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        expected.append(loss.item())
    opt, ours = torch.optim.Adam(net.parameters(), lr=0.01), scaler()
    job = ww.Job(net, loss_fn=LOSS, optimizer=opt, data=data, autocast_dtype=torch.float16,
                 grad_scaler=ours, name="scaled")
    other = Twin(22, 24)
    trainer = ww.ConcurrentTrainer([other.job, job], schedule="session")
    trainer.memory_limit = tight(trainer)
    groups = len(trainer.member(job).partition.groups)
    state = run_out_in_free_probe(trainer, job, 3 * groups + 1)  # the probe's last step
    trainer.run(steps)
    assert state["calls"] == 3 * groups + 1 and trainer.stats()["put_back"] == 1
    torch.testing.assert_close(job.losses, expected, equal_nan=True)
    assert ours.state_dict() == ref_scaler.state_dict()
    for a, b in zip(reference.parameters(), net.parameters()):
        assert torch.equal(a, b)
        for key, value in ref_opt.state[a].items():
            assert torch.equal(torch.as_tensor(opt.state[b][key]), torch.as_tensor(value)), key
    other.check(steps)
