"""What ``Job.train`` costs the host, on the CPU: the wall time per step of
k jobs trained with ``job.train`` (one job on the main thread; more from k
threads at once, as Optuna's ``n_jobs`` runs trials), against plain PyTorch
training the same jobs one after another in eager loops, and against eager
loops run from k threads at once, for a small MLP, resnet18 on 32x32
images and a small transformer encoder, with 1, 2 and 4 jobs.

    python bench/concurrent/train_host.py [--out bench/results] [--steps 30] [--repeats 5] [--quick]
                                          [--models M ...] [--jobs K ...] [--malloc default|no-trim|both]
                                          [--teams default|split|both] [--tag NAME]

Each job trains ``steps`` steps after one warm-up call (its capture is not
counted; an eager loop's first step is not either). A thread builds its own
job, as an objective builds its model in its trial's thread. Every
measurement runs in a fresh process, the modes in turn: run in one
process, whichever ran second was slowed by the memory the first left
behind. Each also counts the process's minor page faults and context
switches, where most of the differences on the CPU lie (glibc's
per-thread heaps, OpenMP's sleeping workers; see docs/results.md). The
session has a budget far above what the jobs hold: it plans their steps as
a GPU's session does (without one, the CPU's runs them eagerly), and the
jobs run side by side; on a 2-core machine they share its cores, as eager loops run one
after another do not. Results go to bench/results/train_host.{json,md},
naming the machine (``--tag NAME``: train_host_NAME.*, for a subset). A
benchmark, not a test: it prints what it measured, and the target (within
10% of eager for resnet18 and the transformer) is read from the table.

``--teams split``: k jobs from k threads, each thread's OpenMP team
``cores // k`` (at least 1), set by ``torch.set_num_threads`` before the
threads start, as a user running k trials at once on a CPU would; the eager
loops one after another keep every core. Each thread then runs its
operators with fewer threads, so its roundings are an eager loop's with that
many threads, not those of the loops one after another with all cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import waterwave as ww  # noqa: E402

PLANNING_LIMIT = 1 << 40  # a budget no job comes near (see _run_mode)


class SmallTransformer(torch.nn.Module):
    """Token classification by a 2-layer encoder (d_model 128, 4 heads)."""

    def __init__(self, vocab=1000, d=128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def make(model_name: str, seed: int):
    """(model, a list of batches) for one job."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
        data = [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))
                for _ in range(4)]
    elif model_name == "resnet18-32":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        data = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(4)]
    elif model_name == "transformer":
        model = SmallTransformer()
        data = [(torch.randint(0, 1000, (16, 64), generator=g),
                 torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    else:
        raise ValueError(f"unknown model {model_name!r}")
    return model, data


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _eager_job(model_name: str, k: int):
    """A function that trains job k eagerly for n steps, warmed up by one step
    (as the job's first call is)."""
    model, data = make(model_name, k)
    opt = optimizer(model)
    done = [0]

    def train(n: int) -> None:
        for _ in range(n):
            x, y = data[done[0] % len(data)]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
            done[0] += 1

    train(1)
    return train


def _waterwave_job(model_name: str, k: int, session):
    """A function that trains job k by ``job.train``, after a warm-up call
    (the first call cuts the step into groups)."""
    model, data = make(model_name, k)
    job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=optimizer(model), data=data)
    job.train(1, session=session)

    def train(n: int) -> None:
        job.train(n, session=session)
        if job.failed:
            raise RuntimeError(f"the job failed: {job.error!r}")
    return train


def _timed(run) -> dict:
    """``run()``'s wall seconds, and the process's minor page faults and
    context switches meanwhile."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "page_faults": after.ru_minflt - before.ru_minflt,
            "context_switches": (after.ru_nvcsw + after.ru_nivcsw
                                 - before.ru_nvcsw - before.ru_nivcsw)}


def run_mode(model_name: str, jobs: int, steps: int, mode: str, teams: str = "default") -> dict:
    """One measurement: the wall seconds (and the process's page faults and
    context switches) for ``jobs`` jobs of ``steps`` steps each.

    ``eager``: eager loops one after another on the main thread, each built
    there. ``eager-threads``: eager loops from a thread each, at once.
    ``train``: ``job.train`` (one job: on the main thread, as a plain loop
    calls it; more: from a thread each, at once). Threads build their own
    job, as an Optuna objective builds its model in the trial's thread: a
    model built on the main thread would start an OpenMP thread team there
    too, and with more OpenMP threads than cores every parallel region
    wakes sleeping workers (libgomp spins only 100 times before sleeping
    then), which slows eager loops and ``job.train`` alike. ``teams``
    "split": the threads' teams share the cores (see the opening)."""
    if teams == "split" and mode != "eager":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))
    return {**_run_mode(model_name, jobs, steps, mode), "team": torch.get_num_threads()}


def _run_mode(model_name: str, jobs: int, steps: int, mode: str) -> dict:
    if mode == "eager":
        made = [_eager_job(model_name, k) for k in range(jobs)]
        return _timed(lambda: [train(steps) for train in made])
    # A budget the jobs never come near: the session plans their steps
    # (captured, paired) as a GPU's does, where without one it runs them eagerly.
    session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT) if mode == "train" else None

    def build(k):
        return (_eager_job(model_name, k) if mode == "eager-threads"
                else _waterwave_job(model_name, k, session))
    if jobs == 1 and mode == "train":
        train = build(0)
        return _timed(lambda: train(steps))
    go = threading.Barrier(jobs + 1)
    errors: list[BaseException] = []

    def thread(k):
        try:
            train = build(k)
        except BaseException as e:
            errors.append(e)
            go.abort()
            return
        try:
            go.wait()
            train(steps)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=thread, args=(k,)) for k in range(jobs)]
    for t in threads:
        t.start()
    try:
        go.wait()
    except threading.BrokenBarrierError:
        pass
    measured = _timed(lambda: [t.join() for t in threads])
    if errors:
        raise RuntimeError(f"a job failed: {errors[0]!r}")
    return measured


# glibc's malloc settings a measurement runs under (read at process start).
# By default glibc gives the top of its heap back to the system whenever
# more than a threshold is free there, and the next step faults those pages
# in again; how often depends on where long-lived tensors sit in the heap,
# so it differs between eager loops (whose gradients live from one step to
# the next) and a captured step (whose gradients die at their update).
# "no trim" keeps freed memory in the process, as PyTorch's CPU tuning guide
# gets by recommending jemalloc or TCMalloc, so that what is left is the
# cost of the training loops themselves.
MALLOC = {"default": {}, "no-trim": {"MALLOC_TRIM_THRESHOLD_": str(4 << 30),
                                     "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}}


def measure_here(model_name: str, jobs: int, steps: int, mode: str, malloc: str = "default",
                 teams: str = "default") -> dict:
    """One measurement in this process (``--quick``: the suite's check that
    the benchmark runs and reports; its figures are not comparable, since
    each measurement runs beside what the ones before left behind). The
    OpenMP team is put back afterwards."""
    if malloc != "default":
        raise ValueError("glibc's malloc settings are read at process start: measure() them")
    threads = torch.get_num_threads()
    try:
        return run_mode(model_name, jobs, steps, mode, teams)
    finally:
        torch.set_num_threads(threads)


def measure(model_name: str, jobs: int, steps: int, mode: str, malloc: str = "default",
            teams: str = "default") -> dict:
    """One measurement, in a fresh process, under the ``malloc`` settings."""
    env = {**os.environ, **MALLOC[malloc]}
    r = subprocess.run([sys.executable, __file__, "--one", model_name, str(jobs), str(steps), mode,
                        teams],
                       capture_output=True, text=True, timeout=900, check=False, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} {model_name} x{jobs} ({malloc} malloc) failed: "
                           f"{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--malloc", choices=[*MALLOC, "both"], default="both",
                    help="glibc malloc settings to measure under (default: both)")
    ap.add_argument("--teams", choices=["default", "split", "both"], default="both",
                    help="OpenMP teams of k threads: each all cores, or sharing them (default both)")
    ap.add_argument("--models", nargs="+", choices=["mlp", "resnet18-32", "transformer"])
    ap.add_argument("--jobs", nargs="+", type=int)
    ap.add_argument("--tag", default="", help="write train_host_TAG.{json,md}")
    ap.add_argument("--quick", action="store_true",
                    help="one model, 1 and 2 jobs, 3 steps, default malloc, all in this "
                         "process (a check that it runs: figures not comparable)")
    ap.add_argument("--one", nargs=5, metavar=("MODEL", "JOBS", "STEPS", "MODE", "TEAMS"),
                    help=argparse.SUPPRESS)  # one measurement: what measure() runs
    args = ap.parse_args(argv)
    if args.one:
        model_name, jobs, steps, mode, teams = args.one
        print(json.dumps(run_mode(model_name, int(jobs), int(steps), mode, teams)))
        return 0
    models = ["mlp"] if args.quick else args.models or ["mlp", "resnet18-32", "transformer"]
    counts = [1, 2] if args.quick else args.jobs or [1, 2, 4]
    team_kinds = ["default", "split"] if args.teams == "both" else [args.teams]
    steps = 3 if args.quick else args.steps
    repeats = 1 if args.quick else args.repeats
    mallocs = (["default"] if args.quick else
               list(MALLOC) if args.malloc == "both" else [args.malloc])
    one = measure_here if args.quick else measure
    rows = []
    cases = [(m, j, a, t) for m in models for j in counts for a in mallocs for t in team_kinds
             if j > 1 or t == "default"]  # one job: one team either way
    for model_name, jobs, malloc, teams in cases:
        modes = ["eager", "train"] if jobs == 1 else ["eager", "eager-threads", "train"]
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(repeats):  # in turn, so that drift hits all alike
            for mode in modes:
                runs[mode].append(one(model_name, jobs, steps, mode, malloc, teams))
        row = {"model": model_name, "jobs": jobs, "malloc": malloc, "teams": teams,
               "steps_per_job": steps}
        for mode, got in runs.items():
            key = mode.replace("-", "_")
            row[f"{key}_ms_per_step"] = 1000 * statistics.median(
                r["seconds"] for r in got) / (jobs * steps)
            row[f"{key}_ms_per_step_runs"] = [1000 * r["seconds"] / (jobs * steps)
                                              for r in got]
            row[f"{key}_page_faults_per_step"] = statistics.median(
                r["page_faults"] for r in got) / (jobs * steps)
            row[f"{key}_context_switches_per_step"] = statistics.median(
                r["context_switches"] for r in got) / (jobs * steps)
            row[f"{key}_team"] = got[0]["team"]
        row["ratio"] = row["train_ms_per_step"] / row["eager_ms_per_step"]
        if jobs > 1:
            row["ratio_to_eager_threads"] = (row["train_ms_per_step"]
                                             / row["eager_threads_ms_per_step"])
        rows.append(row)
        threads = (f", eager from threads {row['eager_threads_ms_per_step']:7.2f}"
                   if jobs > 1 else "")
        print(f"{model_name:12} {jobs} job(s), {malloc} malloc, {teams} teams: eager one after another "
              f"{row['eager_ms_per_step']:7.2f} ms/step{threads}, job.train "
              f"{row['train_ms_per_step']:7.2f} ms/step ({row['ratio']:.2f}x)", flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)")
    os.makedirs(args.out, exist_ok=True)
    name = f"train_host_{args.tag}" if args.tag else "train_host"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    lines = ["# Job.train's host cost against eager loops (measured on the CPU)", "",
             f"Machine: {machine}; {time.strftime('%Y-%m-%d')}. Made by "
             "`python bench/concurrent/train_host.py`: per figure, the median of "
             f"{repeats} runs of {steps} steps per job, after a warm-up call, each run in a fresh "
             "process" + (" (--quick: all in one process; not comparable)" if args.quick else "")
             + ".", "",
             "glibc malloc: `default`, or `no-trim` (MALLOC_TRIM_THRESHOLD_=4 GiB, "
             "MALLOC_MMAP_THRESHOLD_=32 MiB: freed memory stays in the process).", "",
             "OpenMP teams: `default`, every thread's team all cores; `split`, k threads' teams "
             "cores // k each (`torch.set_num_threads` before the threads start; the loops one "
             "after another keep all cores).", "",
             "| model | jobs | malloc | teams | eager, one after another | eager, a thread each | "
             "job.train | ratio to one after another | ratio to eager threads | "
             "page faults per step (eager / threads / job.train) | context switches per step "
             "(eager / threads / job.train) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, key, fmt):
        value = r.get(key)
        return "–" if value is None else format(value, fmt)
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['jobs']} | {r['malloc']} | {r.get('teams', 'default')} | "
            f"{r['eager_ms_per_step']:.2f} ms | "
            f"{cell(r, 'eager_threads_ms_per_step', '.2f')} | {r['train_ms_per_step']:.2f} ms | "
            f"{r['ratio']:.2f} | {cell(r, 'ratio_to_eager_threads', '.2f')} | "
            f"{r['eager_page_faults_per_step']:.0f} / "
            f"{cell(r, 'eager_threads_page_faults_per_step', '.0f')} / "
            f"{r['train_page_faults_per_step']:.0f} | "
            f"{r['eager_context_switches_per_step']:.0f} / "
            f"{cell(r, 'eager_threads_context_switches_per_step', '.0f')} / "
            f"{r['train_context_switches_per_step']:.0f} |")
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"results: {args.out}/{name}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
