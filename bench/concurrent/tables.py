"""The Waterwave paper's evaluation in simulation (its Tables 1 and 2,
section 5.5, Figure 8), for bench/concurrent/run.py.

Every figure here is simulated on the CPU: jobs from captured steps on a
named GPU (kernel tables measured on the H100, rules for other models), no
memory cap but the GPU's own. "Waterwave" is the NodeGroup pipeline with the
memory-aware pairing under the waterwave policy with ``max_split_size_mb``
set (ALLOC_CONFIG); the variants beside it say what each part is worth.
"""
from __future__ import annotations

from waterwave.sim.jobs import JobModel
from waterwave.sim.kernels import KernelModel
from waterwave.sim.maxbatch import max_batch
from waterwave.sim.multijob import simulate
from waterwave.sim.schedules import NodeGroupSchedule
from waterwave.sim.schedules import schedule as named_schedule
from waterwave.tools import models

GPU = "V100-32GB"
ALLOC_CONFIG = "max_split_size_mb:128"
# label -> (schedule, policy, allocator config, SyncAndCoalesce between rounds)
VARIANTS = {
    "lockstep": ("lockstep", "pytorch", "", False),
    "Waterwave-s": ("waterwave-s", "waterwave", "", False),
    "Algorithm 1": ("waterwave-alg1", "waterwave", ALLOC_CONFIG, False),
    "Waterwave": ("waterwave", "waterwave", ALLOC_CONFIG, False),
    "Waterwave + SyncAndCoalesce": ("waterwave", "waterwave", ALLOC_CONFIG, True),
    "Waterwave, pytorch policy": ("waterwave", "pytorch", "", False),
    "Waterwave, no max_split": ("waterwave", "waterwave", "", False),
}
TABLE1 = ["resnet50", "resnet152", "inception_v3", "bert-base"]
PAPER_TABLE1 = {"resnet50": (406, 266, 370), "resnet152": (186, 118, 160),
                "inception_v3": (332, 204, 310), "bert-base": (138, 88, 124)}  # sole, -s, ww


class Lab:
    """Job models by name, captured once, and the searches run on them."""

    def __init__(self, kernels: KernelModel, progress=print):
        self.kernels, self.models, self.say = kernels, {}, progress

    def model(self, name: str) -> JobModel:
        if name not in self.models:
            self.models[name] = models.job_model(name)
        return self.models[name]

    def search(self, names, schedule="lockstep", policy="pytorch", config="", sync=False,
               gpu=GPU, limit=None, split_size=None, groups=None):
        if groups is not None:  # a node-group schedule cutting each peak in `groups`
            schedule = NodeGroupSchedule(schedule, split_size, limit or _memory(gpu),
                                         groups=groups)
        found = max_batch([self.model(n) for n in names], gpu, limit, schedule, policy,
                          self.kernels, config=config, split_size=split_size,
                          sync_at_barrier=sync)
        r = found.result
        self.say(f"  {'+'.join(names)} {getattr(schedule, '__name__', schedule)} {policy} "
                 f"{config or ''}{f' groups {groups}' if groups else ''}: {found.max_batch}")
        return {"max_batch": found.max_batch, "throughput": r.throughput if r else None,
                "gpu_busy": r.gpu_busy if r else None,
                "peak_reserved": r.peak_reserved if r else None, "syncs": r.syncs if r else None,
                "hazards": r.hazards if r else None,
                "shared_rounds": r.shared_rounds if r else None}

    def run_at(self, names, batches, schedule, policy, config="", sync=False, gpu=GPU,
               limit=None):
        sched = named_schedule(schedule, limit or _memory(gpu))
        cut = getattr(sched, "partition", None)
        jobs = [self.model(n).trace_at(b, gpu, self.kernels, partition=cut)
                for n, b in zip(names, batches)]
        return simulate(jobs, gpu, limit, sched, policy, steps=3, config=config,
                        sync_at_barrier=sync, record=False)


def _memory(gpu: str) -> int:
    from waterwave.sim.gpus import gpu as named

    return named(gpu).memory


def table1(lab: Lab) -> dict:
    """Two identical jobs: the largest batch per job under each variant, its
    ratio to one job alone, and the pair's throughput against lockstep at
    lockstep's largest batch."""
    out = {}
    for name in TABLE1:
        lab.say(f"Table 1: {name}")
        # One job alone, under native PyTorch and under Waterwave's allocator
        # settings; the ratios are to the larger.
        native = lab.search([name])["max_batch"]
        ours = lab.search([name], "lockstep", *VARIANTS["Waterwave"][1:])["max_batch"]
        sole = max(native, ours)
        row = {"sole": sole, "sole_native": native, "sole_waterwave_allocator": ours,
               "paper": dict(zip(("sole", "waterwave-s", "waterwave"), PAPER_TABLE1[name]))}
        for label, variant in VARIANTS.items():
            r = lab.search([name] * 2, *variant)
            r["ratio"] = r["max_batch"] / sole if sole else None
            row[label] = r
        row["throughput_at_lockstep_batch"] = at_lockstep_batch(lab, name, row["lockstep"])
        out[name] = row
    return out


def at_lockstep_batch(lab: Lab, name: str, lockstep: dict, **where) -> dict | None:
    """The pair's throughput and the GPU's busy share under lockstep and
    Waterwave, both at lockstep's largest batch (the issue's target: the
    pipeline's throughput at least lockstep's at the same batch)."""
    b = lockstep["max_batch"]
    if not b:
        return None
    out = {"batch": b}
    for label in ("lockstep", "Waterwave"):
        r = lab.run_at([name] * 2, [b, b], *VARIANTS[label], **where)
        out[label] = r.throughput if r.ok else None
        out[f"{label} gpu_busy"] = r.gpu_busy if r.ok else None
    return out


def more_jobs(lab: Lab) -> dict:
    """Three and four ResNet50 jobs (paper, section 5.5: 336 and 310)."""
    out = {}
    for n in (3, 4):
        lab.say(f"{n} x resnet50")
        out[n] = {label: lab.search(["resnet50"] * n, *VARIANTS[label])
                  for label in ("lockstep", "Waterwave")}
    return out


def mixed(lab: Lab, names=("resnet50", "bert-base")) -> dict:
    """Two different models (paper, Table 2: ResNet50 358 + BERT-base 116):
    the largest common fraction of each one's solo batch (steps of 1/32)."""
    lab.say(f"Table 2: {' + '.join(names)}")
    sole = [lab.search([n])["max_batch"] for n in names]
    out = {"sole": dict(zip(names, sole))}
    for label in ("lockstep", "Waterwave"):
        lo, hi, best = 0, 32, None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            batches = [max(8, s * mid // 32 // 8 * 8) for s in sole]
            r = lab.run_at(list(names), batches, *VARIANTS[label])
            if r.ok:
                lo, best = mid, (batches, r.throughput)
            else:
                hi = mid - 1
        out[label] = {"fraction": lo / 32, "batches": dict(zip(names, best[0])) if best else None,
                      "throughput": best[1] if best else None}
    return out


def split_sweep(lab: Lab, name="resnet50", sizes_gib=(0.25, 0.5, 1, 2, 4, 6, 8, 12)) -> dict:
    """Figure 8: the largest batch and its throughput against the split size."""
    lab.say(f"Figure 8: {name}")
    out = {}
    for gib in sizes_gib:
        out[gib] = lab.search([name] * 2, *VARIANTS["Waterwave"], split_size=int(gib * (1 << 30)))
    out["auto"] = lab.search([name] * 2, *VARIANTS["Waterwave"])
    return out


def turns(lab: Lab, h100_limit: int) -> dict:
    """Waterwave with groups as large as a step's peak: the safe pairing
    then takes turns step by step. Against the default (peak / 8), per
    Table 1 model and for the H100 pair under its cap."""
    lab.say("Whole steps in turns")
    out = {}
    cases = [(name, GPU, None) for name in TABLE1] + [("resnet50", "H100-80GB", h100_limit)]
    for name, gpu, limit in cases:
        label = name if limit is None else f"{name}, H100 under {limit / (1 << 30):g} GiB"
        out[label] = {"peak": lab.search([name] * 2, *VARIANTS["Waterwave"], gpu=gpu,
                                         limit=limit, groups=1)}
    return out
