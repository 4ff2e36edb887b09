"""Plots: memory over time for a baseline order and a plan, for simulated
jobs, and for a replayed trace."""
from __future__ import annotations

from ..graph import Graph
from ..graph.lifetimes import live_profile

MiB = 1024**2


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(10, 4))


def png_path(path: str) -> str:
    """Where a plot asked for at ``path`` is written: ``path`` itself, with
    ``.png`` added when it has no extension (as matplotlib would add it, so
    the name said is the name written). A directory is refused."""
    import os

    if os.path.isdir(path):
        raise ValueError(f"--plot {path} is a directory; give a file name, e.g. "
                         f"{os.path.join(path, 'memory.png')}")
    return path if os.path.splitext(path)[1] else path + ".png"


def _finish(fig, ax, xlabel: str, title: str, path: str) -> str:
    """Label, save and close a memory-over-time figure."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plan_memory(g: Graph, plan, baseline_reserved: int, path: str) -> str:
    base = live_profile(g, list(range(len(g.nodes))))
    planned = live_profile(g, plan.order, plan.inplace)
    fig, ax = _axes()
    ax.plot([b / MiB for b in base], label="program order, live bytes", color="tab:gray")
    ax.axhline(baseline_reserved / MiB, color="tab:red", ls="--",
               label=f"PyTorch policy reserved peak ({baseline_reserved / MiB:.0f} MiB)")
    ax.plot([b / MiB for b in planned], label=f"{plan.strategy} order, live bytes", color="tab:blue")
    ax.axhline(plan.arena_size / MiB, color="tab:blue", ls="--",
               label=f"{plan.strategy} arena ({plan.arena_size / MiB:.0f} MiB)")
    return _finish(fig, ax, "operator step", f"{g.name}: one training step", path)


def jobs_memory(result, path: str) -> str:
    """Each simulated job's allocated bytes (stacked) and reserved bytes over
    host time."""
    t = [x / 1000 for x in result.time_us]
    fig, ax = _axes()
    ax.stackplot(t, *[[b / MiB for b in job] for job in result.per_job],
                 labels=[f"job {j + 1}: {name} allocated" for j, name in enumerate(result.jobs)],
                 alpha=0.7, step="post")
    ax.step(t, [r / MiB for r in result.reserved], where="post", color="tab:red", lw=1.5,
            label=f"reserved (peak {result.peak_reserved / MiB:,.0f} MiB)")
    if result.memory_limit:
        ax.axhline(result.memory_limit / MiB, color="black", ls="--", lw=1, label="memory limit")
    status = "ran" if result.ok else f"out of memory ({result.oom['name']})"
    return _finish(fig, ax, "host time (ms)",
                   f"{len(result.jobs)} job(s), {result.schedule}, {result.policy} policy, "
                   f"simulated {result.gpu}: {status}", path)


def replay_memory(timeline: dict, path: str, title: str) -> str:
    """A replayed trace: each stream's allocated bytes (stacked) and reserved
    bytes after each operator."""
    fig, ax = _axes()
    streams = sorted(timeline["allocated"])
    ax.stackplot(range(len(timeline["reserved"])),
                 *[[b / MiB for b in timeline["allocated"][s]] for s in streams],
                 labels=[f"stream {s} allocated" for s in streams], alpha=0.7)
    ax.plot([r / MiB for r in timeline["reserved"]], color="tab:red", label="reserved")
    return _finish(fig, ax, "allocation or free", title, path)
