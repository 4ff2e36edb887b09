"""The allocator inside PyTorch on a real GPU. Skipped without one.

Each test runs in its own process: PyTorch swaps its allocator once per
process, before CUDA is first used.
"""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=600, check=False,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


TRAIN = textwrap.dedent("""
    import json, torch, torchvision
    def setup():
        torch.manual_seed(0)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        net = torchvision.models.resnet18().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(8, 3, 64, 64, device="cuda")
        y = torch.randint(0, 1000, (8,), device="cuda")
        return net, opt, x, y
    def loop(net, opt, x, y, steps, losses):
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    def train(steps=4):
        net, opt, x, y = setup()
        losses = []
        loop(net, opt, x, y, steps, losses)
        return losses
    def two_jobs(ww):
        return [ww.Job(net, (x,), torch.nn.functional.cross_entropy, opt, targets=(y,),
                       name=f"job{k}") for k, (net, opt, x, y) in enumerate(setup() for _ in "ab")]
""")


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_training_matches_the_native_allocator(policy):
    native = run(TRAIN + "print(json.dumps({'losses': train()}))")
    ours = run(TRAIN + textwrap.dedent(f"""
    import waterwave as ww, waterwave.cuda as wc
    settings = ww.install_allocator(policy={policy!r})
    losses = train()
    s = wc.memory_stats(0)
    wc.check_invariants(0)
    print(json.dumps({{'losses': losses, 'backend': torch.cuda.memory.get_allocator_backend(),
                      'registration': settings['registration'],
                      'peak': s['allocated_bytes.all.peak'], 'errors': wc.free_errors()[0]}}))
    """))
    assert ours["backend"] == {"native": "waterwave", "pluggable": "pluggable"}[ours["registration"]]
    assert ours["peak"] > 0 and ours["errors"] == 0
    assert ours["losses"] == pytest.approx(native["losses"], rel=1e-5)


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_training_with_expandable_segments_matches_the_native_allocator(policy):
    """Pages mapped with CUDA's VMM calls (and moved between addresses under
    the waterwave policy) hold the right data: the losses equal native's,
    and reserved stays close to allocated."""
    native = run(TRAIN + "print(json.dumps({'losses': train()}))")
    ours = run(TRAIN + textwrap.dedent(f"""
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy={policy!r}, config="expandable_segments:True")
    losses = train()
    s = wc.memory_stats(0)
    wc.check_invariants(0)
    print(json.dumps({{'losses': losses, 'reserved': s['reserved_bytes.all.peak'],
                      'allocated': s['allocated_bytes.all.peak']}}))
    """))
    assert ours["losses"] == pytest.approx(native["losses"], rel=1e-5)
    # Pages, not whole segments: a few pages and a little splitting over allocated.
    assert ours["reserved"] <= 1.1 * ours["allocated"] + 64 * 1024**2


def test_cross_stream_reuse_keeps_data_intact():
    """A tensor freed while another stream still reads it (record_stream)
    must not be handed out under that read: the reader's result stays
    right even when the freeing stream allocates and writes at once."""
    out = run(textwrap.dedent("""
    import json, torch, waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave")
    side = torch.cuda.Stream()
    bad = 0
    for trial in range(20):
        x = torch.full((4096, 4096), float(trial + 1), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            acc = x.clone()
            for _ in range(30):      # keep the side stream busy on x
                acc = acc * 1.0 + x * 0.0
            total = acc.sum()
        x.record_stream(side)
        del x, acc
        y = torch.zeros((4096, 4096), device="cuda")  # may reuse x's block
        y += 7
        torch.cuda.synchronize()
        bad += int(total.item() != float(trial + 1) * 4096 * 4096)
        del y, total
    s = wc.memory_stats(0)
    wc.check_invariants(0)
    print(json.dumps({'bad': bad, 'waits': s['num_stream_waits'], 'errors': wc.free_errors()[0]}))
    """))
    assert out["bad"] == 0 and out["errors"] == 0


@pytest.mark.parametrize("policy", ["waterwave", "pytorch"])
def test_out_of_memory_is_torchs_and_halving_the_batch_trains(policy):
    """What training code does: catch torch.cuda.OutOfMemoryError, halve
    the batch, go on. The allocator stays sound, and nothing leaks."""
    out = run(textwrap.dedent(f"""
    import json, torch, torchvision, waterwave as ww, waterwave.cuda as wc
    settings = ww.install_allocator(policy={policy!r})
    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        first = None
    except torch.cuda.OutOfMemoryError as e:
        first = str(e)
    net = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batch, tried = 4096, []
    while True:
        tried.append(batch)
        try:
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            loss = net(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            break
        except torch.cuda.OutOfMemoryError:
            x = loss = None
            opt.zero_grad(set_to_none=True)
            batch //= 2
    del x, loss
    wc.check_invariants(0)
    print(json.dumps({{'oom_error': settings['oom_error'], 'first': first, 'tried': tried,
                      'errors': wc.free_errors()[0]}}))
    """))
    assert out["oom_error"] == "torch.cuda.OutOfMemoryError"
    assert out["first"].startswith("CUDA out of memory (Waterwave allocator). Tried to allocate")
    assert len(out["tried"]) >= 2 and out["tried"][-1] >= 32, out["tried"]
    assert out["errors"] == 0


def test_cupy_and_torch_share_the_allocator():
    """CuPy arrays on a CuPy stream and torch tensors come from one
    allocator; CuPy's out of memory is its own error type; data is right."""
    pytest.importorskip("cupy")
    out = run(textwrap.dedent("""
    import json, torch, cupy, waterwave as ww, waterwave.cuda as wc, waterwave.cupy as wcp
    ww.install_allocator()
    wcp.install()
    t = torch.ones(1 << 20, device="cuda")
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        a = cupy.ones(1 << 20, dtype=cupy.float32)
        total = float(a.sum())
    side.synchronize()
    streams = {b["stream"] for seg in wc.allocator(0).snapshot() for b in seg["blocks"]
               if b["state"] == "allocated"}
    both = wc.memory_allocated(0)
    free, whole = torch.cuda.mem_get_info()
    try:
        cupy.empty(2 * whole, dtype=cupy.uint8)
        oom = ""
    except cupy.cuda.memory.OutOfMemoryError as e:
        oom = str(e)
    shared = torch.from_dlpack(a)  # CuPy's memory, read by torch
    ok = float(shared.sum()) == float(1 << 20)
    del a, shared, t
    torch.cuda.synchronize()
    wc.check_invariants(0)
    print(json.dumps({'total': total, 'both': both, 'side_stream': side.ptr in streams, 'oom': oom,
                      'ok': ok, 'after': wc.memory_allocated(0), 'errors': wc.free_errors()[0]}))
    """))
    assert out["total"] == float(1 << 20) and out["ok"] and out["side_stream"]
    assert out["both"] >= 8 * 1024**2 and out["after"] == 0 and out["errors"] == 0
    assert out["oom"].startswith("CUDA out of memory (Waterwave allocator, CuPy)")


def test_planned_trainer_runs_from_the_plan():
    """waterwave.optimize on the GPU with the allocator installed: losses
    follow eager training; after a warm-up step and a recorded one, every
    allocation of a step comes from the plan."""
    eager = run(TRAIN + "print(json.dumps({'losses': train(5)}))")["losses"]
    out = run(TRAIN + textwrap.dedent("""
    import waterwave as ww
    ww.install_allocator()
    net, opt, x, y = setup()
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out, y)
    trainer = ww.optimize(net, (x,), loss_fn, opt, strategy="greedy", time_limit=5)
    losses = [float(trainer.step(x)) for _ in range(5)]
    print(json.dumps({'planned': losses, 'device': trainer.planned_device,
                      'stats': trainer.plan_stats(), 'packed': trainer.trace_plan}))
    """))
    assert out["device"] == 0
    assert out["planned"] == pytest.approx(eager, rel=1e-3)
    st = out["stats"]
    assert st["planned"] == 3 * out["packed"]["allocations"], (st, out["packed"])
    assert st["fallback"] == 0 and st["deviations"] == 0, st


def test_concurrent_trainer_takes_turns_on_the_waterwave_allocator():
    """Two ConcurrentTrainer jobs under a budget that holds one step at a
    time, on the Waterwave allocator: each job's first step is measured
    alone, then the jobs take turns, each stream keeping to its own large
    segments for the run (own_segments_first), small blocks crossing streams
    with the allocator's event waits. Each trains as it trains alone; the
    allocator stays sound (its invariants, no bad frees), and the setting is
    off again after the run."""
    eager = run(TRAIN + "print(json.dumps({'losses': train(4)}))")["losses"]
    out = run(TRAIN + textwrap.dedent("""
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128)
    jobs = two_jobs(ww)
    trainer = ww.ConcurrentTrainer(jobs)
    trainer.memory_limit = (sum(j.persistent_bytes() for j in jobs)
                            + int(1.5 * max(trainer.member(j).partition.peak for j in jobs)))
    losses = trainer.run(4)
    torch.cuda.synchronize()
    s, stats = wc.memory_stats(0), trainer.stats()
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'measured': [j['measured'] for j in stats['jobs']],
                      'spares': [j['segment_spare'] for j in stats['jobs']],
                      'small_spares': [j['small_pool_spare'] for j in stats['jobs']],
                      'errors': [j['error'] for j in stats['jobs']], 'rounds': stats['rounds_run'],
                      'groups': [j['groups'] for j in stats['jobs']],
                      'waits': s['num_stream_waits'], 'bad_frees': wc.free_errors()[0],
                      'own_after': [wc.allocator(0).config.own_segments_first,
                                    wc.allocator(0).own_segments_first_chosen()]}))
    """))
    assert out["errors"] == [None, None] and out["measured"] == [True, True]
    # Each job's stream's own segments were read in its measured step.
    assert all(isinstance(s, int) and s >= 0 for s in out["spares"])
    assert all(0 <= small <= s for small, s in zip(out["small_spares"], out["spares"]))
    assert out["rounds"] > 1  # not free: the budget holds one step at a time
    assert out["own_after"] == [False, False]  # the run's own setting, turned off after it
    for losses in out["losses"]:
        assert losses == pytest.approx(eager, rel=1e-3)
    assert out["bad_frees"] == 0


def test_a_trainers_side_by_side_probe_that_runs_out_puts_its_jobs_back():
    """Two ConcurrentTrainer jobs choosing their way (schedule="session")
    under a budget that holds one step at a time: side by side is probed
    under the budget set as the allocator's cap, runs out of memory
    halfway through a step, and the jobs it ran out in are put back from
    their host checkpoints and train those steps again alone. Each trains
    as it trains alone; the cap is the allocator's own again after the
    probe; the allocator stays sound."""
    eager = run(TRAIN + "print(json.dumps({'losses': train(12)}))")["losses"]
    out = run(TRAIN + textwrap.dedent("""
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128)
    jobs = two_jobs(ww)
    trainer = ww.ConcurrentTrainer(jobs, schedule="session")
    trainer.memory_limit = (sum(j.persistent_bytes() for j in jobs)
                            + int(1.5 * max(trainer.member(j).partition.peak for j in jobs)))
    losses = trainer.run(12)
    torch.cuda.synchronize()
    stats = trainer.stats()
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'why': stats['session']['why'],
                      'ran': stats['session']['ran'], 'put_back': stats['put_back'],
                      'errors': [j['error'] for j in stats['jobs']],
                      'fraction': wc.get_per_process_memory_fraction(0),
                      'bad_frees': wc.free_errors()[0]}))
    """))
    assert out["errors"] == [None, None]
    assert "free did not fit" in out["why"] and out["ran"] != "free"
    assert out["put_back"] >= 1
    assert out["fraction"] == 1.0  # the probe's cap was put back
    for losses in out["losses"]:
        assert losses == pytest.approx(eager, rel=1e-3)
    assert out["bad_frees"] == 0


def test_a_sharing_jobs_step_that_runs_out_before_its_update_runs_again():
    """A resnet18 job through job.train in a session with a budget (a
    sharing member): its third step's forward raises the allocator's
    out-of-memory error at its last layer, batch norm's statistics moved
    already. The step is undone on the GPU (the buffers copied back on the
    member's stream) and runs again alone; the job's losses are its eager
    loop's, and the allocator stays sound."""
    eager = run(TRAIN + "print(json.dumps({'losses': train(6)}))")["losses"]
    out = run(TRAIN + textwrap.dedent("""
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128)
    job = two_jobs(ww)[0]
    calls = {'n': 0}
    def run_out(*_):
        calls['n'] += 1
        if calls['n'] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
    job.model.fc.register_forward_pre_hook(run_out)
    session = ww.TrainingSession("cuda:0", memory_limit=4 << 30)
    losses = job.train(6, session=session)
    torch.cuda.synchronize()
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'put_back': session.stats()['put_back'],
                      'bad_frees': wc.free_errors()[0]}))
    """))
    assert out["put_back"] == 1
    assert out["losses"] == pytest.approx(eager, rel=1e-3)
    assert out["bad_frees"] == 0


def test_jobs_trained_from_two_threads_take_turns_and_train_as_alone():
    """Job.train from two threads on the Waterwave allocator, under a budget
    that holds one step at a time: each job's first step in the session is
    measured alone, then the jobs take turns; each trains as it trains
    alone, and the allocator stays sound. What each thread allocates
    evaluating between calls is measured on its thread."""
    eager = run(TRAIN + "print(json.dumps({'losses': train(6)}))")["losses"]
    out = run(TRAIN + textwrap.dedent("""
    import threading
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128)
    jobs = two_jobs(ww)
    session = ww.TrainingSession("cuda:0", capture=True)  # the pipeline's steps, measured
    from waterwave.exec.pipelined_job import PipelinedJob
    one_step = PipelinedJob(jobs[0], session.settings).partition.peak
    session.configure(memory_limit=sum(j.persistent_bytes() for j in jobs) + int(1.5 * one_step))
    losses = [[], []]
    def trial(k):
        for _ in range(3):  # three calls of two steps, evaluation between
            losses[k] += jobs[k].train(2, session=session)
            model = jobs[k].model
            with torch.no_grad():
                model.eval()
                model(torch.randn(2, 3, 64, 64, device="cuda"))
                model.train()
    threads = [threading.Thread(target=trial, args=(k,)) for k in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    torch.cuda.synchronize()
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'measured': [session.member(j).measured is not None for j in jobs],
                      'errors': [repr(j.error) for j in jobs if j.failed],
                      'most': session.stats()['most_training'],
                      'between': [j.between.rise for j in jobs], 'one_step': one_step,
                      'kept': [session.member(j).reserve() for j in jobs],
                      'bad_frees': wc.free_errors()[0]}))
    """))
    assert out["errors"] == [] and out["measured"] == [True, True]
    # Each thread's evaluation between calls was measured, and is kept for
    # it from then on. (Not bounded by the step's planned peak: on an H200,
    # resnet18 evaluating 2 images rose 34.7 MB, the planned step 23.8 MB,
    # since cuDNN's workspaces are not in the planned graph.)
    assert all(rise is not None and rise > 0 for rise in out["between"]), out["between"]
    assert out["kept"] == out["between"]
    for losses in out["losses"]:
        assert losses == pytest.approx(eager, rel=1e-3)
    assert out["bad_frees"] == 0


def test_what_a_script_changes_between_epochs_is_followed_on_the_gpu():
    """Job.train on CUDA with the Waterwave allocator, as fine-tuning runs:
    the stem frozen for the first call, then thawed (a new capture, its
    parameters' momentum starting then), a per-step warm-up stepped inside
    each call (step_schedulers). Against the same eager loop (SGD: within
    the rounding cuDNN leaves, as the other GPU tests)."""
    script = TRAIN + textwrap.dedent("""
    import waterwave as ww
    def fine_tune(step):
        net, opt, x, y = setup()
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
        losses = []
        for thaw in (False, True):
            net.conv1.requires_grad_(thaw)
            losses += step(net, opt, warm, x, y)
        return losses
    def eager(net, opt, warm, x, y):
        out = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            warm.step()
            out.append(loss.item())
        return out
    jobs = {}
    def job(net, opt, warm, x, y):
        if "job" not in jobs:
            jobs["job"] = ww.Job(net, (x,), torch.nn.functional.cross_entropy, opt,
                                 targets=(y,), step_schedulers=[warm])
        return jobs["job"].train(2)
    """)
    eager = run(script + "print(json.dumps({'losses': fine_tune(eager)}))")["losses"]
    out = run(script + textwrap.dedent("""
    import waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128)
    ww.training_session("cuda:0", capture=True)  # captured steps, a capture per variant
    losses = fine_tune(job)
    torch.cuda.synchronize()
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'captures': 1 + len(jobs['job']._by_variant),
                      'bad_frees': wc.free_errors()[0]}))
    """))
    assert out["captures"] == 2 and out["bad_frees"] == 0
    assert out["losses"] == pytest.approx(eager, rel=1e-3)


def test_the_optuna_objective_searches_on_the_gpu():
    """examples/optuna_search.py on CUDA tensors with the Waterwave allocator:
    four trials at a time, pruned ones leaving; the best reaches 90%."""
    pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "optuna_search.py"),
                        "--trials", "8", "--jobs", "4", "--epochs", "4"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on cuda" in r.stdout, r.stdout[-2000:]
    best = float(r.stdout.split("best held-out accuracy ")[1].split("%")[0])
    assert best >= 90, r.stdout[-2000:]


def test_float16_with_a_grad_scaler_trains_as_the_eager_recipe():
    """Job(autocast_dtype=float16, grad_scaler=...) on CUDA against the eager
    recipe (scale, backward, unscale_, clip, step, update): the same steps
    skipped and the same loss scale at every step, the same step count in
    the optimizer's state, and the same losses while rounding has not had
    time to grow. After that the runs are not compared: on CUDA the update's
    kernels round otherwise than eager Adam's multi-tensor ones, and in this
    recipe (loss from 6.9 to 0.005 in six steps) a change of lr by one or two
    units in the last place moves the 4th-6th losses by up to 6% and single
    parameters by up to 6.5e-3 (bench/rounding_spread.py, which measures
    it on the GPU too); on the CPU the same Job is bit-identical
    (tests/test_job_data.py)."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    code = textwrap.dedent(f"""
    import json, sys
    sys.path.insert(0, {bench!r})
    import waterwave as ww
    ww.install_allocator(policy="waterwave")
    from rounding_spread import train  # the recipe, eager and through job.train
    def run(mode):
        got = train("cuda", mode, steps=6)
        return {{"losses": got["losses"], "scales": got["scales"], "counts": got["step_counts"]}}
    print(json.dumps({{'eager': run("eager"), 'ours': run("job")}}))
    """)
    out = run(code)
    eager, ours = out["eager"], out["ours"]
    assert ours["scales"] == eager["scales"], out
    assert ours["counts"] == eager["counts"], out
    assert all(math.isfinite(v) for v in ours["losses"]), out
    # Steps 1-3: a skipped step and one update; on the CPU a 2-ulp change of
    # lr or of the clipping norm moved the 3rd loss by at most 3e-4.
    assert ours["losses"][:3] == pytest.approx(eager["losses"][:3], rel=5e-3), out


# Four trials side by side under PyTorch's own allocator, capped at a
# sharing test's limit: each step's forward runs, then all four wait for each
# other (a barrier) so that they hold their activations at once, as trials
# side by side do at some point, and only then go backward. Prefixed with
# the trials' script (setup() -> (net, opt, ...), forwards(*trial)), DEV and
# LIMIT.
NATIVE_SIDE_BY_SIDE = textwrap.dedent("""
    import threading
    if DEV == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            LIMIT / torch.cuda.get_device_properties(0).total_memory, 0)
    ooms, errors = [], []
    try:
        trials = [setup() for _ in range(4)]  # seeded on this thread
    except torch.OutOfMemoryError:
        trials, ooms = [], ["setup"]
    gate = threading.Barrier(max(1, len(trials)))
    def trial(k):
        opt = trials[k][1]
        try:
            for loss in forwards(*trials[k]):
                gate.wait(timeout=300)
                loss.backward()
                opt.step()
        except torch.OutOfMemoryError:
            ooms.append(k)
            gate.abort()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:
            errors.append(repr(e))
            gate.abort()
    threads = [threading.Thread(target=trial, args=(k,)) for k in range(len(trials))]
    [t.start() for t in threads]; [t.join() for t in threads]
    print(json.dumps({'ooms': ooms, 'errors': errors}))
""")


def assert_native_runs_out(script: str, limit: int) -> dict:
    """The four trials side by side under PyTorch's allocator at ``limit``
    (``NATIVE_SIDE_BY_SIDE``) run out of memory: the cap is one where
    sharing is needed."""
    native = run(script + f"\nDEV = 'cuda'\nLIMIT = {limit}\n" + NATIVE_SIDE_BY_SIDE)
    assert native["errors"] == [] and native["ooms"], native
    return native


def assert_shared_as_alone(out: dict, eager: list[float]) -> None:
    """Sharing trials under a limit below their sum side by side: none failed,
    the counted peak under the limit, each trial's losses its eager loop's,
    the allocator sound."""
    assert out["errors"] == []
    assert out["limit"] < out["side_by_side"]
    assert out["stats"]["peak_bytes"] <= out["limit"]
    for losses in out["losses"]:
        assert losses == pytest.approx(eager, rel=1e-3)
    assert out["bad_frees"] == 0


# Trials of a small transformer classifier: on the CPU four of them hold 1.5
# times the sharing cap at their forwards' ends.
TEXT = textwrap.dedent("""
    import json, torch
    import torch.nn.functional as F
    DEV = "cuda"
    def batches(n=6, size=16, seed=1):
        # Dynamic padding: each batch padded to its own longest sentence, so
        # every batch has a shape of its own, as a shuffled NLP loader gives.
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            lengths = torch.randint(8, 129, (size,), generator=g)
            width = int(lengths.max())
            pad = torch.arange(width)[None, :] >= lengths[:, None]
            ids = torch.randint(1, 1000, (size, width), generator=g).masked_fill(pad, 0)
            out.append((ids, pad, torch.randint(0, 4, (size,), generator=g)))
        return out
    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 256, padding_idx=0)
            layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = torch.nn.Linear(256, 4)
        def forward(self, ids, pad):
            h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
            keep = (~pad).unsqueeze(-1).float()
            return self.head((h * keep).sum(1) / keep.sum(1))
    def setup():
        torch.manual_seed(0)
        net = Classifier().to(DEV)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-4), batches()
    def loop(net, opt, data, losses):
        for ids, pad, labels in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(ids.to(DEV), pad.to(DEV)), labels.to(DEV))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    def forwards(net, opt, data):  # each step's loss, for its backward
        for ids, pad, labels in data:
            opt.zero_grad(set_to_none=True)
            yield F.cross_entropy(net(ids.to(DEV), pad.to(DEV)), labels.to(DEV))
""")
# resnet18 trials: on the CPU four hold 1.44 times the sharing cap at their
# forwards' ends (0.74 at batch 8 on 64x64, where PyTorch would not run out).
RESNET = textwrap.dedent("""
    import json, torch, torchvision
    import torch.nn.functional as F
    DEV = "cuda"
    def batches(n=6, size=32, side=128, seed=1):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(size, 3, side, side, generator=g),
                 torch.randint(0, 1000, (size,), generator=g)) for _ in range(n)]
    def setup():
        torch.manual_seed(0)
        if DEV == "cuda":
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        net = torchvision.models.resnet18().to(DEV)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), batches()
    def loop(net, opt, data, losses):
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x.to(DEV)), y.to(DEV))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    def forwards(net, opt, data):  # each step's loss, for its backward
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            yield F.cross_entropy(net(x.to(DEV)), y.to(DEV))
""")
# Four trials of a script (setup(), loop()), each in ww.sharing on a thread
# of its own, under a limit below their sum (each one's peak measured alone).
SHARE = textwrap.dedent("""
    import threading, time
    import waterwave as ww
    session = ww.training_session(DEV, memory_limit=None)
    alone = setup()
    with ww.sharing(alone[0]) as member:  # every batch once: the trial's own peak
        loop(*alone, [])
    peak, held = member.stats()["peak_bytes"], member.stats()["bytes"]
    del alone, member
    limit = 4 * held + int(1.5 * (peak - held))
    CAPPED = "under a cap" in WAY
    # Under a cap: the limit binds what the process reserves, as it binds
    # PyTorch's side by side (per_process_memory_fraction), and the session
    # measures its budget under it; else it is the session's memory_limit.
    session.configure(memory_limit=None if CAPPED else limit)
    session.reset_peak()
    if DEV == "cuda":  # what the allocator reserves beside what the members count
        import gc, waterwave.cuda as wc
        gc.collect()
        wc.empty_cache()
        wc.reset_peak_memory_stats(0)
        if CAPPED:
            torch.cuda.set_per_process_memory_fraction(
                limit / torch.cuda.get_device_properties(0).total_memory, 0)
    losses, errors = [[] for _ in range(4)], []
    trials = [setup() for _ in range(4)]  # seeded on this thread: each the same trial
    def trial(k):
        try:
            net, opt, data = trials[k]
            if WAY == "job.train":  # the same steps as a Job: eager members by default
                job = ww.Job(net, loss_fn=F.cross_entropy, optimizer=opt, data=data,
                             n_inputs=len(data[0]) - 1)
                losses[k] += job.train(len(data))
            else:
                with ww.sharing(net):
                    loop(net, opt, data, losses[k])
        except BaseException as e:
            errors.append(repr(e))
    start = time.perf_counter()
    threads = [threading.Thread(target=trial, args=(k,)) for k in range(4)]
    [t.start() for t in threads]; [t.join() for t in threads]
    if DEV == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
""")


@pytest.mark.parametrize("trials,way", [("resnet18", "ww.sharing"),
                                        ("transformers with dynamic padding", "ww.sharing"),
                                        ("resnet18", "job.train"),
                                        ("resnet18", "ww.sharing under a cap"),
                                        ("resnet18", "ww.sharing under a cap, fixed segments")])
def test_sharing_trials_train_as_alone_under_a_cap_where_side_by_side_runs_out(trials, way,
                                                                               capsys):
    """Issue 39, item 6, on a GPU: four trials, each its own eager loop
    under ``with ww.sharing(model):`` from its own thread, under a session
    memory_limit below what the four need side by side: no out of memory,
    each trial's losses its eager loop's, the counted peak under the limit,
    the allocator sound; the four side by side under PyTorch's allocator
    capped there run out of memory; the trials' samples per second
    reported. The trials: resnet18 (``RESNET``), or a small transformer
    classifier whose batches are padded each to its own longest sentence,
    no two of the same shape (``TEXT``). ``job.train``: each trial a ``Job``
    trained by ``job.train``, whose steps run so by default. ``under a
    cap``: the limit binds what the process reserves, the allocator's
    cache included, as it binds PyTorch's side by side
    (``per_process_memory_fraction``), and the session has no
    memory_limit: it measures its budget under the cap. (With a
    memory_limit the cache is not bound: on an H200 the allocator reserved
    19% above it while the members counted 10% below.) Under the cap the
    allocator maps expandable segments, as a user under a tight cap would:
    with fixed ones, on an H200 (2026-11-28, twice), one of the four failed
    in its backward, the reserved peak within 2 MiB of the cap while the
    members counted 9% below it: memory freed in pieces no segment could
    give. ``fixed segments`` holds that case to its error: any trial that
    fails, fails out of memory naming expandable segments, the others
    train as alone."""
    script = {"resnet18": RESNET, "transformers with dynamic padding": TEXT}[trials]
    eager = run(script + "losses = []; loop(*setup(), losses)\n"
                "print(json.dumps({'losses': losses}))")["losses"]
    expandable = way == "ww.sharing under a cap"
    out = run(script + textwrap.dedent(f"""
    import waterwave as ww, waterwave.cuda as wc
    ww.install_allocator(policy="waterwave", max_split_size_mb=128,
                         expandable_segments={expandable})
    """) + f"WAY = {way!r}\n" + SHARE + textwrap.dedent("""
    wc.check_invariants(0)
    print(json.dumps({'losses': losses, 'errors': errors, 'limit': limit,
                      'side_by_side': 4 * peak, 'stats': session.stats(), 'seconds': seconds,
                      'samples': 4 * sum(len(b[0]) for b in batches()),
                      'reserved_peak': wc.max_memory_reserved(0),
                      'bad_frees': wc.free_errors()[0],
                      'max_split': wc.allocator(0).stats()['max_split_size'],
                      'oom_retries': wc.allocator(0).stats().get('num_oom_retries')}))
    """))
    assert out["max_split"] == 128 * 2**20  # the user's setting stands (cache_splits)
    native = assert_native_runs_out(script, out["limit"]) if way == "ww.sharing" else None
    if "under a cap" in way:  # the allocator kept the cap, cache and all
        assert out["reserved_peak"] <= out["limit"]
    with capsys.disabled():
        print(f"\n{way} {trials}: {out['samples'] / out['seconds']:.0f} "
              f"samples/s for 4 trials under {out['limit'] / 2**20:.1f} MiB (side by side "
              f"{out['side_by_side'] / 2**20:.1f} MiB), counted peak "
              f"{out['stats']['peak_bytes'] / 2**20:.1f} MiB (the allocator's reserved peak "
              f"{out['reserved_peak'] / 2**20:.1f} MiB, {out['oom_retries']} out-of-memory "
              f"retries), waits {out['stats']['waits']}"
              + ("" if native is None else "; side by side under PyTorch's allocator at that "
                 f"cap: {len(native['ooms'])} of 4 ran out of memory"))
    if way.endswith("fixed segments"):  # a trial may fail, naming the fix
        assert all("OutOfMemoryError" in e and "expandable_segments=True" in e
                   for e in out["errors"]), out["errors"]
        out["losses"] = [losses for losses in out["losses"] if len(losses) == len(eager)]
        assert out["losses"], "every trial failed"
        out["errors"] = []
    assert_shared_as_alone(out, eager)
