"""What a shared ``job.train`` step costs the host over ``job.train``'s own
and over the bare eager loop, on the CPU, for one digits-sized MLP
(64 -> width -> width -> 10, SGD with momentum, batch 64, 22 batches):

* *ways*: the bare loop; ``job.train(steps)`` in the CPU's session as it
  comes (no budget: each step eager, nothing counted); *shared*, in a
  session given a budget far above what the job holds, where each call's
  steps run as a ``waterwave.sharing`` member, counted and gated, as a
  GPU's session runs them by default; and *planned*, in such a session with
  ``capture=True``: the step captured once and run from its plan, its
  optimizer's groups checked at every step. All in this one process, on one job
  each, the ways in a shuffled order each round, two calls a round:
  microseconds a step, medians and quartiles over ``--rounds``. With
  ``--threads K`` each way trains K jobs from K threads at once (as
  Optuna's ``n_jobs`` runs trials): the round's wall time over all K
  threads' steps.
* ``--phases``: the step inside a sharing block of the job's own kind
  (``job_sharing``), each phase timed (the pass boundary, forward and loss,
  backward, optimizer step, ``zero_grad`` and the loss read), with the
  member's pass boundary called before each forward and without it: what
  the boundary costs itself, and what it costs the operators after it.

    python bench/concurrent/step_cost.py [--width 128] [--steps 22] [--rounds 150]
                                         [--threads 1] [--phases] [--out bench/results]

An A/B of two versions runs it once per version, in turn (``PYTHONPATH`` at
each tree). Results go to step_cost.{json,md} (``--phases``:
step_cost_phases.*), naming the machine. A benchmark, not a test: nothing
here is a target.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("bare", "job.train", "shared", "planned")
PHASES = ("the boundary's call", "forward and loss", "backward", "optimizer step", "zero_grad and loss read")
BUDGET = 1 << 40  # a budget the job never comes near: every gate admits at once


def _setup(width: int):
    import torch
    import torch.nn.functional as F

    import waterwave as ww

    torch.manual_seed(0)
    x, y = torch.randn(1437, 64), torch.randint(0, 10, (1437,))
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1408, 64)]

    def job():
        model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, opt, ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=batches)
    # The sessions of the job.train ways that have one (job.train itself: the CPU's own).
    sessions = {"shared": ww.TrainingSession("cpu", memory_limit=BUDGET),
                "planned": ww.TrainingSession("cpu", memory_limit=BUDGET, capture=True)}
    return batches, job, sessions


def train_call(way: str, made: tuple, batches: list, steps: int, sessions: dict) -> None:
    """One call of ``way``: ``steps`` steps of the job ``made`` (``_setup``'s
    ``(model, optimizer, job)``), the bare loop's epoch after epoch of
    ``batches``, or ``job.train`` (in ``sessions[way]`` where it has one)."""
    import torch
    import torch.nn.functional as F

    model, opt, job = made
    with torch.enable_grad():  # a thread's own grad mode
        if way != "bare":
            job.train(steps=steps, session=sessions.get(way))
            return
        done = 0
        while done < steps:
            for xb, yb in batches[:steps - done]:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                done += 1


def ways(width: int, steps: int, rounds: int, threads: int = 1) -> dict:
    """Microseconds a step of each way: {way: [per round]}; from ``threads``
    threads at once, the wall time over every thread's steps."""
    batches, make, sessions = _setup(width)
    jobs = {(way, k): make() for way in WAYS for k in range(threads)}

    def call(way, k=0):
        train_call(way, jobs[(way, k)], batches, steps, sessions)

    def calls(way, n):
        if threads == 1:
            for _ in range(n):
                call(way)
            return
        workers = [threading.Thread(target=lambda k=k: [call(way, k) for _ in range(n)])
                   for k in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    for way in WAYS * 5:  # warm: measured passes, first calls
        calls(way, 1)
    us = {way: [] for way in WAYS}
    for _ in range(rounds):
        order = list(WAYS)
        random.shuffle(order)
        for way in order:
            start = time.perf_counter_ns()
            calls(way, 2)
            us[way].append((time.perf_counter_ns() - start) / (2e3 * steps * threads))
    return us


def phases(width: int, rounds: int) -> dict:
    """Microseconds of each phase of a step in a ``job_sharing`` block, with
    the pass boundary called and without: {"boundary": [[phase us]...],
    "none": [...]}, a row a step."""
    import torch
    import torch.nn.functional as F

    sharing = importlib.import_module("waterwave.exec.sharing")
    batches, make, sessions = _setup(width)
    session = sessions["shared"]
    model, opt, _ = make()
    now = time.perf_counter_ns
    steps: dict = {"boundary": [], "none": []}

    def block(kind, keep):
        with torch.enable_grad(), sharing.job_sharing(model, session) as member:
            boundary = member.boundary if kind == "boundary" else None
            for xb, yb in batches:
                t0 = now()
                if boundary is not None:
                    boundary(model, (xb,), sharing.NO_KEYWORDS)
                t1 = now()
                loss = F.cross_entropy(model(xb), yb)
                t2 = now()
                loss.backward()
                t3 = now()
                opt.step()
                t4 = now()
                opt.zero_grad(set_to_none=True)
                loss.item()
                t5 = now()
                if keep:
                    steps[kind].append([(b - a) / 1e3 for a, b in
                                        ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))])
    for r in range(rounds):
        for kind in random.sample(list(steps), len(steps)):
            block(kind, keep=r >= rounds // 10)  # the first tenth warms
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=22, help="steps a job.train call")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1, help="jobs of each way at once, a thread each")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    for name, value in (("--width", args.width), ("--steps", args.steps),
                        ("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:
            ap.error(f"{name} must be at least 1, got {value}")
    import waterwave

    machine = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    report = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "width": args.width,
              "rounds": args.rounds, "waterwave": str(Path(waterwave.__file__).parent.parent),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    command = (f"python bench/concurrent/step_cost.py --width {args.width} --rounds "
               f"{args.rounds}")
    if args.phases:
        steps = phases(args.width, args.rounds)
        medians = {kind: [statistics.median(row[i] for row in rows) for i in range(len(PHASES))]
                   for kind, rows in steps.items()}
        report.update(phases=list(PHASES), medians_us=medians)
        lines = ["# A shared step's phases, with the pass boundary and without (measured, CPU)",
                 "", f"{machine}, {report['date']}: an MLP 64-{args.width}-{args.width}-10 at "
                 f"batch 64 in `job_sharing` blocks of 22 steps, medians over the steps "
                 f"(`{command} --phases`).", "",
                 "| pass boundary | " + " | ".join(PHASES) + " | step |",
                 "|---|" + "---|" * (len(PHASES) + 1)]
        for kind, row in medians.items():
            lines.append(f"| {'called' if kind == 'boundary' else 'none'} | "
                         + " | ".join(f"{v:.1f}" for v in row) + f" | {sum(row):.1f} |")
        stem = "step_cost_phases"
    else:
        us = ways(args.width, args.steps, args.rounds, args.threads)
        rows = {way: {"median_us": statistics.median(v),
                      "quartiles_us": statistics.quantiles(v, n=4)[::2] if len(v) > 1 else v * 2}
                for way, v in us.items()}
        report.update(steps=args.steps, threads=args.threads, ways=rows)
        bare = rows["bare"]["median_us"]
        at_once = (f", {args.threads} jobs a way at once from as many threads (wall time over "
                   f"all their steps)" if args.threads > 1 else "")
        lines = ["# What a shared job.train step costs (measured, CPU)", "",
                 f"{machine}, {report['date']}: an MLP 64-{args.width}-{args.width}-10 at batch "
                 f"64, job.train calls of {args.steps} steps{at_once}, the ways in turn in one "
                 f"process, medians of {args.rounds} rounds (`{command} --steps {args.steps}"
                 f"{f' --threads {args.threads}' if args.threads > 1 else ''}`).", "",
                 "| way | µs a step | over the bare loop | quartiles |", "|---|---|---|---|"]
        for way, row in rows.items():
            q1, q3 = row["quartiles_us"]
            lines.append(f"| {way} | {row['median_us']:.1f} | +{row['median_us'] - bare:.1f} | "
                         f"{q1:.1f}–{q3:.1f} |")
        stem = "step_cost" if args.threads == 1 else f"step_cost_{args.threads}_threads"
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out, f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
