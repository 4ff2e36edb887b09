"""Trials per hour of a fixed search, simulated: 32 resnet18 trials on
CIFAR-shaped data (32x32 images, batch 64, 50,000 samples an epoch) pruned
by successive halving (rungs at 1, 2, 4, 8 and 16 epochs, half the trials
promoted at each: 96 epochs in all), run one trial at a time, k trials side
by side under PyTorch's allocator (``lockstep``), and k trials through the
NodeGroup pipeline (``waterwave``), on a simulated H100 with the kernels of
different trials running at once where they fit.

    python bench/concurrent/trials_per_hour.py [--out bench/results] [--quick]

How: the simulator gives the samples per second and the GPU's busy share of
m identical trials training together, for m = 1..k, under each schedule;
the search then runs as Optuna's ``n_jobs=k`` runs it: k slots, each trial
taking a free slot in turn and holding it for its epochs, every running
trial progressing at the rate m trials share. Trials per hour is the trials
over the search's time; the busy share is weighed by time. Writes
trials_per_hour.{json,md}. A benchmark, not a test: every figure is
simulated (the pruning is a fixed successive-halving plan, not a study's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from waterwave.sim.jobs import JobModel  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.maxbatch import simulate_models  # noqa: E402
from waterwave.tools import models  # noqa: E402

GPU, BATCH, SIDE, EPOCH_SAMPLES = "H100-80GB", 64, 32, 50_000


def halving_epochs(trials: int, rungs: int) -> list[int]:
    """Each trial's epochs under successive halving: all train 1 epoch, half
    of those go on to 2 in all, half of them to 4, ... (the last rung's
    trials train 2^(rungs-1)). The best trials run first, as a study
    promotes the leaders of a rung."""
    epochs, alive = [1] * trials, trials
    for r in range(1, rungs):
        alive //= 2
        for i in range(alive):
            epochs[i] = 2 ** r
    return epochs


def rates(model: JobModel, k: int, schedule: str, kernels) -> dict[int, tuple[float, float]]:
    """m -> (samples/s of m trials together, GPU busy share), m = 1..k."""
    out = {}
    for m in range(1, k + 1):
        r, _ = simulate_models([model] * m, BATCH, GPU, schedule, kernels=kernels, record=False,
                               concurrent_kernels=True)
        if not r.ok or r.throughput is None:
            raise RuntimeError(f"{m} trials under {schedule} did not run: {r.oom}")
        out[m] = (r.throughput, r.gpu_busy)
    return out


def search(epochs: list[int], slots: int, rate: dict[int, tuple[float, float]]) -> dict:
    """The search with ``slots`` trials at a time: seconds and busy share."""
    pending = list(range(len(epochs)))
    left = {}  # running trial -> samples it still trains
    clock = busy = 0.0
    while pending or left:
        while pending and len(left) < slots:
            i = pending.pop(0)
            left[i] = epochs[i] * EPOCH_SAMPLES
        m = len(left)
        per_trial = rate[m][0] / m
        step = min(left.values()) / per_trial  # until the next trial ends
        clock += step
        busy += rate[m][1] * step
        for i in list(left):
            left[i] -= per_trial * step
            if left[i] <= 1e-6:
                del left[i]
    return {"hours": clock / 3600, "trials_per_hour": len(epochs) / (clock / 3600),
            "gpu_busy": busy / clock}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="8 trials, 2 at a time")
    args = ap.parse_args(argv)
    trials, rungs, k = (8, 3, 2) if args.quick else (32, 5, 4)
    epochs = halving_epochs(trials, rungs)
    model = models.job_model("resnet18", SIDE)
    kernels = KernelModel.load()
    runs = {"one at a time": search(epochs, 1, rates(model, 1, "lockstep", kernels))}
    for label, schedule in ((f"{k} side by side (PyTorch)", "lockstep"),
                            (f"{k} through the pipeline", "waterwave")):
        runs[label] = search(epochs, k, rates(model, k, schedule, kernels))
    base = runs["one at a time"]["trials_per_hour"]
    result = {"simulated": True, "gpu": GPU, "trials": trials, "epochs": sum(epochs),
              "batch": BATCH, "input_size": SIDE, "slots": k, "date": time.strftime("%Y-%m-%d"),
              "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out)
    (out / "trials_per_hour.json").write_text(json.dumps(result, indent=1))
    lines = ["# Trials per hour of a pruned search (simulated)", "",
             f"Made by `python bench/concurrent/trials_per_hour.py` on {result['date']}: {trials} "
             f"resnet18 trials, {SIDE}x{SIDE} images, batch {BATCH}, {EPOCH_SAMPLES:,} samples an "
             f"epoch, successive halving over {rungs} rungs ({sum(epochs)} epochs in all), on a "
             f"simulated {GPU} with kernels side by side. Simulated, not measured.", "",
             "| how | minutes | trials per hour | of one at a time | GPU busy |", "|---|---|---|---|---|"]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['hours'] * 60:.1f} | {r['trials_per_hour']:.1f} | "
                     f"{r['trials_per_hour'] / base:.2f}x | {r['gpu_busy']:.0%} |")
    (out / "trials_per_hour.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[5:]))
    print(f"results: {out}/trials_per_hour.md and .json (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
