"""Concurrent training, simulated beside measured: the calibration of the
multi-job simulator against the H100.

    python bench/concurrent/run.py [--out bench/results]

Writes concurrent.json, concurrent.md and concurrent_calibration.png. Every
simulated figure comes from this run; the measured ones from
bench/data/gpu-snapshots/h100_measured.json (the H100 run behind
bench/data/gpu-snapshots), or from bench/results/concurrent_gpu.json when
bench/gpu_concurrent.py has run on a GPU.

Calibration: (1) each shared snapshot replayed through the simulated pytorch
policy; (2) the same workloads simulated from captured steps (eager traces:
the simulator's own input, nothing taken from the snapshot but the measured
kernel tables); (3) the largest resnet50 batch per job under 12 GiB, alone,
lockstep and phased, under both policies; (4) the same search without the
measured kernel tables, to show what they are worth.

Then the NodeGroup pipeline against the paper (tables.py): its Table 1 on a
32 GB V100, three and four ResNet50 jobs, ResNet50 + BERT-base (Table 2),
Figure 8's split-size sweep, and two resnet50 under 12 GiB on the H100.
``--quick`` runs the calibration only.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tables  # noqa: E402

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
        cache[name] = models.job_model(name)
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
              ""]
    if "table1" in result:
        lines += pipeline_markdown(result)
    lines += ["![calibration and Table 1](concurrent_calibration.png)", ""]
    path.write_text("\n".join(lines))


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def rate(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def pipeline_markdown(result: dict) -> list[str]:
    t1, h = result["table1"], result["h100_12gib"]
    sole = h["sole"]["max_batch"]
    lines = ["## The NodeGroup pipeline (simulated)", "",
             "Variants: `Waterwave` is the node-group pipeline with our memory-aware, safe "
             "pairing, under the waterwave policy with `max_split_size_mb:128`; `Algorithm 1` "
             "pairs the same groups as the paper does; `Waterwave-s` cuts each step in two "
             "(forward, backward) and pairs the halves by Algorithm 1; the last three rows change "
             "one part of `Waterwave` each. Largest batch per job in steps of 8; throughput in "
             "samples per second for all jobs together, at that batch, in steady steps (from "
             "the last job's first step end to the first job's last; each job's progress "
             "counted by the GPU time of its kernels); `GPU busy`: the share of that time the "
             "GPU ran kernels, so that at 100% no schedule could be faster at that batch.", "",
             f"### Two resnet50 under 12 GiB on the H100 (one alone: {sole})", "",
             "`side by side`: of the schedule's rounds at that batch, the share in which both "
             "jobs ran (the rest, they took turns).", "",
             "| variant | batch per job | of one alone | throughput | GPU busy | side by side | "
             "syncs | hazards |", "|---|---|---|---|---|---|---|---|"]
    for label, v in h.items():
        if label != "sole":
            lines.append(f"| {label} | {v['max_batch']} | {pct(v['max_batch'] / sole)} | "
                         f"{rate(v['throughput'])} | {pct(v['gpu_busy'])} | "
                         f"{pct(v['shared_rounds'])} | {v['syncs']} | {v['hazards']} |")
    lines += ["", "### The paper's Table 1: two identical jobs on a 32 GB V100", "",
              "One alone: the larger of native PyTorch's and Waterwave's allocator's batch. "
              "Paper: TensorFlow on a V100, its own models (BERT's sequence length unstated; "
              "ours is 128).", "",
              "| model | one alone (native / ours) | lockstep | Waterwave-s | Algorithm 1 | "
              "Waterwave | Waterwave / one alone | side by side | paper: one alone, Waterwave-s, "
              "Waterwave |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in t1.items():
        p = row["paper"]
        lines.append(
            f"| {name} | {row['sole']} ({row['sole_native']} / {row['sole_waterwave_allocator']}) "
            f"| {row['lockstep']['max_batch']} | {row['Waterwave-s']['max_batch']} | "
            f"{row['Algorithm 1']['max_batch']} | {row['Waterwave']['max_batch']} | "
            f"{pct(row['Waterwave']['ratio'])} | {pct(row['Waterwave']['shared_rounds'])} | "
            f"{p['sole']}, {p['waterwave-s']}, "
            f"{p['waterwave']} ({p['waterwave'] / p['sole']:.1%}) |")
    cnn = [row["Waterwave"]["ratio"] for name, row in t1.items() if name != "bert-base"]
    lines += ["", f"Average over the CNNs: {pct(sum(cnn) / len(cnn))} of one alone "
              f"(target 95%; paper 92.2%); BERT-base: {pct(t1['bert-base']['Waterwave']['ratio'])}"
              " (target 92%; paper 89.9%).", "",
              "What each part is worth (largest batch per job):", "",
              "| model | Waterwave | + SyncAndCoalesce between rounds | pytorch policy | "
              "waterwave policy without max_split |", "|---|---|---|---|---|"]
    for name, row in t1.items():
        lines.append(f"| {name} | {row['Waterwave']['max_batch']} | "
                     f"{row['Waterwave + SyncAndCoalesce']['max_batch']} | "
                     f"{row['Waterwave, pytorch policy']['max_batch']} | "
                     f"{row['Waterwave, no max_split']['max_batch']} |")
    lines += ["", "Throughput of the pair at lockstep's largest batch (samples/s; GPU busy):", "",
              "| model | batch | lockstep | Waterwave | Waterwave / lockstep |",
              "|---|---|---|---|---|"]
    same_batch = [(f"{name}, V100-32GB", row.get("throughput_at_lockstep_batch"))
                  for name, row in t1.items()]
    same_batch.append(("resnet50, H100 under 12 GiB", result.get("h100_12gib_at_lockstep_batch")))
    for label, same in same_batch:
        if same:
            ratio = (same["Waterwave"] / same["lockstep"]
                     if same["Waterwave"] and same["lockstep"] else None)
            lines.append(f"| {label} | {same['batch']} | {rate(same['lockstep'])} "
                         f"({pct(same['lockstep gpu_busy'])}) | {rate(same['Waterwave'])} "
                         f"({pct(same['Waterwave gpu_busy'])}) | "
                         f"{'-' if ratio is None else f'{ratio:.4f}'} |")
    lines += ["", "### More jobs, and two different ones (V100-32GB)", "",
              "| jobs | lockstep | Waterwave (side by side) | paper |", "|---|---|---|---|"]
    for n, row in result["more_jobs"].items():
        lines.append(f"| {n} x resnet50 | {row['lockstep']['max_batch']} | "
                     f"{row['Waterwave']['max_batch']} ({pct(row['Waterwave']['shared_rounds'])}) | "
                     f"{336 if str(n) == '3' else 310} |")
    t2 = result["table2"]
    for label in ("lockstep", "Waterwave"):
        r = t2[label]
        batches = ", ".join(f"{k} {v}" for k, v in (r["batches"] or {}).items())
        lines.append(f"| resnet50 + bert-base, {label} | {pct(r['fraction'])} of each alone "
                     f"({batches}) | | 358 + 116 |")
    lines += ["", "### Figure 8: split size (two resnet50, V100-32GB, Waterwave)", "",
              "| split size | batch per job | throughput | side by side | syncs |",
              "|---|---|---|---|---|"]
    for size, r in result["split_sweep"].items():
        label = "chosen (peak / 8)" if size == "auto" else f"{size} GiB"
        lines.append(f"| {label} | {r['max_batch']} | {rate(r['throughput'])} | "
                     f"{pct(r['shared_rounds'])} | {r['syncs']} |")
    lines += ["", "### Whole steps in turns (split size = a step's peak)", "",
              "With groups as large as a step's peak, the safe pairing takes turns step by step. "
              "The simulated GPU runs one kernel at a time, so taking turns costs no throughput; "
              "running side by side would pay only where kernels do not fill the GPU, which the "
              "simulator does not model.", "",
              "| pair | one alone | Waterwave (peak / 8) | whole steps in turns | throughput | "
              "side by side |", "|---|---|---|---|---|---|"]
    for label, row in result.get("turns", {}).items():
        r = row["peak"]
        if "H100" in label:
            alone, default = h["sole"]["max_batch"], h["Waterwave"]["max_batch"]
        else:
            alone, default = t1[label]["sole"], t1[label]["Waterwave"]["max_batch"]
        lines.append(f"| {label} | {alone} | {default} | {r['max_batch']} | "
                     f"{rate(r['throughput'])} | {pct(r['shared_rounds'])} |")
    return lines + [""]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if "table1" in result else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False)
    labels = ["sole", "lockstep", "phased"]
    gpu = result["measured"]["max_batch_12gib"]
    series = [("measured (H100), native", [gpu[k]["pytorch"] for k in labels]),
              ("simulated, pytorch policy", [result["max_batch"][k]["pytorch"] for k in labels]),
              ("simulated, waterwave policy", [result["max_batch"][k]["waterwave"] for k in labels]),
              ("simulated without kernel tables",
               [result["max_batch_without_kernel_tables"][k]["pytorch"] for k in labels])]
    _bars(axes[0][0], ["one job alone", "2 jobs, lockstep", "2 jobs, phased"], series,
          "resnet50 under 12 GiB, H100: measured and simulated", "largest batch per job")
    if panels == 2:
        t = result["table1"]
        names = list(t)
        series = [(label, [round(100 * (t[n][label]["ratio"] if label != "sole" else 1))
                           for n in names])
                  for label in ("lockstep", "Waterwave-s", "Algorithm 1", "Waterwave")]
        _bars(axes[0][1], names, series, "two identical jobs, V100-32GB (simulated)",
              "largest batch per job, % of one alone")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, groups, series, title, ylabel) -> None:
    width = 0.8 / len(series)
    for i, (name, ys) in enumerate(series):
        bars = ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], ys,
                      width, label=name)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def pipeline(kernels: KernelModel, cache: dict) -> dict:
    lab = tables.Lab(kernels)
    lab.models.update(cache)
    h100 = {label: lab.search(["resnet50"] * 2, *variant, gpu=GPU, limit=12 * GiB)
            for label, variant in tables.VARIANTS.items()}
    h100["sole"] = lab.search(["resnet50"], gpu=GPU, limit=12 * GiB)
    same = tables.at_lockstep_batch(lab, "resnet50", h100["lockstep"], gpu=GPU, limit=12 * GiB)
    return {"h100_12gib": h100, "h100_12gib_at_lockstep_batch": same,
            "table1": tables.table1(lab), "more_jobs": tables.more_jobs(lab),
            "table2": tables.mixed(lab), "split_sweep": tables.split_sweep(lab),
            "turns": tables.turns(lab, 12 * GiB)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="the calibration only")
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
    if not args.quick:
        result.update(pipeline(kernels, cache))
    result["seconds"] = round(time.time() - t0, 1)
    (out / "concurrent.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out / "concurrent.md")
    plot(result, out / "concurrent_calibration.png")
    print((out / "concurrent.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
