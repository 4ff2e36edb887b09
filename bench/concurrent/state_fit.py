"""Trials whose state does not all fit at once, on the CPU: how many of them
each way trains, where one after another would train them all.

    python bench/concurrent/state_fit.py [--limits 35 45] [--trials 4] [--steps 40]
                                         [--widths 1024] [--repeats 3] [--out bench/results]

``--trials`` threads each build an MLP (256 -> W -> W -> 10, W of
``--widths`` in turn: one model, or one architecture a trial; SGD with
momentum, batch 512), train it ``--steps`` steps, and drop it, as Optuna's
objectives do with ``n_jobs``: in ``ww.sharing`` (their own loops), or
through ``job.train``, in a CPU session with a ``memory_limit`` of each of
``--limits`` MiB; and, for the record, ``one after another``: the same
trials in ``ww.sharing``, each thread started once the one before ended.
One trial of width 1024 alone peaks at about 20 MiB, of which its model,
gradients and momentum are 15.3 MiB, so under 35 MiB two trials' state fits
at once and under 45 MiB two and a half. Each run is a process of
its own (a session's budget and the CPU allocator's ledger are the
process's); the table gives, per way and limit, the trials trained in each
of ``--repeats`` runs and the session's waits. Results go to
state_fit.{json,md} (with other ``--widths``: state_fit_<widths>.*), naming
the machine. A benchmark, not a test.

May import: waterwave, torch; the standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
WAYS = ("ww.sharing", "job.train", "one after another")


def child(way: str, limit_mib: float, trials: int, steps: int, widths: list[int]) -> dict:
    """One run in this process: the trials trained, the session's waits."""
    import torch
    import torch.nn.functional as F

    import waterwave as ww

    torch.set_num_threads(1)

    def setup(seed):
        torch.manual_seed(seed)
        width = widths[seed % len(widths)]
        net = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(),
                                  torch.nn.Linear(width, width), torch.nn.ReLU(),
                                  torch.nn.Linear(width, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(seed)
        data = [(torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g))
                for _ in range(steps)]
        return net, opt, data

    session = ww.training_session("cpu", memory_limit=int(limit_mib * 2**20))
    trained, errors = [], []

    def trial(k):  # as an Optuna objective: the model made inside, dropped at the end
        net, opt, data = setup(k)
        try:
            if way == "job.train":  # (one after another: its trials in ww.sharing)
                ww.Job(net, loss_fn=F.cross_entropy, optimizer=opt, data=data).train(len(data))
            else:
                with ww.sharing(net):
                    for x, y in data:
                        opt.zero_grad()
                        F.cross_entropy(net(x), y).backward()
                        opt.step()
            trained.append(k)
        except torch.OutOfMemoryError as e:
            errors.append(str(e).splitlines()[0][:200])

    start = time.perf_counter()
    threads = [threading.Thread(target=trial, args=(k,)) for k in range(trials)]
    for t in threads:
        t.start()
        if way == "one after another":  # each trial ends before the next is made
            t.join()
    for t in threads:
        t.join()
    stats = session.stats()
    return {"way": way, "limit_mib": limit_mib, "trained": len(trained),
            "seconds": time.perf_counter() - start,
            "peak_mib": stats["peak_bytes"] / 2**20, "waits": stats["waits"],
            "first_error": errors[0] if errors else None}


def report_md(report: dict) -> str:
    """The report's table: per way and limit, the trials trained in each
    run, the seconds each run took, the most the session counted in any
    run, and the last run's waits."""
    runs = report["runs"]
    lines = ["# Trials whose state does not all fit at once (measured, CPU)", "",
             f"`python bench/concurrent/state_fit.py`, {report['date']}, on "
             f"{report['measured']}: {report['trials']} MLP trials on threads (widths "
             f"{', '.join(map(str, report.get('widths', [1024])))} in turn), "
             f"{report['steps']} steps each, under each `memory_limit`; per way and limit, "
             "the trials trained and the seconds taken in each run, the most the session "
             "counted in any run (a model counts from its block's start), and the session's "
             "waits in the last run.", "",
             "| way | limit MiB | trained, each run | seconds, each run | peak MiB, most | "
             "forced | failed |",
             "|---|---|---|---|---|---|---|"]
    for limit in dict.fromkeys(r["limit_mib"] for r in runs):
        for way in WAYS:
            mine = [r for r in runs if r["way"] == way and r["limit_mib"] == limit]
            if not mine:
                continue
            last = mine[-1]
            seconds = ", ".join(f"{r['seconds']:.1f}" for r in mine)
            lines.append(f"| {way} | {limit:g} | {', '.join(str(r['trained']) for r in mine)} | "
                         f"{seconds} | "
                         f"{max(r['peak_mib'] for r in mine):.1f} | "
                         f"{last['waits']['forced']} | {last['waits']['failed']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", type=float, nargs="+", default=[35.0, 45.0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--widths", type=int, nargs="+", default=[1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--child", nargs=2, metavar=("WAY", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], float(args.child[1]), args.trials, args.steps,
                               args.widths)))
        return 0
    if args.trials < 1 or args.steps < 1 or args.repeats < 1:
        ap.error("--trials, --steps and --repeats are at least 1")
    if any(limit <= 0 for limit in args.limits):
        ap.error("each of --limits is a positive number of MiB")
    if any(width < 1 for width in args.widths):
        ap.error("each of --widths is a positive number of units")
    runs = []
    for limit in args.limits:
        for way in WAYS:
            for _ in range(args.repeats):
                r = subprocess.run([sys.executable, __file__, "--child", way, str(limit),
                                    "--trials", str(args.trials), "--steps", str(args.steps),
                                    "--widths", *map(str, args.widths)],
                                   capture_output=True, text=True, timeout=600, check=False)
                if r.returncode != 0:
                    print(r.stderr[-2000:], file=sys.stderr)
                    return 1
                runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
    from waterwave.tools.step_bench import cpu_name

    where = f"{cpu_name()} ({platform.machine()}, {os.cpu_count()} cores)"
    report = {"measured": where, "date": time.strftime("%Y-%m-%d"), "trials": args.trials,
              "steps": args.steps, "widths": args.widths, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "state_fit" if args.widths == [1024] else "state_fit_" + "_".join(
        map(str, args.widths))
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = report_md(report)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
