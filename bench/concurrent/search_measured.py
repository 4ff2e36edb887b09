"""Trials per hour of ``search.py``'s Optuna search, measured: the trials
train for real, K at a time as ``study.optimize(n_jobs=K)`` runs them.

    python bench/concurrent/search_measured.py [--device cuda] [--family small|memory-bound]
        [--trials 8] [--jobs 4] [--epochs 2] [--steps 20] [--out bench/results]

On a GPU each way runs in a fresh process (a process's CUDA allocator is
chosen once); on the CPU, where nothing is chosen once, they run one after
another in this one (the PyTorch ways first, before Waterwave's CPU
allocator counts the sharing trials):

- one at a time: ``n_jobs=1``, PyTorch's allocator, an eager loop;
- side by side (PyTorch): ``n_jobs=K``, eager loops; a trial that runs out
  of memory fails (``catch``), as in a user's study, and is counted;
- ``ww.sharing``: Waterwave's allocator, ``n_jobs=K``, each epoch's loop
  in ``with ww.sharing(model):`` under the session's ``memory_limit``;
- ``job.train``: Waterwave's allocator, ``n_jobs=K``, an epoch a call, as
  the session runs it by default: each call's steps eager, one
  ``ww.sharing`` block;
- ``job.train (captured)``: the same in a session that captures each
  trial's step and pipelines it (``capture=True``). The H200's figures of
  2026-11-27 named ``job.train`` were of this way, the default then;
- ``ww.sharing, blocks split`` (on a GPU under a cap only): ``ww.sharing``
  with ``ww.cuda.set_max_split_size_mb(None)``, so the session leaves every
  cached block splittable: what keeping large ones whole gains and costs;
- ``ww.sharing, expandable segments`` and ``job.train, expandable
  segments`` (on a GPU under a cap only): the allocator installed with
  ``expandable_segments=True``, what the guide advises under a tight cap.

Each trial builds its model (resnet18 on 32x32 images at batch 128, or
resnet50 on 224x224 at batch 64 under a 12 GiB cap: ``--family``) and an
SGD optimizer from the learning rate and weight decay TPE (seed 0) asks
for, trains ``--epochs`` epochs of ``--steps`` batches of random images,
and reports ``search.accuracy``'s synthetic curve after each, so every way
makes the same decisions for the same trials; the median pruner stops
trials. What is measured is the training: wall time, out-of-memory
failures (and what the first ones said), the allocator's peak, the GPU's
busy share (NVML's, sampled). ``make gpu-check`` runs it on a GPU; on the
CPU (``--device cpu``, tiny settings) it checks itself. Writes
search_measured_<family>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for path in (ROOT, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from search import FAMILIES, accuracy  # noqa: E402

WAYS = ("one at a time", "side by side (PyTorch)", "ww.sharing", "job.train",
        "job.train (captured)", "ww.sharing, blocks split", "ww.sharing, expandable segments",
        "job.train, expandable segments")
# Only on a GPU under a cap: what keeping large cached blocks whole
# (alloc/cache_splits.py) gains and costs there, against splitting any block,
# and what expandable segments do there.
CAPPED_GPU_WAYS = ("ww.sharing, blocks split", "ww.sharing, expandable segments",
                   "job.train, expandable segments")
JOB_WAYS = ("job.train", "job.train (captured)", "job.train, expandable segments")


def child(way: str, args) -> dict:
    """One way's search in this process; what it measured."""
    import optuna
    import torch
    import torch.nn.functional as F
    import torchvision

    family = FAMILIES[args.family]
    device = torch.device(args.device)
    ww = None
    if way.startswith("ww.sharing") or way in JOB_WAYS:
        import waterwave as ww

        if device.type == "cuda":
            ww.install_allocator(expandable_segments=way.endswith("expandable segments"))
            if way == "ww.sharing, blocks split":  # the user's choice: the session keeps it
                ww.cuda.set_max_split_size_mb(None)
    if device.type == "cuda" and family.memory_limit is not None:
        # Every way under the same cap on what the process reserves (the
        # allocator's cache included), as nvidia-smi would show it.
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        from waterwave.alloc import fraction_allowing

        torch.cuda.set_per_process_memory_fraction(
            fraction_allowing(family.memory_limit, total), index)
    if ww is not None:
        # On a GPU the session's budget is then what the allocator can still
        # give under that cap; the CPU has no cap but the session's limit.
        # On the CPU without one a session counts nothing: job.train's way gets
        # a budget far above its trials, so that its jobs share it as on a GPU.
        cpu_limit = (family.memory_limit if family.memory_limit is not None
                     or way not in JOB_WAYS else 1 << 40)
        ww.training_session(args.device).configure(
            memory_limit=None if device.type == "cuda" else cpu_limit,
            capture=way == "job.train (captured)")
    side = family.side if device.type == "cuda" else 16
    batch = family.batch if device.type == "cuda" else 4

    def build():
        make = getattr(torchvision.models, family.model)
        return make(num_classes=10).to(device)

    def batches(seed: int):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(batch, 3, side, side, generator=g).to(device),
                 torch.randint(0, 10, (batch,), generator=g).to(device))
                for _ in range(args.steps)]

    started = time.perf_counter()
    best = {"value": None, "at": None}
    oom_messages: list[str] = []

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        wd = trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
        data = batches(trial.number)
        job = (ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=data)
               if way in JOB_WAYS else None)
        acc = None
        for epoch in range(1, args.epochs + 1):
            model.train()
            try:
                if job is not None:
                    job.train(steps=len(data))
                else:
                    with (ww.sharing(model) if way.startswith("ww.sharing") else _nothing()):
                        for x, y in data:
                            opt.zero_grad()
                            F.cross_entropy(model(x), y).backward()
                            opt.step()
            except torch.OutOfMemoryError as e:
                # Which allocation ran out, and under what: the study only
                # counts the failure.
                first = str(e).splitlines()[0] if str(e) else repr(e)
                if len(first) > 600:  # its start (what ran out), its end (why, for a member)
                    first = f"{first[:250]} ... {first[-350:]}"
                if first not in oom_messages and len(oom_messages) < 3:
                    oom_messages.append(first)
                raise
            acc = accuracy(lr, wd, epoch)
            trial.report(acc, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        if best["value"] is None or acc > best["value"]:
            best.update(value=acc, at=time.perf_counter() - started)
        return acc

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=4,
                                                                   n_warmup_steps=1))
    jobs = 1 if way == "one at a time" else args.jobs
    busy = BusySampler(device) if device.type == "cuda" else None
    study.optimize(objective, n_trials=args.trials, n_jobs=jobs, catch=(torch.OutOfMemoryError,))
    seconds = time.perf_counter() - started
    gpu_busy = busy.stop() if busy is not None else None
    states = [t.state.name for t in study.trials]
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
    session = None
    if ww is not None:  # what the session counted: its members' peak, its waits
        stats = ww.training_session(args.device).stats()
        session = {k: stats[k] for k in ("budget", "peak_bytes", "waits", "most_training")}
        if device.type == "cuda":  # what the session set (cache_splits), or -1: no limit
            session["max_split_size"] = ww.cuda.allocator(device).stats()["max_split_size"]
    return {"way": way, "jobs": jobs, "seconds": seconds,
            "trained": states.count("COMPLETE") + states.count("PRUNED"),
            "ooms": states.count("FAIL"),
            "trials_per_hour": (states.count("COMPLETE") + states.count("PRUNED"))
            / (seconds / 3600),
            "best": best["value"], "seconds_to_best": best["at"], "peak_reserved": peak,
            "oom_messages": oom_messages, "gpu_busy": gpu_busy, "session": session}


class BusySampler:
    """The GPU's busy share while a way runs: NVML's utilization (the share
    of each sample period in which some kernel ran), read every 0.1 s by
    ``torch.cuda.utilization`` on a thread of its own, averaged; None where
    NVML cannot be read (no pynvml: make gpu-wheels carries it)."""

    def __init__(self, device, period: float = 0.1):
        import torch

        self.samples: list[float] = []
        self.failed = False
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(period):
                try:
                    self.samples.append(torch.cuda.utilization(device) / 100)
                except Exception:  # noqa: BLE001 (no NVML here: the share is unknown)
                    self.failed = True
                    return

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        if self.failed or not self.samples:
            return None
        return sum(self.samples) / len(self.samples)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def child_env() -> dict:
    """This process's environment for a way's process, with the repository
    first on PYTHONPATH and what was there kept (make gpu-check puts the
    extras it installed, Optuna among them, there)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="small")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # run one way, print JSON
    args = ap.parse_args(argv)
    if args.way:
        print(json.dumps(child(args.way, args)))
        return 0
    on_gpu = args.device.startswith("cuda")
    import torch

    if on_gpu:
        if not torch.cuda.is_available():
            print("search_measured.py trains on a GPU: none is visible to torch here. "
                  "bench/concurrent/search.py simulates the same search on the CPU; "
                  "--device cpu checks this script.", file=sys.stderr)
            return 2
    rows = []
    for way in WAYS:
        if way in CAPPED_GPU_WAYS and not (on_gpu and FAMILIES[args.family].memory_limit):
            continue
        if not on_gpu:
            rows.append(child(way, args))
            print(json.dumps(rows[-1]), flush=True)
            continue
        r = subprocess.run([sys.executable, __file__, "--way", way, "--device", args.device,
                            "--family", args.family, "--trials", str(args.trials), "--jobs",
                            str(args.jobs), "--epochs", str(args.epochs), "--steps",
                            str(args.steps)], capture_output=True, text=True,
                           env=child_env())
        if r.returncode != 0:
            rows.append({"way": way, "error": r.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    where = (torch.cuda.get_device_name(0) if on_gpu
             else f"the CPU ({os.cpu_count()} cores)")
    report = {"measured": where, "date": time.strftime("%Y-%m-%d"), "family": args.family,
              "trials": args.trials, "jobs": args.jobs, "epochs": args.epochs,
              "steps": args.steps,
              "cap_bytes": FAMILIES[args.family].memory_limit if on_gpu else None, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"search_measured_{args.family}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / f"{stem}.md").write_text(text)
    print(text, end="")
    return 0 if all("error" not in r for r in rows) else 1


def markdown(report: dict) -> str:
    """``report`` (what main writes as JSON) as the markdown table."""
    family = FAMILIES[report["family"]]
    cap = ("" if report.get("cap_bytes") is None else
           f" Every way under one cap on what the process reserves, the allocator's cache "
           f"included ({report['cap_bytes'] / 2**30:g} GiB: `per_process_memory_fraction`).")
    lines = [f"# {family.name}: an Optuna search measured on {report['measured']}", "",
             f"{report['date']}, `python bench/concurrent/search_measured.py`: "
             f"{report['trials']} trials, {report['jobs']} at a time (one at a time: one), "
             f"{report['epochs']} epochs of {report['steps']} batches.{cap}", "",
             "| how | trials per hour | trained | best | s to best | OOMs | peak GiB | GPU busy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['way']} | failed: {' '.join(r['error'])} | | | | | | |")
            continue
        peak = "-" if r["peak_reserved"] is None else f"{r['peak_reserved'] / 2**30:.2f}"
        best = "-" if r["best"] is None else f"{r['best']:.4f}"
        to_best = "-" if r["seconds_to_best"] is None else f"{r['seconds_to_best']:.1f}"
        busy = "-" if r.get("gpu_busy") is None else f"{r['gpu_busy']:.0%}"
        lines.append(f"| {r['way']} | {r['trials_per_hour']:,.1f} | {r['trained']} | {best} | "
                     f"{to_best} | {r['ooms']} | {peak} | {busy} |")
    counted = [f"- {r['way']}: the members' counted peak {r['session']['peak_bytes'] / 2**30:.2f} "
               f"GiB, its budget "
               + ("-" if r["session"]["budget"] is None else
                  f"{r['session']['budget'] / 2**30:.2f} GiB")
               + f", waits {r['session']['waits']}"
               + ("" if "max_split_size" not in r["session"] else
                  (", every cached block may split" if r["session"]["max_split_size"] < 0 else
                   f", cached blocks of {r['session']['max_split_size'] / 2**20:g} MiB or more "
                   "never split"))
               for r in report["rows"] if r.get("session")]
    if counted:
        lines += ["", "What Waterwave's session counted:", "", *counted]
    said = [f"- {r['way']}: {m}" for r in report["rows"] for m in r.get("oom_messages", [])]
    if said:
        lines += ["", "Out of memory, as the first failures said it:", "", *said]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
