"""The host instructions a step of each way runs, counted rather than timed:
the ways of ``step_cost.py`` (the bare loop, ``job.train`` without a budget,
shared ``job.train`` under one, and planned: ``capture=True``) on its
digits-sized MLP, each in a
process of its own under valgrind's callgrind, which counts every
instruction the process runs while its counting is switched on: around
``--calls`` calls of ``--steps`` steps, after three calls off the count.
One OpenMP thread, so that the count is the same run after run.

A virtual machine's clock moves by several percent between runs of the
same code, more than what a change to a step's host work is worth; the
count barely moves (two runs of one version: the bare loop's within 0.02%, the
``job.train`` ways' within 0.25% of a step). It
says nothing of caches, locks or the GIL, which the timed benchmarks
(``step_cost.py``, ``trial_cost.py``) still measure: an A/B reads both.

    python bench/concurrent/step_instructions.py [--width 128] [--steps 22] [--calls 4]
                                                 [--out bench/results]

Needs valgrind (``valgrind`` and ``callgrind_control`` on the PATH; a
system package). Each way takes a minute or two under it; two ways run at
once. Results go to step_instructions.{json,md}, naming the machine. A
benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_cost import WAYS, _setup, train_call  # noqa: E402  (the same job, the same ways)

TOOLS = ("valgrind", "callgrind_control")
WARM_CALLS = 3  # off the count: first calls, measured passes


def child(way: str, width: int, steps: int, calls: int) -> None:
    """In the process valgrind runs: ``calls`` calls of ``way``, counted."""
    # As step_cost's: the sessions with a budget made in every way's process.
    batches, make, sessions = _setup(width)
    made = make()
    for _ in range(WARM_CALLS):
        train_call(way, made, batches, steps, sessions)
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    for _ in range(calls):
        train_call(way, made, batches, steps, sessions)
    subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)


def counted(way: str, width: int, steps: int, calls: int) -> int:
    """Instructions callgrind counted for ``way``'s calls."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "callgrind.out")
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--child", way,
             "--width", str(width), "--steps", str(steps), "--calls", str(calls)],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise RuntimeError(f"the {way} way under valgrind failed:\n{run.stderr[-2000:]}")
        return instructions(out.read_text())


def instructions(profile: str) -> int:
    """The instructions a callgrind profile counted: its ``totals:`` line,
    written at its end (the ``summary:`` line of its header is written as
    the run starts, 0 where counting starts off)."""
    found = re.findall(r"^totals:\s+(\d+)", profile, re.MULTILINE)
    if not found:
        raise ValueError("the callgrind profile has no totals line: was valgrind's callgrind "
                         "the tool that wrote it?")
    return int(found[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=22, help="steps a call")
    ap.add_argument("--calls", type=int, default=4, help="calls counted a way")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, value in (("--width", args.width), ("--steps", args.steps),
                        ("--calls", args.calls)):
        if value < 1:
            ap.error(f"{name} must be at least 1, got {value}")
    if args.child:
        child(args.child, args.width, args.steps, args.calls)
        return 0
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        ap.error(f"{' and '.join(missing)} not found: install valgrind (apt install valgrind), "
                 "whose callgrind counts the instructions")
    with ThreadPoolExecutor(2) as pool:
        totals = dict(zip(WAYS, pool.map(
            lambda way: counted(way, args.width, args.steps, args.calls), WAYS)))
    steps = args.calls * args.steps
    per_step = {way: total / steps for way, total in totals.items()}
    bare = per_step["bare"]
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    report = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "width": args.width,
              "steps": args.steps, "calls": args.calls, "totals": totals,
              "per_step": per_step}
    lines = ["# Host instructions a step runs, each way (counted by callgrind, CPU)", "",
             f"{machine}, {report['date']}: an MLP 64-{args.width}-{args.width}-10 at batch 64, "
             f"{args.calls} calls of {args.steps} steps a way after {WARM_CALLS} uncounted, one "
             f"OpenMP thread (`python bench/concurrent/step_instructions.py --width {args.width} "
             f"--steps {args.steps} --calls {args.calls}`).", "",
             "| way | instructions a step | over the bare loop |", "|---|---|---|"]
    for way, n in per_step.items():
        lines.append(f"| {way} | {n:,.0f} | {n - bare:+,.0f} ({(n / bare - 1) * 100:+.2f}%) |")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "step_instructions.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out, "step_instructions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
