"""Throughput by schedule, simulated: samples per second of two or four
identical jobs trained one after another (``sequential``), taking turns
step by step (``turns``), side by side (``lockstep``) and through the
NodeGroup pipeline (``waterwave``), across batch sizes, on a V100-32GB and
an H100-80GB, with the kernels of different jobs running at once where
their SM and bandwidth shares fit (``SimDevice.set_concurrent_kernels``).

    python bench/concurrent/throughput.py [--out bench/results] [--quick]

Writes throughput.json, throughput.md and throughput.png (samples per second
against the batch, a panel per model, GPU and job count: the shape of the
Waterwave paper's Figure 7). A benchmark, not a test: every figure is
simulated, and the kernels' shares are a model not yet fitted to a GPU.
A schedule that runs out of memory at a batch has no figure there.
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

SCHEDULES = ("sequential", "turns", "lockstep", "waterwave")
SMALL_TRANSFORMER = "hf:bert,num_hidden_layers=2,hidden_size=256,num_attention_heads=4,intermediate_size=1024"
# (label, model, input side or None, batch sizes)
CASES = [
    ("resnet18 32x32", "resnet18", 32, (32, 64, 128)),
    ("resnet18 224x224", "resnet18", None, (16, 32, 64)),
    ("resnet50 32x32", "resnet50", 32, (32, 64, 128)),
    ("resnet50 224x224", "resnet50", None, (16, 32, 64)),
    ("small transformer", SMALL_TRANSFORMER, None, (8, 16, 32)),
    ("bert-base", "bert-base", None, (8, 16, 32)),
]
QUICK = [("resnet18 32x32", "resnet18", 32, (32,))]
GPUS = ("V100-32GB", "H100-80GB")
STEPS = 3


def job_model(label: str, name: str, side: int | None) -> JobModel:
    """The model's step at any batch; named as the simulator names it, so that
    at 224x224 the kernel tables measured on the H100 apply."""
    known = label.replace(" ", "-") if name.startswith("hf:") and side is None else None
    return models.job_model(name, side, label=known)


def one(model: JobModel, jobs: int, batch: int, gpu: str, schedule: str, kernels) -> dict:
    r, _ = simulate_models([model] * jobs, batch, gpu, schedule, kernels=kernels, steps=STEPS,
                           record=False, concurrent_kernels=True)
    return {"ok": r.ok, "throughput": r.throughput if r.ok else None,
            "gpu_busy": r.gpu_busy if r.ok else None, "peak_reserved": r.peak_reserved,
            "order": r.order, "policy": r.policy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="resnet18 at 32x32, batch 32, 2 jobs, H100")
    args = ap.parse_args(argv)
    cases, gpus, counts = (QUICK, ("H100-80GB",), (2,)) if args.quick else (CASES, GPUS, (2, 4))
    kernels = KernelModel.load()
    rows, t0 = [], time.time()
    for label, name, side, batches in cases:
        model = job_model(label, name, side)
        for gpu in gpus:
            for jobs in counts:
                for batch in batches:
                    row = {"model": label, "gpu": gpu, "jobs": jobs, "batch": batch}
                    for schedule in SCHEDULES:
                        row[schedule] = one(model, jobs, batch, gpu, schedule, kernels)
                    rows.append(row)
                    cells = "  ".join(f"{s} {row[s]['throughput'] or 0:9,.0f}" for s in SCHEDULES)
                    print(f"{label:18} {gpu:10} {jobs} x bs{batch:<4} {cells}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out)
    result = {"simulated": True, "concurrent_kernels": True, "steps_per_job": STEPS,
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1),
              "schedules": list(SCHEDULES), "rows": rows}
    (out / "throughput.json").write_text(json.dumps(result, indent=1))
    lines = ["# Throughput by schedule (simulated)", "",
             f"Made by `python bench/concurrent/throughput.py` on {result['date']}: samples per "
             f"second of all jobs together in steady steps ({STEPS} steps per job), kernels of "
             "different jobs at once where their shares fit; the GPU's SM-weighted busy share in "
             "brackets; - where the schedule ran out of memory. The pipeline's node groups run "
             "in the operator order that trains faster (bfs or program, named after its figure), "
             "under the waterwave policy or, where it trains faster, PyTorch's (named). "
             "Simulated, not measured.", "",
             "| model | GPU | jobs | batch | " + " | ".join(SCHEDULES) + " | pipeline / best other |",
             "|---|---|---|---|" + "---|" * (len(SCHEDULES) + 1)]
    for r in rows:
        cells = [f"{r[s]['throughput']:,.0f} ({r[s]['gpu_busy']:.0%})"
                 + (f" {r[s]['order']}" if r[s].get("order") else "")
                 + (f", {r[s]['policy']} policy" if s == "waterwave"
                    and r[s].get("policy") == "pytorch" else "") if r[s]["throughput"]
                 else "-" for s in SCHEDULES]
        others = [r[s]["throughput"] for s in ("turns", "lockstep") if r[s]["throughput"]]
        ratio = (f"{r['waterwave']['throughput'] / max(others):.2f}"
                 if others and r["waterwave"]["throughput"] else "-")
        lines.append(f"| {r['model']} | {r['gpu']} | {r['jobs']} | {r['batch']} | "
                     + " | ".join(cells) + f" | {ratio} |")
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    _chart(rows, out / "throughput.png")
    print(f"results: {out}/throughput.md, .json and .png (simulated)")
    return 0


def _chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["gpu"], r["jobs"]) for r in rows},
                    key=lambda p: (p[0], p[1], p[2]))
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, (model, gpu, jobs) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["model"], r["gpu"], r["jobs"]) == (model, gpu, jobs)]
        for s in SCHEDULES:
            pts = [(r["batch"], r[s]["throughput"]) for r in mine if r[s]["throughput"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_title(f"{model}, {jobs} jobs, {gpu}", fontsize=9)
        ax.set_xlabel("batch per job")
        ax.set_ylabel("samples/s (simulated)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
