"""``waterwave simulate`` and ``waterwave replay``: training jobs on one
simulated GPU, and a user's own PyTorch memory snapshot through a policy.

Every figure these commands print is simulated, and they say so.

May import: every other waterwave package.
"""
from __future__ import annotations

import json
import re
import sys

from ..alloc.settings import parse_config
from ..sim.gpus import GPUS
from ..sim.jobs import JobModel
from ..sim.kernels import NONE, KernelModel
from ..sim.maxbatch import max_batch, simulate_models
from ..sim.multijob import SIMULATED_POLICIES
from ..sim.schedules import ALLOCATORS, NAMES
from ..sim.trace import Trace, from_snapshot
from . import models
from .plots import jobs_memory, replay_memory

MAX_BATCH_SCHEDULES = ("lockstep", "phased", "waterwave")  # --max-batch without --schedule

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20,
         "gib": 1 << 30}


def parse_size(text: str, what: str = "a size") -> int:
    """"12GiB", "12 GB", "512MiB", "1e9" -> bytes; ``what`` names the value in errors."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 12GiB, 512MiB or 1e9")
    try:
        value = int(float(m.group(1)) * UNITS[unit])
    except (ValueError, OverflowError):  # not a number, or infinite
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 12GiB, 512MiB or 1e9") \
            from None
    if not 0 < value < 1 << 62:
        raise ValueError(f"{what} must be positive and below 2^62 bytes, got {text!r}: write e.g. "
                         "12GiB")
    return value


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f} MiB"


# The library's models, captured once a process: a model's steps are the
# same whichever command asks (a user's module is read afresh each time).
_LIBRARY_JOB_MODELS: dict[tuple[str, int | None], JobModel] = {}


def _job_models(names: list[str], input_size: int | None = None):
    for n in names:
        if not models.is_known(n):
            raise ValueError(f"unknown model {n!r}: choose one of {', '.join(models.names())}, "
                             "or any torchvision image classifier")
        models.check_input_size(n, input_size)

    def job_model(n: str) -> JobModel:
        made = models.job_model(n, input_size)
        if models.is_user_model(n):
            return made
        return _LIBRARY_JOB_MODELS.setdefault((n, input_size), made)
    cache = {n: job_model(n) for n in set(names)}
    return [cache[n] for n in names]


def simulate_command(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    limit = parse_size(args.memory_limit, "--memory-limit") if args.memory_limit else None
    if args.split_size is not None:
        args.split_size = parse_size(args.split_size, "--split-size")
    if args.config:
        parse_config(args.config)  # a bad one is refused before anything is captured
    jobs = _job_models(args.models, args.input_size)
    kernels = KernelModel.load() if args.kernels == "measured" else NONE
    schedules = args.schedule or (list(MAX_BATCH_SCHEDULES) if args.max_batch else ["lockstep"])
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=args.json) as progress:
        if args.max_batch:
            result = _max_batches(args, jobs, kernels, limit, schedules, progress)
        else:
            result = _at_batch(args, jobs, kernels, limit, schedules[0], progress)
            if len(schedules) > 1:  # each schedule's figures beside the first's
                result["by_schedule"] = {result["schedule"]: _schedule_figures(result)}
                for other in schedules[1:]:
                    r, _ = _simulate_at(args, jobs, kernels, limit, other, args.batch_size)
                    result["by_schedule"][other] = _schedule_figures(r.summary())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_simulation(result, args)
    if result.get("ok", True):
        return 0
    # Exit 1: the simulation ran, and the jobs did not fit; said on stderr too,
    # so a script reading only the exit code and stderr knows why.
    oom = result.get("oom") or {}
    print(f"waterwave simulate: out of memory in {oom.get('name', 'a job')} under the "
          f"{result.get('schedule', 'first')} schedule"
          + (f" within {_mib(limit) if limit >= 2**20 else f'{limit:,} bytes'}" if limit else "")
          + ": raise --memory-limit or lower --batch-size", file=sys.stderr)
    return 1


def allocator_for(args, schedule: str) -> tuple[str, str]:
    """The policy and config a schedule runs under: the ones given, else the
    schedule's own (``sim.schedules.ALLOCATORS``)."""
    policy, config = ALLOCATORS[schedule]
    return args.policy or policy, config if args.config is None else args.config


def _simulate_at(args, jobs, kernels, limit, schedule: str, batch: int):
    """The jobs at ``batch`` under ``schedule`` and its allocator, recorded."""

    result, traces = simulate_models(jobs, batch, args.gpu, schedule, limit, kernels, args.steps,
                                     args.policy, args.config, args.split_size,
                                     concurrent_kernels=args.concurrent_kernels)
    split = [t.meta["partition"]["split_size"] if "partition" in t.meta else None for t in traces]
    return result, split


def _schedule_figures(summary: dict) -> dict:
    """What compares schedules at one batch: throughput (samples per second,
    all jobs), the GPU's busy share, step times, the peak, and the operator
    order and allocator policy a pipeline schedule chose."""
    return {k: summary[k] for k in ("ok", "policy", "config", "throughput", "gpu_busy",
                                    "step_time_us", "peak_reserved", "shared_rounds", "order",
                                    "session")}


def _at_batch(args, jobs, kernels, limit, schedule, progress) -> dict:
    task = progress.add_task(f"simulating {len(jobs)} job(s) at batch {args.batch_size}, "
                             f"{args.steps} steps", total=None, last="")
    r, split = _simulate_at(args, jobs, kernels, limit, schedule, args.batch_size)
    progress.remove_task(task)
    if args.plot:
        jobs_memory(r, args.plot)
    return {"simulated": True, **r.summary(), "split_size": split, "plot": args.plot}


def _max_batches(args, jobs, kernels, limit, schedules, progress) -> dict:
    def run(models, schedule, label):
        task = progress.add_task(f"largest batch, {label}", total=None, last="")

        def heard(batch, fits):
            progress.update(task, last=f"batch {batch}: {'fits' if fits else 'out of memory'}")

        policy, config = allocator_for(args, schedule)
        found = max_batch(models, args.gpu, limit, schedule, policy, kernels, args.steps,
                          on_trial=heard, split_size=args.split_size, config=config)
        progress.remove_task(task)
        return found

    distinct = list(dict.fromkeys(args.models))
    sole = {n: run([jobs[args.models.index(n)]], "lockstep", f"{n} alone").max_batch
            for n in distinct}
    out = {"simulated": True, "gpu": args.gpu, "memory_limit": limit,
           "policy": allocator_for(args, "lockstep")[0], "jobs": args.models,
           "sole_max_batch": sole[distinct[0]] if len(distinct) == 1 else sole, "max_batch": {}}
    reference = min(sole.values())
    for schedule in schedules:
        found = run(jobs, schedule, f"{len(jobs)} jobs, {schedule}")
        r = found.result
        policy, config = allocator_for(args, schedule)  # as run() searched with
        out["max_batch"][schedule] = {
            "policy": policy, "config": config,
            "max_batch": found.max_batch,
            "ratio_to_sole": round(found.max_batch / reference, 3) if reference else None,
            "trials": found.trials,
            "peak_reserved": r.peak_reserved if r else None,
            "throughput": r.throughput if r else None,
            "hazards": r.hazards if r else None,
        }
    best = max(schedules, key=lambda s: out["max_batch"][s]["max_batch"])
    if args.plot and out["max_batch"][best]["max_batch"]:
        jobs_memory(_simulate_at(args, jobs, kernels, limit, best,
                                 out["max_batch"][best]["max_batch"])[0], args.plot)
        out["plot"] = args.plot
    return out


def _print_simulation(result: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cap = _mib(result.get("memory_limit")) if result.get("memory_limit") else "the whole GPU"
    title = f"{' + '.join(args.models)} on a simulated {args.gpu}, {cap}"
    configs = {}  # schedule -> allocator config, under the largest-batch table
    if "max_batch" in result:
        t = Table(title=f"largest batch per job: {title}")
        for col in ("schedule", "policy", "batch", "of alone", "peak", "samples/s",
                    "hazards"):
            t.add_column(col, justify="left" if col in ("schedule", "policy") else "right",
                         no_wrap=True)
        t.add_row("alone", result["policy"], str(result["sole_max_batch"]), "", "", "", "")
        for s, v in result["max_batch"].items():
            t.add_row(s, v["policy"], str(v["max_batch"]),
                      f"{v['ratio_to_sole']:.0%}" if v["ratio_to_sole"] else "-",
                      _mib(v["peak_reserved"]),
                      f"{v['throughput']:,.0f}" if v["throughput"] else "-",
                      "-" if v["hazards"] is None else str(v["hazards"]))
        configs = {s: v["config"] for s, v in result["max_batch"].items() if v["config"]}
    else:
        t = Table(title=f"batch {args.batch_size}: {title}")
        t.add_column("")
        t.add_column("value", justify="right")
        t.add_row("schedule", result["schedule"])
        if result.get("session"):
            t.add_row("the session ran", f"{result['session']['pairing']}: {result['session']['why']}")
        t.add_row("allocator", result["policy"] + (f", {result['config']}" if result["config"]
                                                   else ""))
        t.add_row("result", "ran" if result["ok"] else
                  f"out of memory in {result['oom']['name']}")
        t.add_row("peak reserved", _mib(result["peak_reserved"]))
        t.add_row("peak allocated", _mib(result["peak_allocated"]))
        for name, st in zip(result["jobs"], result["step_time_us"]):
            t.add_row(f"step time, {name}", "-" if st is None else f"{st / 1000:.1f} ms")
        t.add_row("throughput, steady steps", f"{result['throughput']:,.0f} samples/s"
                  if result["throughput"] else "-")
        t.add_row("GPU busy, same time", f"{result['gpu_busy']:.1%}"
                  if result.get("gpu_busy") is not None else "-")
        if any(result["split_size"]):
            t.add_row("node-group split size", ", ".join(_mib(b) for b in result["split_size"]))
        t.add_row("syncs / stream waits", f"{result['syncs']} / {result['stream_waits']}")
        t.add_row("hazards", str(result["hazards"]))
        t.add_row("kernels of different jobs", "at once where they fit"
                  if result.get("concurrent_kernels") else "one at a time")
    console.print(t)
    if result.get("by_schedule"):
        t = Table(title=f"batch {args.batch_size}, every schedule: {title}")
        for col in ("schedule", "policy", "samples/s", "GPU busy", "peak"):
            t.add_column(col, justify="left" if col in ("schedule", "policy") else "right")
        for s, v in result["by_schedule"].items():
            chose = v.get("session")
            t.add_row(f"{s} ({chose['pairing']})" if chose else s, v["policy"], f"{v['throughput']:,.0f}" if v["throughput"] else "-",
                      f"{v['gpu_busy']:.1%}" if v["gpu_busy"] is not None else "-",
                      _mib(v["peak_reserved"]) if v["ok"] else "out of memory")
        console.print(t)
    if configs:
        print("allocator config: " + "; ".join(f"{s}: {c}" for s, c in configs.items()))
    print("all figures are simulated, not measured on a GPU"
          + (f"; memory over time: {result['plot']}" if result.get("plot") else ""))


def replay_command(args) -> int:
    trace = (Trace.load(args.snapshot) if args.snapshot.endswith(".json")
             else from_snapshot(args.snapshot))
    s = trace.replay(args.policy, record=bool(args.plot))
    result = {"simulated": True, "file": args.snapshot, "policy": args.policy,
              "streams": len(trace.streams), "operators": len(trace.ops),
              "peak_reserved": s["reserved_bytes.all.peak"],
              "peak_allocated": s["allocated_bytes.all.peak"],
              "fragmentation_at_peak": s["fragmentation.at_peak_reserved"],
              "hazards": len(s["hazards"]), "plot": args.plot}
    if args.plot:
        replay_memory(s["timeline"], args.plot, f"{trace.name}: {args.policy} policy (simulated)")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.snapshot}: {result['operators']} allocations and frees on "
          f"{result['streams']} stream(s), replayed through the {args.policy} policy (simulated)")
    print(f"  peak reserved   {_mib(result['peak_reserved'])}")
    print(f"  peak allocated  {_mib(result['peak_allocated'])}")
    print(f"  fragmentation   {result['fragmentation_at_peak']:.1%} at the peak of reserved")
    print(f"  hazards         {result['hazards']}")
    if args.plot:
        print(f"memory over time: {args.plot}")
    return 0


def add_parsers(sub) -> None:
    sim = sub.add_parser("simulate", help="training jobs on one simulated GPU, each on its own "
                                          "stream")
    sim.add_argument("models", nargs="+", help="one model name per job (e.g. resnet50 resnet50)")
    sim.add_argument("--gpu", default="H100-80GB", choices=list(GPUS))
    sim.add_argument("--memory-limit", help="a cap, e.g. 12GiB (default: the GPU's memory)")
    size = sim.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=int, default=32, help="the batch of every job")
    size.add_argument("--max-batch", action="store_true",
                      help="search the largest batch per job, alone and for each schedule")
    sim.add_argument("--schedule", action="append", choices=list(NAMES),
                     help="repeat for several (default: lockstep; with --max-batch, "
                          f"{', '.join(MAX_BATCH_SCHEDULES)}); waterwave, waterwave-alg1 and "
                          "waterwave-s are the NodeGroup pipeline")
    sim.add_argument("--policy", choices=SIMULATED_POLICIES,
                     help="the allocator's policy (default: each schedule's own: pytorch for "
                          "lockstep and phased, waterwave for the NodeGroup pipeline)")
    sim.add_argument("--config", help="the allocator's config, PYTORCH_CUDA_ALLOC_CONF-style "
                                      "(default: each schedule's own: max_split_size_mb:128 for "
                                      "waterwave and waterwave-alg1, none for the others)")
    sim.add_argument("--split-size", help="node-group size for the NodeGroup pipeline, e.g. "
                                          "256MiB (default: each job's peak over 8)")
    sim.add_argument("--steps", type=int, default=3, help="training steps per job")
    sim.add_argument("--input-size", type=int,
                     help="image classifiers' input side in pixels (default 224; 32 for CIFAR)")
    sim.add_argument("--concurrent-kernels", action="store_true",
                     help="the GPU runs kernels of different jobs at once while their SM and "
                          "bandwidth shares fit (default: one kernel at a time)")
    sim.add_argument("--kernels", choices=["measured", "none"], default="measured",
                     help="library workspaces and first calls as measured on an H100, or none")
    sim.add_argument("--plot", help="draw memory over time per job to this PNG")
    sim.add_argument("--json", action="store_true", help="print the figures as JSON")
    sim.set_defaults(func=simulate_command)

    rep = sub.add_parser("replay", help="a PyTorch memory snapshot (or a trace .json) through a "
                                        "policy on the simulated GPU")
    rep.add_argument("snapshot")
    rep.add_argument("--policy", default="pytorch", choices=["pytorch", "waterwave"])
    rep.add_argument("--plot", help="draw memory over time per stream to this PNG")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=replay_command)
