"""What ``with ww.sharing(model):`` costs an eager loop, on the CPU: the wall
time per step of k eager loops (one on the main thread; more from k threads
at once, as Optuna's ``n_jobs`` runs trials) plain, and the same loops as
sharing members of a session whose ``memory_limit`` holds them all (so
every gate is taken and admits: what is measured is the hooks, the counting
allocator and the gates, not waiting), for the digits-sized MLP, resnet18 on
32x32 images and a small transformer encoder (``train_host.py``'s models),
1 and 4 loops.

    python bench/concurrent/sharing_cost.py [--out bench/results] [--steps N] [--repeats 5]
                                            [--models M ...] [--jobs K ...] [--quick]
                                            [--instructions]

Each measurement runs in a fresh process, the modes in turn (so drift hits
both alike); each loop trains ``steps`` steps after ``warmup`` steps that
are not counted (the first passes, measured alone, and OpenMP's start).
With k loops, each thread's OpenMP team is cores // k, as a user running k
trials at once would set it. The target (issue 39: the gates add at most 5%)
is read from the table: a benchmark prints what it measured. Results go to
bench/results/sharing_cost.{json,md}, naming the machine.

``--instructions`` also counts the instructions each step executes in user
space (``perf stat -e instructions:u``; the same run with no measured steps
subtracted), which, unlike a shared machine's wall time, repeat to a tenth
of a percent: the host work the hooks, the counting and the gates add.
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
for path in (ROOT, ROOT / "bench" / "concurrent"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from train_host import make  # noqa: E402

import waterwave as ww  # noqa: E402

MODES = ("eager", "sharing")
WARMUP = 3
# Steps measured per loop by default: about a second of each.
STEPS = {"mlp": 400, "resnet18-32": 4, "transformer": 20}


def loop(model_name: str, k: int, sharing: bool):
    """A function that trains loop k for n steps, the user's eager loop,
    in a sharing block or not."""
    model, data = make(model_name, k)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train(n: int) -> None:
        block = ww.sharing(model) if sharing else None
        if block is not None:
            block.__enter__()
        try:
            for i in range(n):
                x, y = data[i % len(data)]
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                loss.item()
        finally:
            if block is not None:
                block.__exit__(None, None, None)
    return train


def run_mode(model_name: str, jobs: int, steps: int, mode: str) -> dict:
    """Seconds for ``jobs`` loops of ``steps`` steps each, after their warm-up."""
    if jobs > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))
    sharing = mode == "sharing"
    if sharing:
        ww.training_session("cpu", memory_limit=64 << 30)  # holds them all: nothing waits
    go = threading.Barrier(jobs + 1)
    ready = threading.Barrier(jobs + 1)
    errors: list[BaseException] = []

    def thread(k):
        try:
            train = loop(model_name, k, sharing)
            train(WARMUP)
            ready.wait()
            go.wait()
            train(steps)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            ready.abort()
            go.abort()

    if jobs == 1:  # on the main thread, as a plain script trains
        train = loop(model_name, 0, sharing)
        train(WARMUP)
        start = time.perf_counter()
        train(steps)
        return {"seconds": time.perf_counter() - start, "team": torch.get_num_threads()}
    threads = [threading.Thread(target=thread, args=(k,)) for k in range(jobs)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"a loop failed: {errors[0]!r}")
    return {"seconds": seconds, "team": torch.get_num_threads()}


def measure(model_name: str, jobs: int, steps: int, mode: str, count: bool = False) -> dict:
    """One measurement in a fresh process; ``count``: under perf stat, with
    the user-space instructions it executed."""
    command = [sys.executable, __file__, "--one", model_name, str(jobs), str(steps), mode]
    if count:
        command = ["perf", "stat", "-x,", "-e", "instructions:u", *command]
    r = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} {model_name} x{jobs} failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if count:
        line = next(ln for ln in r.stderr.splitlines() if "instructions" in ln)
        out["instructions"] = int(line.split(",")[0])
    return out


def instructions_per_step(model_name: str, jobs: int, steps: int, mode: str) -> float:
    """User-space instructions a step executes: a run of ``steps`` less the
    same run with none."""
    with_steps = measure(model_name, jobs, steps, mode, count=True)["instructions"]
    without = measure(model_name, jobs, 0, mode, count=True)["instructions"]
    return (with_steps - without) / (jobs * steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--steps", type=int, help="per loop (default: about a second's worth)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", choices=["mlp", "resnet18-32", "transformer"])
    ap.add_argument("--jobs", nargs="+", type=int)
    ap.add_argument("--quick", action="store_true", help="the MLP, 1 and 4 loops, 5 steps, once")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each step's instructions with perf stat")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "JOBS", "STEPS", "MODE"),
                    help=argparse.SUPPRESS)  # one measurement: what measure() runs
    args = ap.parse_args(argv)
    if args.one:
        model_name, jobs, steps, mode = args.one
        print(json.dumps(run_mode(model_name, int(jobs), int(steps), mode)))
        return 0
    models = ["mlp"] if args.quick else args.models or ["mlp", "resnet18-32", "transformer"]
    counts = args.jobs or [1, 4]
    repeats = 1 if args.quick else args.repeats
    rows = []
    for model_name in models:
        steps = 5 if args.quick else args.steps or STEPS[model_name]
        for jobs in counts:
            runs: dict[str, list[float]] = {mode: [] for mode in MODES}
            instructions: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(repeats):  # in turn, so that drift hits both alike
                for mode in MODES:
                    runs[mode].append(measure(model_name, jobs, steps, mode)["seconds"])
                    if args.instructions:
                        instructions[mode].append(
                            instructions_per_step(model_name, jobs, steps, mode))
            per_step = {mode: [1000 * s / (jobs * steps) for s in got] for mode, got in runs.items()}
            row = {"model": model_name, "jobs": jobs, "steps_per_loop": steps,
                   **{f"{mode}_ms_per_step": statistics.median(v) for mode, v in per_step.items()},
                   **{f"{mode}_ms_per_step_runs": v for mode, v in per_step.items()}}
            row["ratio"] = row["sharing_ms_per_step"] / row["eager_ms_per_step"]
            counted = ""
            if args.instructions:
                for mode, got in instructions.items():
                    row[f"{mode}_instructions_per_step"] = statistics.median(got)
                row["instructions_ratio"] = (row["sharing_instructions_per_step"]
                                             / row["eager_instructions_per_step"])
                counted = (f"; instructions {row['eager_instructions_per_step'] / 1e6:.3f}M "
                           f"against {row['sharing_instructions_per_step'] / 1e6:.3f}M a step "
                           f"({row['instructions_ratio']:.3f}x)")
            rows.append(row)
            print(f"{model_name:12} {jobs} loop(s): eager {row['eager_ms_per_step']:7.3f} ms/step, "
                  f"in ww.sharing {row['sharing_ms_per_step']:7.3f} ms/step "
                  f"({row['ratio']:.3f}x){counted}", flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    date = time.strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sharing_cost.json"), "w") as f:
        json.dump({"machine": machine, "date": date, "repeats": repeats, "rows": rows}, f, indent=1)
    lines = ["# What ww.sharing costs an eager loop (measured on the CPU)", "",
             f"Machine: {machine}; {date}. Made by `python bench/concurrent/sharing_cost.py`: "
             f"medians of {repeats} runs, each mode in a fresh process, in turn; a session "
             "memory_limit that holds every loop, so each gate admits at once.", "",
             "| model | loops | eager ms/step | in ww.sharing ms/step | ratio | "
             "instructions/step: eager | in ww.sharing | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['jobs']} | {r['eager_ms_per_step']:.3f} | "
              f"{r['sharing_ms_per_step']:.3f} | {r['ratio']:.3f} | "
              + (f"{r['eager_instructions_per_step'] / 1e6:.3f}M | "
                 f"{r['sharing_instructions_per_step'] / 1e6:.3f}M | "
                 f"{r['instructions_ratio']:.3f} |" if "instructions_ratio" in r else "- | - | - |")
              for r in rows]
    with open(os.path.join(args.out, "sharing_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
