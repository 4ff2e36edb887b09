"""Measure the NodeGroup pipeline itself on a GPU: ``waterwave.ConcurrentTrainer``
training several copies of a model under a memory cap, on the Waterwave
allocator. This is issue 13's GPU target (two resnet50 under 12 GiB: at
least 125 per job, against 64 side by side and 136 alone; the pipeline's
throughput at least lockstep's at the same batch), which
bench/concurrent/run.py can only simulate.

    python bench/concurrent/trainer_gpu.py [--model resnet50] [--jobs 2] [--cap-gib 12]
                                           [--steps 6] [--split-mib N] [--out bench/results]

It finds the largest batch per job (steps of 8, the simulator's search)
for one job alone and for the jobs together under the trainer's
``lockstep`` schedule (no barrier: PyTorch's jobs side by side) and its
``waterwave`` schedule, then times both schedules at lockstep's largest
batch. ``--split-mib`` sets the trainer's ``split_size`` (default: its own
choice, a step's peak over 8); the simulator finds that groups as large as
the peak, taking turns step by step, fit more at the same throughput, which
only a GPU can confirm. Every trial runs in its own process, since PyTorch
takes an allocator once per process:

    python bench/concurrent/trainer_gpu.py trial SCHEDULE MODEL BATCH JOBS CAP_GIB STEPS
                                                 [--device cpu] [--split-mib N]

prints one JSON line: whether every job trained ``STEPS`` steps after a
warm-up step, the samples per second of all jobs over those steps, the
allocator's peak, and a failed job's error. ``--device cpu`` runs a trial
on CPU tensors, with no allocator and no cap, so that the suite can check
the trial on a machine without a GPU. Results go to
bench/results/concurrent_trainer_gpu.{json,md}, naming the GPU (``_split<N>mib`` added
with ``--split-mib``). Without a CUDA GPU the search says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: waterwave where it was built
    sys.path.insert(0, str(ROOT))
GiB = 1 << 30
ALLOC_CONFIG = {"max_split_size_mb": 128}  # as the simulated `Waterwave` variant
SCHEDULES = ("lockstep", "waterwave")


TOTAL_BYTES_ENV = "WATERWAVE_BENCH_GPU_BYTES"  # the GPU's memory, for the trials' cap


def trial(schedule: str, model: str, batch: int, njobs: int, cap_gib: float, steps: int,
          device: str = "cuda", split_mib: float | None = None) -> dict:
    """One trial in this process: ``njobs`` copies of ``model`` at ``batch``
    trained by the ConcurrentTrainer under ``schedule``."""
    import waterwave
    from waterwave.alloc import fraction_allowing

    cap = int(cap_gib * GiB)
    if device == "cuda":
        import torch

        # The device's size from the parent: asking torch here would initialize
        # CUDA and its allocator, which then cannot be swapped.
        total = int(os.environ.get(TOTAL_BYTES_ENV) or 0)
        if not total:
            raise RuntimeError(f"{TOTAL_BYTES_ENV} is not set: run trials through main()")
        waterwave.install_allocator(policy="waterwave",
                                    per_process_memory_fraction=fraction_allowing(cap, total),
                                    **ALLOC_CONFIG)
    import torch

    from waterwave.tools import models

    out = {"schedule": schedule, "model": model, "batch": batch, "jobs": njobs,
           "cap_gib": cap_gib if device == "cuda" else None, "steps": steps, "device": device,
           "split_mib": split_mib, "fits": False, "throughput": None, "error": None}
    try:
        jobs = []
        for k in range(njobs):
            torch.manual_seed(k)
            net, inputs, loss_fn = models.build(model, batch, device)
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            jobs.append(waterwave.Job(net, inputs, loss_fn, opt, name=f"{model}-{k}"))
        trainer = waterwave.ConcurrentTrainer(
            jobs, memory_limit=cap if device == "cuda" else None, schedule=schedule,
            split_size=int(split_mib * 2**20) if split_mib else None)
        trainer.step()  # warm-up: cuDNN's plans, the allocator's first segments
        _sync(device)
        start = time.perf_counter()
        losses = trainer.run(steps)
        _sync(device)
        seconds = time.perf_counter() - start
    except Exception as e:  # out of memory while capturing or building counts as not fitting
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return out
    failed = [j for j in jobs if j.failed]
    if failed:
        e = failed[0].error
        out["error"] = f"{failed[0].name}: {type(e).__name__}: {str(e).splitlines()[0]}"
    else:
        out["fits"] = all(len(ls) == steps + 1 and all(map(math.isfinite, ls)) for ls in losses)
        if not out["fits"]:
            out["error"] = "a loss is missing or not finite"
        out["throughput"] = njobs * batch * steps / seconds
    stats = trainer.stats()
    out["syncs"] = stats["syncs"]
    out["split_sizes"] = [j["split_size"] for j in stats["jobs"]]
    if device == "cuda":
        stats = waterwave.cuda.memory_stats()
        out["peak_reserved_mib"] = stats["reserved_bytes.all.peak"] / 2**20
        out["peak_allocated_mib"] = stats["allocated_bytes.all.peak"] / 2**20
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


@dataclass
class Trial:
    """A trial's result, as ``waterwave.sim.maxbatch.search`` reads one."""
    row: dict

    @property
    def ok(self) -> bool:
        return bool(self.row.get("fits"))


def run_trial(schedule: str, model: str, batch: int, njobs: int, cap_gib: float, steps: int,
              device: str = "cuda", split_mib: float | None = None, timeout: int = 1800) -> dict:
    """A trial in its own process; a crash or a hang is a trial that failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "trial", schedule, model, str(batch),
           str(njobs), str(cap_gib), str(steps), "--device", device]
    if split_mib:
        cmd += ["--split-mib", str(split_mib)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"schedule": schedule, "batch": batch, "fits": False,
                "error": f"timed out after {timeout} s"}
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if not rows:
        tail = r.stderr.strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
        return {"schedule": schedule, "batch": batch, "fits": False,
                "error": f"the trial printed no result: {tail[0]}"}
    return rows[-1]


def measure(model: str, njobs: int, cap_gib: float, steps: int, say=print,
            trial_fn=run_trial, split_mib: float | None = None) -> dict:
    """The largest batch per job alone, lockstep and under the pipeline,
    then both schedules' throughput at lockstep's largest batch."""
    from waterwave.sim.maxbatch import search

    def largest(schedule: str, n: int) -> dict:
        def fits(batch: int) -> Trial:
            row = trial_fn(schedule, model, batch, n, cap_gib, steps, split_mib=split_mib)
            say(json.dumps(row))
            return Trial(row)

        found = search(fits, step=8, start=64)
        return {"max_batch": found.max_batch, "trials": found.trials,
                "at_max": found.result.row if found.result else None}

    out = {"model": model, "jobs": njobs, "cap_gib": cap_gib, "steps": steps,
           "split_mib": split_mib, "alone": largest("lockstep", 1)}
    for schedule in SCHEDULES:
        out[schedule] = largest(schedule, njobs)
    b = out["lockstep"]["max_batch"]
    out["at_lockstep_batch"] = {"batch": b}
    if b:
        for schedule in SCHEDULES:
            row = trial_fn(schedule, model, b, njobs, cap_gib, steps, split_mib=split_mib)
            say(json.dumps(row))
            out["at_lockstep_batch"][schedule] = row
    return out


def markdown(result: dict) -> str:
    alone = result["alone"]["max_batch"]
    same = result["at_lockstep_batch"]

    def rate(row) -> str:
        return "-" if not row or row.get("throughput") is None else f"{row['throughput']:,.0f}"

    lines = [f"# The NodeGroup pipeline on a GPU: {result['jobs']} x {result['model']} under "
             f"{result['cap_gib']:g} GiB", "",
             f"Measured {result['date']} on one {result['gpu']} (torch {result['torch']}) by "
             f"`python bench/concurrent/trainer_gpu.py` ({result['seconds']:.0f} s): "
             "`waterwave.ConcurrentTrainer` on the Waterwave allocator "
             f"(policy `waterwave`, `max_split_size_mb:128`), each trial in its own process, "
             f"{result['steps']} timed steps after a warm-up step; split size "
             f"{_split(result.get('split_mib'))}.", "",
             "| schedule | largest batch per job | of one alone | samples/s at that batch | "
             "peak reserved (MiB) |", "|---|---|---|---|---|",
             f"| one job alone | {alone} | | {rate(result['alone']['at_max'])} | "
             f"{_mib(result['alone']['at_max'])} |"]
    for schedule in SCHEDULES:
        r = result[schedule]
        share = f"{r['max_batch'] / alone:.1%}" if alone else "-"
        lines.append(f"| {result['jobs']} jobs, {schedule} | {r['max_batch']} | {share} | "
                     f"{rate(r['at_max'])} | {_mib(r['at_max'])} |")
    if same.get("lockstep"):
        lines += ["", f"At lockstep's largest batch ({same['batch']} per job): lockstep "
                  f"{rate(same['lockstep'])} samples/s, the pipeline {rate(same['waterwave'])}."]
    return "\n".join(lines) + "\n"


def _split(mib) -> str:
    return "the trainer's choice (a step's peak / 8)" if not mib else f"{mib:g} MiB"


def _mib(row) -> str:
    return "-" if not row or row.get("peak_reserved_mib") is None else \
        f"{row['peak_reserved_mib']:,.0f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trial"]:
        ap = argparse.ArgumentParser(prog="trainer_gpu.py trial")
        ap.add_argument("schedule", choices=SCHEDULES)
        ap.add_argument("model")
        ap.add_argument("batch", type=int)
        ap.add_argument("jobs", type=int)
        ap.add_argument("cap_gib", type=float)
        ap.add_argument("steps", type=int)
        ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        ap.add_argument("--split-mib", type=float)
        a = ap.parse_args(argv[1:])
        print(json.dumps(trial(a.schedule, a.model, a.batch, a.jobs, a.cap_gib, a.steps,
                               a.device, a.split_mib)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--split-mib", type=float, help="node groups' size (default: the trainer's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/concurrent/trainer_gpu.py measures on a GPU: no CUDA GPU is visible to "
              "torch. Run it where one is; bench/concurrent/run.py simulates without one.",
              file=sys.stderr)
        return 2
    os.environ[TOTAL_BYTES_ENV] = str(torch.cuda.get_device_properties(0).total_memory)
    t0 = time.time()
    result = measure(args.model, args.jobs, args.cap_gib, args.steps, split_mib=args.split_mib)
    result.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t0, 1),
                  measured=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "concurrent_trainer_gpu" + (f"_split{args.split_mib:g}mib" if args.split_mib else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
