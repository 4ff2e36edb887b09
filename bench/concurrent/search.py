"""Trials per hour of a fixed Optuna search whose trials share one GPU, on
the CPU with simulated GPU time.

    python bench/concurrent/search.py [--quick] [--trials N] [--jobs K] [--out bench/results]

Two searches: small trials (resnet18 on 32x32 images, batch 128: K of them
fit side by side) and memory-bound ones (resnet50 on 224x224 images, batch
64, under a 12 GiB cap that two of them side by side do not fit). Each runs
five ways, K trials at a time as Optuna's ``n_jobs=K`` runs them:

- one at a time (``n_jobs=1``, PyTorch's allocator);
- K at once under PyTorch's allocator (``lockstep``): a trial that starts
  when the cap cannot hold one more fails with out of memory, as
  ``torch.cuda.OutOfMemoryError`` fails an Optuna trial, and is counted;
- K at once, each epoch's loop in ``ww.sharing`` (the simulator's
  ``sharing`` schedule);
- K at once through ``job.train``: a training session pairs their node
  groups under the budget (the ``waterwave`` schedule; side by side where
  the plan fits);
- K at once as ``ConcurrentTrainer(schedule="session")`` runs them: side
  by side, in turn or paired, whichever it measures fastest (``session``).
  ``job.train``'s session does not choose so yet.

What drives the search is Optuna itself, through ask and tell: TPE (seed
0) samples a learning rate and a weight decay, a median pruner stops
trials after their epochs' reports, and a fixed synthetic learning curve of
the two stands for the accuracy a trial reaches each epoch (training the
models for real on the CPU would take days). Time is simulated: an epoch
of a trial takes its samples over its share of what the simulated H100
trains for m identical trials together that way, m being the trials running
then, with kernels of different trials side by side where they fit.
Reported: trials per hour (finished or pruned), simulated minutes to the
best value, out-of-memory failures, the most memory the mixes reserved, and
the GPU's busy share. Every figure is simulated; on a GPU, ``make
gpu-check`` is where a measured search belongs (not yet written).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from waterwave.sim.jobs import JobModel  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.maxbatch import simulate_models  # noqa: E402
from waterwave.tools import models  # noqa: E402

GPU, GiB = "H100-80GB", 1 << 30
# way -> the simulator's schedule for its trials running together
WAYS = {"one at a time": "lockstep", "side by side (PyTorch)": "lockstep",
        "ww.sharing": "sharing", "job.train": "waterwave", "session's choice": "session"}


@dataclass(frozen=True)
class Family:
    name: str
    model: str
    side: int
    batch: int
    memory_limit: int | None
    epochs: int
    epoch_samples: int


FAMILIES = {
    "small": Family("small: resnet18, 32x32, batch 128", "resnet18", 32, 128, None, 10, 50_000),
    "memory-bound": Family("memory-bound: resnet50, 224x224, batch 64, under 12 GiB", "resnet50",
                           224, 64, 12 * GiB, 4, 20_000),
}


def accuracy(lr: float, weight_decay: float, epoch: int) -> float:
    """A fixed synthetic learning curve: best near lr 0.05 and a small
    weight decay, rising with the epochs, with a little noise fixed by the
    arguments."""
    top = 0.95 - 0.06 * (math.log10(lr) + 1.3) ** 2 - 8.0 * weight_decay
    noise = random.Random(f"{lr:.10g}/{weight_decay:.10g}/{epoch}").gauss(0.0, 0.004)
    return top * (1 - math.exp(-epoch / (1.0 + 0.2 / lr ** 0.5))) + noise


def job_model(family: Family) -> JobModel:
    """The family's trial, its step captured once for every way."""
    return models.job_model(family.model, family.side)


def rates(family: Family, model: JobModel, schedule: str, k: int,
          kernels) -> dict[int, dict]:
    """m -> the simulator's figures for m trials of ``model`` running
    together, m = 1..k: samples per second of all, the GPU's busy share, the
    peak reserved, or None where they run out of memory."""
    out = {}
    for m in range(1, k + 1):
        # ww.sharing's trials are the user's own loops: nothing undoes a step
        # of theirs that the device refuses (job.train's steps it would).
        r, _ = simulate_models([model] * m, family.batch, GPU, schedule, family.memory_limit,
                               kernels, record=False, concurrent_kernels=True, undo_steps=False)
        fits = r.ok and r.throughput is not None
        out[m] = {"samples_per_s": r.throughput if fits else None, "gpu_busy": r.gpu_busy,
                  "peak_reserved": r.peak_reserved if fits else None,
                  "ran": (r.session or {}).get("pairing")}
    return out


def search(family: Family, trials: int, slots: int, rate: dict[int, dict]) -> dict:
    """The search with ``slots`` trials at a time, in simulated time."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=4,
                                                                   n_warmup_steps=1))
    running: dict = {}  # trial -> [epochs done, samples left of this epoch, lr, wd]
    started = ooms = done = 0
    clock = busy = 0.0
    best, best_at = None, None
    while started < trials or running:
        while started < trials and len(running) < slots:
            trial = study.ask()
            lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
            wd = trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
            started += 1
            if rate[len(running) + 1]["samples_per_s"] is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)  # out of memory
                ooms += 1
                continue
            running[trial] = [0, family.epoch_samples, lr, wd]
        if not running:
            continue
        m = len(running)
        per_trial = rate[m]["samples_per_s"] / m
        step = min(v[1] for v in running.values()) / per_trial  # to the next epoch's end
        clock += step
        busy += (rate[m]["gpu_busy"] or 0.0) * step
        for trial in list(running):
            state = running[trial]
            state[1] -= per_trial * step
            if state[1] > 1e-6:
                continue
            state[0] += 1
            acc = accuracy(state[2], state[3], state[0])
            trial.report(acc, state[0])
            if state[0] < family.epochs and not trial.should_prune():
                state[1] = family.epoch_samples
                continue
            finished = state[0] == family.epochs
            study.tell(trial, acc if finished else None,
                       state=None if finished else optuna.trial.TrialState.PRUNED)
            del running[trial]
            done += 1
            if finished and (best is None or acc > best):
                best, best_at = acc, clock
    peaks = [r["peak_reserved"] for m, r in rate.items() if m <= slots and r["peak_reserved"]]
    return {"trials_per_hour": done / (clock / 3600) if clock else None,
            "minutes": clock / 60, "minutes_to_best": None if best_at is None else best_at / 60,
            "best": best, "ooms": ooms, "trained": done,
            "peak_reserved_gib": max(peaks) / GiB if peaks else None,
            "gpu_busy": busy / clock if clock else None,
            "session_ran": {m: r["ran"] for m, r in rate.items() if r["ran"]}}


def run(families: list[str], trials: int, k: int, kernels=None) -> dict:
    kernels = kernels or KernelModel.load()
    out = {"simulated": True, "gpu": GPU, "trials": trials, "slots": k,
           "date": time.strftime("%Y-%m-%d"), "families": {}}
    for name in families:
        family = FAMILIES[name]
        model = job_model(family)
        ways = {}
        for way, schedule in WAYS.items():
            slots = 1 if way == "one at a time" else k
            ways[way] = search(family, trials, slots,
                               rates(family, model, schedule, slots, kernels))
        out["families"][name] = {"family": family.name, "ways": ways}
    return out


def table(result: dict) -> list[str]:
    lines = []
    for entry in result["families"].values():
        lines += ["", f"**{entry['family']}**, {result['trials']} trials, "
                  f"{result['slots']} at a time where not one at a time:", "",
                  "| how | trials per hour | minutes | to the best | OOMs | peak GiB | GPU busy |",
                  "|---|---|---|---|---|---|---|"]
        for way, r in entry["ways"].items():
            def shown(x, fmt):
                return "-" if x is None else format(x, fmt)
            ran = (" (" + ", ".join(f"{m}: {p}" for m, p in r["session_ran"].items()) + ")"
                   if r["session_ran"] else "")
            lines.append(f"| {way}{ran} | {shown(r['trials_per_hour'], ',.1f')} | "
                         f"{r['minutes']:.1f} | {shown(r['minutes_to_best'], '.1f')} | "
                         f"{r['ooms']} | {shown(r['peak_reserved_gib'], '.2f')} | "
                         f"{shown(r['gpu_busy'], '.0%')} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="the small search, 8 trials, 2 at a time")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=4, help="trials at a time (Optuna's n_jobs)")
    args = ap.parse_args(argv)
    families, trials, k = (["small"], 8, 2) if args.quick else (list(FAMILIES), args.trials,
                                                                   args.jobs)
    result = run(families, trials, k)
    lines = ["# Trials per hour of an Optuna search on one GPU (simulated)", "",
             f"Made by `python bench/concurrent/search.py` on {result['date']}, on the CPU: real "
             "Optuna (TPE, a median pruner) over a synthetic learning curve, on a simulated "
             f"{GPU}. Every figure is simulated, not measured.", *table(result)]
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out)
    (out / "search.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "search.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
