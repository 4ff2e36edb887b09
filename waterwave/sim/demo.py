"""``make demo``: two out-of-phase training jobs on two streams of a simulated
GPU, under the waterwave and pytorch policies, side by side."""
from __future__ import annotations

import json
import os

from .workloads import MiB, smallest_capacity, two_jobs

GiB = 1024**3
POLICIES = ("pytorch", "waterwave")


def run(out_dir: str = "out", iterations: int = 3, capacity: int = 16 * GiB,
        plot: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    traces = {}
    for policy in POLICIES:
        a, trace, ok = two_jobs(policy, capacity, iterations=iterations)
        if not ok:
            raise RuntimeError(f"the {policy} policy ran out of memory at {capacity} bytes")
        s = a.stats()
        results[policy] = {
            "peak_reserved_bytes": s["reserved_bytes.all.peak"],
            "peak_allocated_bytes": s["allocated_bytes.all.peak"],
            "fragmentation_at_peak": s["fragmentation.at_peak_reserved"],
            "device_segments": s["num_device_alloc"],
            "sync_and_coalesce": s["num_sync_and_coalesce"],
            "host_event_syncs": s["num_host_event_syncs"],
            "stream_waits": s["num_stream_waits"],
            "hazards": len(a.hazards()),
            "served": {k.split(".", 1)[1]: v for k, v in s.items() if k.startswith("served.")},
            "gpu_time_us": a.device.gpu_busy_until(),
            "smallest_capacity_bytes": smallest_capacity(
                policy, 64 * MiB, capacity, iterations=iterations),
        }
        traces[policy] = trace
    if plot:
        results["plot"] = _plot(traces, os.path.join(out_dir, "demo_memory.png"))
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


def _plot(traces, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(12, 4), sharey=True)
    for ax, (policy, t) in zip(axes, traces.items()):
        x = range(len(t.reserved))
        ax.stackplot(x, [b / GiB for b in t.per_job[0]], [b / GiB for b in t.per_job[1]],
                     labels=["job 1 allocated (stream 0)", "job 2 allocated (stream 1)"],
                     colors=["tab:blue", "tab:cyan"], alpha=0.7)
        ax.plot(x, [r / GiB for r in t.reserved], label="reserved", color="tab:red", lw=2)
        peak = max(t.reserved)
        ax.set_title(f"{policy} policy: peak reserved {peak / GiB:.2f} GiB")
        ax.set_xlabel("operation (scheduling order)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GiB")
    axes[0].legend(loc="lower center", fontsize=8)
    fig.suptitle("Two out-of-phase training jobs on two streams (simulated GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(results: dict) -> str:
    def gib(x):
        return "-" if x is None else f"{x / GiB:.2f} GiB"

    rows = [
        ("peak reserved", lambda r: gib(r["peak_reserved_bytes"])),
        ("peak allocated", lambda r: gib(r["peak_allocated_bytes"])),
        ("fragmentation at peak", lambda r: f"{r['fragmentation_at_peak']:.1%}"),
        ("smallest GPU that fits", lambda r: gib(r["smallest_capacity_bytes"])),
        ("device segments", lambda r: str(r["device_segments"])),
        ("sync_and_coalesce calls", lambda r: str(r["sync_and_coalesce"])),
        ("host event syncs", lambda r: str(r["host_event_syncs"])),
        ("async stream waits", lambda r: str(r["stream_waits"])),
        ("hazards", lambda r: str(r["hazards"])),
        ("served same stream", lambda r: str(r["served"]["same_stream"])),
        ("served synced / own pool", lambda r: str(r["served"]["synced"])),
        ("served promoted", lambda r: str(r["served"]["promoted"])),
        ("served cross-stream wait", lambda r: str(r["served"]["cross_stream_wait"])),
        ("served new segment", lambda r: str(r["served"]["new_segment"])),
        ("GPU time (simulated)", lambda r: f"{r['gpu_time_us'] / 1000:.1f} ms"),
    ]
    width = max(len(n) for n, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{p:>14}" for p in POLICIES)]
    for name, fn in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{fn(results[p]):>14}" for p in POLICIES))
    return "\n".join(lines)
