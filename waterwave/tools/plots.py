"""Plots: memory over time for a baseline order and a plan."""
from __future__ import annotations

from ..planner.graph import Graph
from ..planner.lifetimes import live_profile

MiB = 1024**2


def plan_memory(g: Graph, plan, baseline_reserved: int, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = live_profile(g, list(range(len(g.nodes))))
    planned = live_profile(g, plan.order, plan.inplace)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([b / MiB for b in base], label="program order, live bytes", color="tab:gray")
    ax.axhline(baseline_reserved / MiB, color="tab:red", ls="--",
               label=f"PyTorch policy reserved peak ({baseline_reserved / MiB:.0f} MiB)")
    ax.plot([b / MiB for b in planned], label=f"{plan.strategy} order, live bytes", color="tab:blue")
    ax.axhline(plan.arena_size / MiB, color="tab:blue", ls="--",
               label=f"{plan.strategy} arena ({plan.arena_size / MiB:.0f} MiB)")
    ax.set_xlabel("operator step")
    ax.set_ylabel("MiB")
    ax.set_title(f"{g.name}: one training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
