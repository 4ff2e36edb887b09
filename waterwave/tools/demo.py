"""``make demo``: two training jobs of a real model on one simulated GPU
under a memory cap, as PyTorch runs them side by side, as Waterwave's
NodeGroup pipeline does, and as sharing members.

Each job is a captured training step (resnet18 by default: SGD with
momentum, cross-entropy), simulated as eager PyTorch runs it on the named
GPU. For each schedule the demo finds the largest batch per job, then runs
lockstep and Waterwave at Waterwave's batch and draws each job's memory over
time. Every figure is simulated; the simulator's calibration against an H100
is in bench/results/concurrent.md.

May import: waterwave.sim, this package.
"""
from __future__ import annotations

import json
import os

from ..sim.eager import eager_trace
from ..sim.kernels import KernelModel
from ..sim.maxbatch import max_batch, simulate_models
from ..sim.multijob import simulate
from ..sim.schedules import ALLOCATORS
from ..sim.schedules import schedule as named_schedule
from . import models

GiB = 1 << 30
# name -> (schedule, policy, allocator config), each schedule's own allocator
SCHEDULES = {name: (name, *ALLOCATORS[name]) for name in ("lockstep", "phased", "waterwave")}


def run(out_dir: str = "out", model: str = "resnet18", gpu: str = "H100-80GB",
        memory_limit: int = 3 * GiB, steps: int = 3, plot: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    jm = models.job_model(model)
    kernels = KernelModel.load()
    sole = max_batch([jm], gpu, memory_limit, "lockstep", "pytorch", kernels, steps)
    results = {"model": model, "gpu": gpu, "memory_limit": memory_limit, "simulated": True,
               "sole": sole.max_batch, "schedules": {}}
    for name, (schedule, policy, config) in SCHEDULES.items():
        found = max_batch([jm, jm], gpu, memory_limit, schedule, policy, kernels, steps,
                          config=config)
        r = found.result
        results["schedules"][name] = {
            "policy": policy, "config": config, "max_batch": found.max_batch,
            "of_sole": found.max_batch / sole.max_batch if sole.max_batch else None,
            "throughput": r.throughput if r else None, "hazards": r.hazards if r else None,
            "side_by_side": r.shared_rounds if r else None,
            "stream_waits": r.stream_waits if r else None, "syncs": r.syncs if r else None}
    batch = results["schedules"]["waterwave"]["max_batch"]
    runs = {}
    for name in ("lockstep", "waterwave"):
        schedule, policy, config = SCHEDULES[name]
        sched = named_schedule(schedule, memory_limit)
        jobs = [jm.trace_at(batch, gpu, kernels, stream=0,
                            partition=getattr(sched, "partition", None)) for _ in range(2)]
        runs[name] = simulate(jobs, gpu, memory_limit, sched, policy, steps, config=config)
    # One after another beside a captured session's choice and the jobs as
    # sharing members (each its own eager loop: job.train's default), at that
    # batch, each under its own allocator.
    one_by_one, chose, sharing = (simulate_models([jm, jm], batch, gpu, name, memory_limit,
                                                  kernels, steps, record=False)[0]
                                  for name in ("sequential", "session", "sharing"))
    results["at_waterwave_batch"] = {
        "batch": batch, **{k: {"ok": r.ok, "peak_reserved": r.peak_reserved,
                               "peak_allocated": r.peak_allocated,
                               "throughput": r.throughput if r.ok else None}
                           for k, r in {**runs, "sequential": one_by_one, "session": chose,
                                        "sharing": sharing}.items()},
        "session_ran": chose.session["pairing"] if chose.session else None}
    if plot:
        results["plot"] = _plot(runs, os.path.join(out_dir, "demo_memory.png"))
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


def _plot(runs: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    MiB = 1 << 20
    fig, axes = plt.subplots(1, len(runs), figsize=(12, 4), sharey=True)
    for ax, (name, r) in zip(axes, runs.items()):
        t = [x / 1000 for x in r.time_us]
        ax.stackplot(t, *[[b / MiB for b in job] for job in r.per_job], step="post", alpha=0.7,
                     labels=[f"job {j + 1} allocated" for j in range(len(r.per_job))])
        ax.step(t, [x / MiB for x in r.reserved], where="post", color="tab:red", lw=1.5,
                label="reserved")
        ax.axhline(r.memory_limit / MiB, color="black", ls="--", lw=1, label="memory limit")
        status = "trains" if r.ok else "out of memory"
        ax.set_title(f"{name}, {r.policy} policy: {status}")
        ax.set_xlabel("host time (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=8, loc="upper left")
    batch = runs["waterwave"].batch_sizes[0]
    fig.suptitle(f"Two {runs['waterwave'].jobs[0].rsplit('-', 1)[0]} jobs at batch {batch} each "
                 f"on a simulated {runs['waterwave'].gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(results: dict) -> str:
    sole = results["sole"]
    lines = [f"{'':30}{'batch per job':>14}{'of one alone':>14}{'samples/s':>11}"
             f"{'side by side':>14}{'hazards':>9}",
             f"{'one job alone':30}{sole:>14}"]
    for name, r in results["schedules"].items():
        label = f"{name} ({r['policy']} policy)"
        rate = "-" if r["throughput"] is None else f"{r['throughput']:,.0f}"
        of = "-" if r["of_sole"] is None else f"{r['of_sole']:.0%}"
        side = "-" if r["side_by_side"] is None else f"{r['side_by_side']:.0%}"
        lines.append(f"{label:30}{r['max_batch']:>14}{of:>14}{rate:>11}{side:>14}"
                     f"{r['hazards'] if r['hazards'] is not None else '-':>9}")
    at = results["at_waterwave_batch"]
    lines.append("")
    lines.append(f"at batch {at['batch']} each: lockstep "
                 + ("trains" if at["lockstep"]["ok"] else "runs out of memory")
                 + f"; waterwave peaks at {at['waterwave']['peak_reserved'] / GiB:.2f} GiB reserved")

    def rate(r: dict) -> str:
        return "runs out of memory" if not r["ok"] else (
            "-" if r["throughput"] is None else f"{r['throughput']:,.0f} samples/s")
    lines.append(f"  one after another (pytorch policy): {rate(at['sequential'])}")
    lines.append(f"  sharing, each job its own eager loop (job.train's default, ww.sharing): "
                 f"{rate(at['sharing'])}")
    lines.append(f"  a captured session (capture=True): {rate(at['session'])}"
                 + (f", running {at['session_ran']}" if at["session_ran"] else ""))
    return "\n".join(lines)


# The trials of a search, on a simulated GPU -------------------------------------
MiB = 1 << 20


def trials_on_gpu(graphs: list, gpu: str = "H100-80GB", steps: int = 6) -> dict:
    """What trials that trained side by side (their captured steps, ``Job.graph``)
    would do on a simulated ``gpu`` under a cap just below what they reserve
    side by side under PyTorch's caching policy: there side by side runs out
    of memory, and the choice is between one trial after another, the
    trials as sharing members (``job.train``'s default: each trial its own
    eager loop, gated by a budget) and a captured training session
    (``sim.schedules.SessionSchedule``: side by side, in turn, one after
    another or paired, whichever it measures fastest), each under its own
    allocator. Every figure is simulated."""
    if not graphs:
        raise ValueError("trials_on_gpu needs the graphs of the trials that trained together")
    kernels = KernelModel.load()
    plain = [eager_trace(g, gpu, kernels) for g in graphs]
    side_by_side = simulate(plain, gpu, None, "lockstep", "pytorch", steps, record=False)
    cap = max(MiB, (side_by_side.peak_reserved - 1) // MiB * MiB)  # a MiB short, at least
    session = named_schedule("session", cap)
    traces = [eager_trace(g, gpu, kernels, partition=session.partition(g)) for g in graphs]
    policy, config = ALLOCATORS["session"]
    shared = simulate(traces, gpu, cap, session, policy, steps, config=config, record=False)
    capped = simulate(plain, gpu, cap, "lockstep", "pytorch", steps, record=False)
    one_by_one = simulate(plain, gpu, cap, "sequential", "pytorch", steps, record=False)
    member_policy, member_config = ALLOCATORS["sharing"]  # job.train's default
    members = simulate(plain, gpu, cap, "sharing", member_policy, steps, config=member_config,
                       record=False)
    # Blocks past the graph's tensors are the BLAS libraries' workspaces, per stream.
    workspaces = sum(n for g, t in zip(graphs, plain) for b, n, _, _ in t.persistent
                     if b >= len(g.tensors))

    def figures(r) -> dict:
        return {"ok": r.ok, "peak_reserved": r.peak_reserved,
                "throughput": r.throughput if r.ok else None}

    return {"gpu": gpu, "trials": len(graphs), "simulated": True, "blas_workspaces": workspaces,
            "memory_limit": cap,
            "lockstep": {"peak_reserved": side_by_side.peak_reserved,
                         "throughput": side_by_side.throughput},
            "lockstep_under_the_limit": figures(capped),
            "sequential": figures(one_by_one),
            "sharing": {**figures(members), "hazards": members.hazards,
                        "forced": (members.sharing or {}).get("forced")},
            "session": {**figures(shared), "hazards": shared.hazards,
                        "ran": shared.session["pairing"] if shared.session else None,
                        "why": shared.session["why"] if shared.session else None}}


def format_trials(r: dict) -> str:
    def rate(x):
        return "no steady steps to measure a rate in" if x is None else f"{x:,.0f} samples/s"

    def run(x):
        return rate(x["throughput"]) if x["ok"] else "runs out of memory"

    session, cap = r["session"], r["memory_limit"] / MiB

    def speedup(x):
        one = r["sequential"]
        return (f"  ({x['throughput'] / one['throughput']:.2f}x one after another)"
                if x["ok"] and one["ok"] and x["throughput"] and one["throughput"] else "")

    return "\n".join([
        f"{r['trials']} of these trials on a simulated {r['gpu']}:",
        f"  side by side, no cap (PyTorch):  {r['lockstep']['peak_reserved'] / MiB:8.1f} MiB "
        f"reserved, {rate(r['lockstep']['throughput'])}",
        f"    (of which {r['blas_workspaces'] / MiB:.0f} MiB are cuBLAS and cuBLASLt workspaces, "
        "one each per stream: small models' memory is mostly these)",
        f"  under a cap of {cap:.0f} MiB, a MiB short of that:",
        f"    side by side (PyTorch):        {run(r['lockstep_under_the_limit'])}",
        f"    one after another (PyTorch):   {run(r['sequential'])}",
        f"    each trial its own eager loop, sharing (job.train's default): "
        f"{run(r['sharing'])}{speedup(r['sharing'])}",
        f"    a session choosing its way (capture=True): {run(session)}"
        + (f", running {session['ran']}" if session["ran"] else "") + speedup(session),
        "  (all simulated, not measured on a GPU; a trainer on a GPU probes side by side too,"
        " under the cap, and puts back a job whose step runs out there)"])
