"""What ``Job.train`` costs the host, on the CPU: the wall time per step of
k jobs trained with ``job.train`` from k threads at once (Optuna's
``n_jobs``), against plain PyTorch training the same jobs one after
another in eager loops, for a small MLP, resnet18 on 32x32 images and a
small transformer encoder, with 1, 2 and 4 jobs.

    python bench/concurrent/train_host.py [--out bench/results] [--steps 30] [--quick]

Each job trains ``steps`` steps after one warm-up call (its capture is not
counted; an eager loop's first step is not either). Every measurement runs
in a fresh process, eager and ``job.train`` in turn: run in one process,
whichever ran second was slowed by the memory the first left behind. The session has no
memory limit (the CPU has none), so the jobs run side by side; on a 2-core
machine they share its cores, as eager loops run one after another do not,
so the ratio also holds the cost of that sharing. Results go to
bench/results/train_host.{json,md}, naming the machine. A benchmark, not a
test: it prints what it measured, and the target (within 10% of eager for
resnet18 and the transformer) is read from the table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import waterwave as ww  # noqa: E402


class SmallTransformer(torch.nn.Module):
    """Token classification by a 2-layer encoder (d_model 128, 4 heads)."""

    def __init__(self, vocab=1000, d=128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def make(model_name: str, seed: int):
    """(model, a list of batches) for one job."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
        data = [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))
                for _ in range(4)]
    elif model_name == "resnet18-32":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        data = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                for _ in range(4)]
    elif model_name == "transformer":
        model = SmallTransformer()
        data = [(torch.randint(0, 1000, (16, 64), generator=g),
                 torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    else:
        raise ValueError(f"unknown model {model_name!r}")
    return model, data


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def eager_seconds(model_name: str, jobs: int, steps: int) -> float:
    """Wall seconds for ``jobs`` eager loops of ``steps`` steps, one after another."""
    total = 0.0
    for k in range(jobs):
        model, data = make(model_name, k)
        opt = optimizer(model)

        def step(i):
            x, y = data[i % len(data)]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()

        step(0)  # warm-up, as the job's first call is
        start = time.perf_counter()
        for i in range(steps):
            step(i + 1)
        total += time.perf_counter() - start
    return total


def train_seconds(model_name: str, jobs: int, steps: int) -> float:
    """Wall seconds for ``jobs`` threads each calling ``job.train(steps)`` at
    once; one job calls it on the main thread, as a plain loop (or Optuna's
    ``n_jobs=1``) does. (PyTorch's CPU operators run slower from a second
    thread than from the main one, whoever calls them: resnet18's eager step
    took 88 ms there against 62 ms on the main thread, its OpenMP thread team
    being the thread's own. A thread for one job measured that, not
    Waterwave.)"""
    session = ww.TrainingSession("cpu")
    made = []
    for k in range(jobs):
        model, data = make(model_name, k)
        job = ww.Job(model, loss_fn=F.cross_entropy, optimizer=optimizer(model), data=data)
        job.train(1, session=session)  # warm-up: the first call cuts the step into groups
        made.append(job)
    if jobs == 1:
        start = time.perf_counter()
        made[0].train(steps, session=session)
        elapsed = time.perf_counter() - start
        if made[0].failed:
            raise RuntimeError(f"the job failed: {made[0].error!r}")
        return elapsed
    go = threading.Barrier(jobs + 1)
    threads = [threading.Thread(target=lambda j=j: (go.wait(), j.train(steps, session=session)))
               for j in made]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    failed = [j for j in made if j.failed]
    if failed:
        raise RuntimeError(f"a job failed: {failed[0].error!r}")
    return elapsed


def measure(model_name: str, jobs: int, steps: int, mode: str) -> float:
    """Seconds of one measurement, in a fresh process."""
    r = subprocess.run([sys.executable, __file__, "--one", model_name, str(jobs), str(steps), mode],
                       capture_output=True, text=True, timeout=900, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} {model_name} x{jobs} failed: {r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one model, 1 and 2 jobs, 3 steps")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "JOBS", "STEPS", "MODE"),
                    help=argparse.SUPPRESS)  # one measurement: what measure() runs
    args = ap.parse_args(argv)
    if args.one:
        model_name, jobs, steps, mode = args.one
        run = eager_seconds if mode == "eager" else train_seconds
        print(run(model_name, int(jobs), int(steps)))
        return 0
    models = ["mlp"] if args.quick else ["mlp", "resnet18-32", "transformer"]
    counts = [1, 2] if args.quick else [1, 2, 4]
    steps = 3 if args.quick else args.steps
    repeats = 1 if args.quick else args.repeats
    rows = []
    for model_name in models:
        for jobs in counts:
            times = {"eager": [], "train": []}
            for _ in range(repeats):  # in turn, so that drift hits both alike
                for mode in times:
                    times[mode].append(measure(model_name, jobs, steps, mode))
            eager, ours = statistics.median(times["eager"]), statistics.median(times["train"])
            row = {"model": model_name, "jobs": jobs, "steps_per_job": steps,
                   "eager_ms_per_step": 1000 * eager / (jobs * steps),
                   "train_ms_per_step": 1000 * ours / (jobs * steps), "ratio": ours / eager}
            rows.append(row)
            print(f"{model_name:12} {jobs} job(s): eager one after another "
                  f"{row['eager_ms_per_step']:7.2f} ms/step, job.train side by side "
                  f"{row['train_ms_per_step']:7.2f} ms/step ({row['ratio']:.2f}x)", flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_host.json"), "w") as f:
        json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    lines = ["# Job.train's host cost against eager loops (measured on the CPU)", "",
             f"Machine: {machine}; {time.strftime('%Y-%m-%d')}. Made by "
             "`python bench/concurrent/train_host.py`: the median of "
             f"{repeats} runs of {steps} steps per job, after a warm-up call, each run in a fresh "
             "process.", "",
             "| model | jobs | eager, one after another, ms/step | job.train (one job: on the main "
             "thread; more: from a thread each), ms/step | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['jobs']} | {r['eager_ms_per_step']:.2f} | "
                     f"{r['train_ms_per_step']:.2f} | {r['ratio']:.2f} |")
    with open(os.path.join(args.out, "train_host.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"results: {args.out}/train_host.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
