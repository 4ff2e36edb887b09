"""What a short trial costs through ``job.train`` against its eager loop, on
the CPU: the trials of a digits-sized search (MLPs of widths 64-256 and 1-3
hidden layers, SGD with momentum at a trial's own learning rate, batch 64,
``--epochs`` epochs of 22 batches), each built and trained from scratch, one
trial at a time and ``--jobs`` at once from threads (as Optuna's ``n_jobs``
runs them). Three ways through ``job.train``: in the CPU's session as it
comes, which has no budget, so counts nothing and trains each step eagerly
(``job.train``); in one given a budget (``memory_limit``, far above what
the trials hold), where each call's steps run eagerly as a
``waterwave.sharing`` member, counted under the budget, as a GPU's session
runs them by default (``job.train, shared``); and in one with the budget
and ``capture=True``, which captures each trial's step and plans it
(``job.train, planned``).

    python bench/concurrent/trial_cost.py [--trials 12] [--epochs 8] [--jobs 4] [--repeats 3]
                                          [--out bench/results]

Each mode runs in a fresh process, the modes in turn, ``--repeats`` times;
the table gives each mode's median wall time for the whole search and its
ratio to the eager loops run the same way. ``--in-process``: every mode in
this one process instead, after one warm-up search each, the modes taking
turns ``--repeats`` times: what a process pays once is paid before the
clock, and the machine's drift falls on every mode alike (an A/B of two
versions runs it once per version, in turn). ``job.train``'s time includes
making each trial's ``Job`` and, planned, its capture (reused across trials
of one structure, ``waterwave.capturing.trace_cache``), its guards and its
first calls; the eager loops' includes nothing more than the loops. Results go to
trial_cost.{json,md} (with ``--warm``: trial_cost_warm.{json,md}), naming
the machine. A benchmark, not a test: the target (within 10% of eager) is
read from the table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_measured import child_env  # noqa: E402  (one way to start a way's process)
MODES = ("eager", "job.train", "job.train, shared", "job.train, planned")
PLANNING_LIMIT = 1 << 40  # a budget the trials never come near: the session plans


def configs(trials: int) -> list[tuple[int, int, float]]:
    """A fixed search's trials: (width, hidden layers, learning rate), the
    structures repeating as a sampler's choices do."""
    widths, depths = (64, 128, 256), (1, 2, 3)
    return [(widths[k % 3], depths[(k // 3) % 3], 0.01 * (1 + k % 7)) for k in range(trials)]


def run_mode(mode: str, trials: int, epochs: int, jobs: int, warm: bool = False) -> float:
    """The whole search in this process: seconds. ``warm``: first, off the
    clock, one trial of a structure the search has not (width 32), so that
    neither mode's time holds what a process pays once (importing the
    optimizers', and the capture's, machinery) and no trace is reused from
    it."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, y = torch.randn(1437, 64), torch.randint(0, 10, (1437,))
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1408, 64)]  # 22 batches

    def build(width, layers):
        mods, features = [], 64
        for _ in range(layers):
            mods += [torch.nn.Linear(features, width), torch.nn.ReLU()]
            features = width
        return torch.nn.Sequential(*mods, torch.nn.Linear(features, 10))

    def eager(width, layers, lr):
        model = build(width, layers)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for _ in range(epochs):
            for xb, yb in batches:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()

    session = None  # the CPU's own: it plans nothing

    def captured(width, layers, lr):
        import waterwave as ww

        model = build(width, layers)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=batches)
        for _ in range(epochs):
            job.train(steps=len(batches), session=session)

    trial = eager if mode == "eager" else captured
    if mode != "eager":
        import waterwave as ww  # imported before the clock, as a user's script does

        if mode != "job.train":
            session = ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT,
                                         capture=mode == "job.train, planned")
    if warm:
        trial(32, 1, 0.01)
    todo = list(configs(trials))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            trial(*c)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--warm", action="store_true",
                    help="each process first trains one trial of another structure, off the "
                         "clock: the cost per trial without what a process pays once")
    ap.add_argument("--in-process", action="store_true",
                    help="every mode in this process, after a warm-up search each, the modes "
                         "taking turns")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "JOBS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(args.child[0], args.trials, args.epochs, int(args.child[1]),
                                  args.warm)))
        return 0
    seconds: dict = {}
    if args.in_process:
        for jobs in (1, args.jobs):
            for mode in MODES:  # the warm-up: what the process pays once, off the clock
                run_mode(mode, args.trials, args.epochs, jobs)
            for _ in range(args.repeats):
                for mode in MODES:
                    seconds.setdefault(f"{jobs}", {}).setdefault(mode, []).append(
                        run_mode(mode, args.trials, args.epochs, jobs))
    for _ in range(0 if args.in_process else args.repeats):
        for jobs in (1, args.jobs):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--trials", str(args.trials),
                                      "--epochs", str(args.epochs), "--child", mode, str(jobs),
                                      *(["--warm"] if args.warm else [])],
                                     capture_output=True, text=True, check=True,
                                     env=child_env())
                seconds.setdefault(f"{jobs}", {}).setdefault(mode, []).append(
                    json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for jobs, by_mode in seconds.items():
        eager = statistics.median(by_mode["eager"])
        for mode in MODES:
            median = statistics.median(by_mode[mode])
            rows.append({"jobs": int(jobs), "mode": mode, "median_s": median,
                         "runs_s": by_mode[mode], "to_eager": median / eager})
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    threads = os.environ.get("OMP_NUM_THREADS")
    report = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "trials": args.trials,
              "epochs": args.epochs, "repeats": args.repeats, "warm": args.warm,
              "in_process": args.in_process, "omp_num_threads": threads, "rows": rows}
    stem = ("trial_cost_in_process" if args.in_process
            else "trial_cost_warm" if args.warm else "trial_cost")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    how = ([" Every mode in one process, after a warm-up search each, the modes taking "
            "turns."] if args.in_process
           else [" Each process first trained one trial of another structure (width 32), off "
                 "the clock."] if args.warm else [])
    if threads:
        how.append(f" OMP_NUM_THREADS={threads}.")
    lines = ["# A short trial through job.train against its eager loop (measured, CPU)", "",
             f"{machine}, {report['date']}: {args.trials} digits-sized trials of {args.epochs} "
             f"epochs, medians of {args.repeats} runs (`python bench/concurrent/trial_cost.py"
             f"{' --in-process' if args.in_process else ''}{' --warm' if args.warm else ''}`)."
             f"{''.join(how)}",
             "", "| trials at once | mode | search, s | runs, s | to eager |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['jobs']} | {r['mode']} | {r['median_s']:.2f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['runs_s'])} | {r['to_eager']:.2f} |")
    Path(args.out, f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
