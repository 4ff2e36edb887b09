"""Concurrent training, simulated beside measured: the calibration of the
multi-job simulator against the H100.

    python bench/concurrent/run.py [--out bench/results]

Writes concurrent.json, concurrent.md and concurrent_calibration.png. Every
simulated figure comes from this run; the measured ones from
bench/data/gpu-snapshots/h100_measured.json (the H100 run behind
../shared/gpu-snapshots), or from bench/results/concurrent_gpu.json when
bench/gpu_concurrent.py has run on a GPU.

Calibration: (1) each shared snapshot replayed through the simulated pytorch
policy; (2) the same workloads simulated from captured steps (eager traces:
the simulator's own input, nothing taken from the snapshot but the measured
kernel tables); (3) the largest resnet50 batch per job under 12 GiB, alone,
lockstep and phased, under both policies; (4) the same search without the
measured kernel tables, to show what they are worth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from waterwave.sim import trace as traces  # noqa: E402
from waterwave.sim.jobs import JobModel  # noqa: E402
from waterwave.sim.kernels import NONE, KernelModel  # noqa: E402
from waterwave.sim.maxbatch import max_batch  # noqa: E402
from waterwave.sim.multijob import simulate  # noqa: E402
from waterwave.tools import models  # noqa: E402

DATA = ROOT / "bench" / "data" / "gpu-snapshots"
MiB, GiB = 1 << 20, 1 << 30
GPU = "H100-80GB"
SNAPSHOT_OF = {"resnet18 x1, batch 32": "r18_solo", "resnet18 x2, batch 32": "r18_2jobs",
               "resnet50 x2, batch 64, phased": "r50_phased"}


def measured(out: Path) -> dict:
    gpu_run = out / "concurrent_gpu.json"
    path = gpu_run if gpu_run.exists() else DATA / "h100_measured.json"
    d = json.loads(path.read_text())
    d["file"] = str(path.relative_to(ROOT))
    return d


def job_model(name: str, cache: dict) -> JobModel:
    if name not in cache:
        cache[name] = JobModel(name, lambda b, name=name: models.build(name, b))
    return cache[name]


def peaks(m: dict, kernels: KernelModel, cache: dict) -> list[dict]:
    rows = []
    for w in m["peaks_mib"]:
        row = {"workload": w["workload"], "measured": w}
        snap = SNAPSHOT_OF.get(w["workload"])
        if snap:
            s = traces.from_snapshot(str(DATA / f"{snap}.pickle.gz")).replay("pytorch")
            row["snapshot_replay"] = {"reserved": s["reserved_bytes.all.peak"] / MiB,
                                      "allocated": s["allocated_bytes.all.peak"] / MiB}
        for policy in ("pytorch", "waterwave"):
            jobs = [job_model(n, cache).trace_at(w["batch"], GPU, kernels) for n in w["models"]]
            r = simulate(jobs, GPU, None, w["schedule"], policy, steps=4, record=False)
            row[policy] = {"reserved": r.peak_reserved / MiB, "allocated": r.peak_allocated / MiB,
                           "hazards": r.hazards}
        rows.append(row)
    return rows


def max_batches(m: dict, kernels: KernelModel, cache: dict) -> dict:
    spec = m["max_batch_12gib"]
    jm = job_model(spec["model"], cache)
    cap = int(spec["cap_gib"] * GiB)
    out = {}
    for policy in ("pytorch", "waterwave"):
        for label, n, schedule in (("sole", 1, "lockstep"), ("lockstep", 2, "lockstep"),
                                   ("phased", 2, "phased")):
            found = max_batch([jm] * n, GPU, cap, schedule, policy, kernels, step=spec["step"])
            out.setdefault(label, {})[policy] = found.max_batch
    return out


def fmt(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def write_markdown(result: dict, path: Path) -> None:
    m = result["measured"]
    lines = [
        "# Concurrent training: the simulator against the H100", "",
        f"Simulated {result['date']} on the CPU by `python bench/concurrent/run.py` "
        f"({result['seconds']:.0f} s); measured figures from `{m['file']}` ({m['source']}). "
        "Every simulated figure is labelled so; none of them ran on a GPU.", "",
        "## Largest batch per job, two resnet50 under 12 GiB (steps of 8)", "",
        "| schedule | measured, native | simulated, `pytorch` policy | measured, `waterwave` "
        "policy | simulated, `waterwave` policy | simulated without kernel tables, `pytorch` |",
        "|---|---|---|---|---|---|"]
    gpu = m["max_batch_12gib"]
    for label, title in (("sole", "one job alone"), ("lockstep", "2 jobs, lockstep"),
                         ("phased", "2 jobs, phased")):
        sim, bare = result["max_batch"][label], result["max_batch_without_kernel_tables"][label]
        lines.append(f"| {title} | {gpu[label]['pytorch']} | {sim['pytorch']} | "
                     f"{gpu[label]['waterwave']} | {sim['waterwave']} | {bare['pytorch']} |")
    lines += ["", "## Peaks of the snapshots' workloads (MiB)", "",
              "| workload | measured reserved | snapshot replayed | simulated from the captured "
              "step | measured allocated | simulated allocated | `waterwave` policy: measured "
              "reserved | simulated |", "|---|---|---|---|---|---|---|---|"]
    for row in result["peaks"]:
        meas, sim, ww = row["measured"], row["pytorch"], row["waterwave"]
        rep = row.get("snapshot_replay") or {}
        mw = meas["waterwave"]["reserved"]
        mw = f"{mw[0]:,}–{mw[1]:,}" if isinstance(mw, list) else fmt(mw)
        off = sim["reserved"] / meas["pytorch"]["reserved"] - 1
        lines.append(f"| {row['workload']} | {fmt(meas['pytorch']['reserved'])} | "
                     f"{fmt(rep.get('reserved'))} | {fmt(sim['reserved'])} ({off:+.1%}) | "
                     f"{fmt(meas['pytorch'].get('allocated'))} | {fmt(sim['allocated'])} | {mw} | "
                     f"{fmt(ww['reserved'])} |")
    lines += ["", "Hazards in every simulated run: "
              f"{sum(r[p]['hazards'] for r in result['peaks'] for p in ('pytorch', 'waterwave'))}.",
              "", "![calibration](concurrent_calibration.png)", ""]
    path.write_text("\n".join(lines))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["sole", "lockstep", "phased"]
    gpu = result["measured"]["max_batch_12gib"]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(labels))
    series = [("measured (H100), native", [gpu[k]["pytorch"] for k in labels]),
              ("simulated, pytorch policy", [result["max_batch"][k]["pytorch"] for k in labels]),
              ("simulated, waterwave policy", [result["max_batch"][k]["waterwave"] for k in labels]),
              ("simulated without kernel tables",
               [result["max_batch_without_kernel_tables"][k]["pytorch"] for k in labels])]
    width = 0.2
    for i, (name, ys) in enumerate(series):
        bars = ax.bar([v + (i - 1.5) * width for v in x], ys, width, label=name)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(list(x), ["one job alone", "2 jobs, lockstep", "2 jobs, phased"])
    ax.set_ylabel("largest batch per job")
    ax.set_title("resnet50 under 12 GiB on an H100: measured and simulated")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    m = measured(out)
    kernels, cache = KernelModel.load(), {}
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": GPU, "simulated": True, "measured": m,
              "peaks": peaks(m, kernels, cache),
              "max_batch": max_batches(m, kernels, cache),
              "max_batch_without_kernel_tables": max_batches(m, NONE, cache)}
    result["seconds"] = round(time.time() - t0, 1)
    (out / "concurrent.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out / "concurrent.md")
    plot(result, out / "concurrent_calibration.png")
    print((out / "concurrent.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
