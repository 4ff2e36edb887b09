"""What the NodeGroup pipeline costs the host, on the CPU: the
CounterBarrier's cost per node group as the run grows, and the time the
``waterwave`` schedule's pairing (``pairing.MemoryPairing``) takes to plan a
run: its first window (what a run waits for before its first group) and
all of it (spread over the run, a window at a time). Both run on the host
before or between a GPU's kernels, so they must stay small beside a group's
GPU time and flat in the number of steps.

    python bench/concurrent/host.py [--out bench/results] [--quick]

The barrier: two threads, each running its groups through a real
CounterBarrier with nothing in the groups; ``turns`` puts the jobs' groups
in alternate rounds (every group waits for the other thread), ``side by
side`` puts both in every round. The pairing: two synthetic jobs of 40
groups each (20 rising, 20 falling; sizes drawn with a fixed seed) under a
limit of 70% of their peaks together, so that they take turns. Results go
to bench/results/concurrent_host.{json,md}, naming the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from waterwave.pipeline.counter_barrier import CounterBarrier  # noqa: E402
from waterwave.pipeline.pairing import JobPlan, MemoryPairing, step_peak  # noqa: E402
from waterwave.pipeline.round_feed import WINDOW_STEPS  # noqa: E402

MiB = 1 << 20


def barrier_cost(groups_per_job: int, layout: str) -> float:
    """Microseconds of host time per node group, two jobs through one
    barrier, ``groups_per_job`` groups each, all planned up front as the
    trainer plans a run."""
    if layout == "turns":
        rounds = {"a": list(range(0, 2 * groups_per_job, 2)),
                  "b": list(range(1, 2 * groups_per_job, 2))}
    else:
        rounds = {"a": list(range(groups_per_job)), "b": list(range(groups_per_job))}
    barrier = CounterBarrier()
    for job, rs in rounds.items():
        barrier.plan(job, rs)

    def run(job: str) -> None:
        for r in rounds[job]:
            barrier.wait(job, r)
            barrier.done(job, r)

    threads = [threading.Thread(target=run, args=(job,)) for job in rounds]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / (2 * groups_per_job) * 1e6


def synthetic_job(k: int, rng: random.Random, groups: int = 40) -> JobPlan:
    """A step that rises for half its groups and falls back for the rest."""
    half = groups // 2
    ups = []
    for _ in range(half):
        delta = rng.randint(50, 100) * MiB
        ups.append((delta, delta + rng.randint(0, 20) * MiB))
    left, downs = sum(d for d, _ in ups), []
    for i in range(half):
        d = left // (half - i)
        downs.append((-d, 10 * MiB))
        left -= d
    return JobPlan(k, 2 << 30, ups + downs)


def pairing_cost(steps: int) -> dict:
    rng = random.Random(0)
    jobs = [synthetic_job(0, rng), synthetic_job(1, rng)]
    limit = int(sum(step_peak(j) for j in jobs) * 0.7)
    pairing = MemoryPairing(jobs, limit, steps)
    start = time.perf_counter()
    pairing.window(WINDOW_STEPS)
    first = time.perf_counter() - start
    while not pairing.finished:
        pairing.window(WINDOW_STEPS)
    seconds = time.perf_counter() - start
    return {"steps": steps, "rounds": pairing.round, "first_window_ms": first * 1e3,
            "seconds": seconds, "ms_per_step": seconds / steps * 1e3}


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"Python {platform.python_version()}"


def measure(quick: bool) -> dict:
    sizes = (100, 1000) if quick else (1_000, 10_000, 100_000)
    barrier = [{"groups_per_job": n, "layout": layout, "us_per_group": barrier_cost(n, layout)}
               for layout in ("turns", "side by side") for n in sizes]
    pairing = [pairing_cost(s) for s in ((2, 20) if quick else (10, 1_000, 10_000))]
    return {"machine": machine(), "measured": "CPU", "barrier": barrier, "pairing": pairing}


def report(res: dict) -> str:
    lines = ["# The NodeGroup pipeline's host cost (measured on the CPU)", "",
             f"Machine: {res['machine']}. Made by `python bench/concurrent/host.py`.", "",
             "## CounterBarrier, two threads, empty groups", "",
             "| groups per job | layout | µs per group |", "|---|---|---|"]
    lines += [f"| {b['groups_per_job']:,} | {b['layout']} | {b['us_per_group']:.1f} |"
              for b in res["barrier"]]
    lines += ["", "## Planning a run (`MemoryPairing`), two jobs of 40 groups taking turns", "",
              f"The trainer plans {WINDOW_STEPS} steps at a time, as the jobs reach them: a run "
              "waits only for the first window.", "",
              "| steps | rounds | first window, ms | whole run, s | ms per step |",
              "|---|---|---|---|---|"]
    lines += [f"| {p['steps']:,} | {p['rounds']:,} | {p['first_window_ms']:.2f} | "
              f"{p['seconds']:.3f} | {p['ms_per_step']:.2f} |" for p in res["pairing"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="folder for concurrent_host.{json,md}")
    ap.add_argument("--quick", action="store_true", help="small sizes (the suite's check)")
    args = ap.parse_args(argv)
    res = measure(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrent_host.json").write_text(json.dumps(res, indent=1) + "\n")
    text = report(res)
    (out / "concurrent_host.md").write_text(text)
    print(text, end="")
    print(f"wrote {out / 'concurrent_host.json'} and {out / 'concurrent_host.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
