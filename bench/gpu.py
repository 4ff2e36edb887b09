"""Training on a real GPU under each allocator, and what the planner's
CPU capture predicts for it.

    python bench/gpu.py [--models resnet18,gpt2] [--batch-size 32] [--steps 6]
        [--out bench/results/gpu.json]

Per model, each in its own process (PyTorch swaps its allocator once per
process), the same seeded training step (SGD with momentum) runs under:
  native     PyTorch's CUDACachingAllocator;
  pytorch    Waterwave's re-implementation of that policy (install_allocator);
  waterwave  Waterwave's multi-stream policy;
  planned    Waterwave with the trainer of waterwave.optimize: the greedy
             plan's order; step 1 warms up, step 2 is recorded and packed,
             later steps are served from that plan's arena;
and a capture process compares the graph captured with CUDA fake tensors
against the CPU capture the planner uses, and replays each through the
simulated pytorch policy. Prints a table and writes JSON. Needs a GPU.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODES = ("native", "pytorch", "waterwave", "planned")
MiB = 1024**2


def child(mode: str, name: str, bs: int, steps: int) -> dict:
    import torch

    import waterwave as ww
    from waterwave import cuda as wc
    from waterwave import models

    if mode in ("pytorch", "waterwave"):
        ww.install_allocator(policy=mode)
    elif mode == "planned":
        ww.install_allocator(policy="waterwave")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    net, inputs, loss_fn = models.build(name, bs, device="cuda")
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    out = {"mode": mode, "model": name, "batch_size": bs}
    if mode == "planned":
        t = time.time()
        trainer = ww.optimize(net, inputs, loss_fn, opt, strategy="greedy", time_limit=10)
        out["plan_seconds"] = round(time.time() - t, 2)
        out["plan_arena_size"] = trainer.plan.arena_size  # persistent tensors included

        def step():
            return trainer.step(*inputs)
    else:
        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(*inputs))
            loss.backward()
            opt.step()
            return loss.detach()

    losses, times = [], []
    for i in range(steps):
        if i == 2:  # the steady state: the planned trainer serves from its plan from here
            if mode == "native":
                torch.cuda.reset_peak_memory_stats()
            else:
                wc.reset_peak_memory_stats(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    out["losses"] = losses
    out["step_ms_median"] = round(1000 * statistics.median(times[1:]), 2)
    # Peaks over steps 3.. (see above): reserved memory includes everything
    # cached, persistent tensors (weights, momentum) and the plan's arena.
    if mode == "native":
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    else:
        s = wc.memory_stats(0)
        out["peak_reserved"] = s["reserved_bytes.all.peak"]
        out["peak_allocated"] = s["allocated_bytes.all.peak"]
        out["fragmentation_at_peak"] = s["fragmentation.at_peak_reserved"]
        out["free_errors"] = wc.free_errors()[0]
        wc.check_invariants(0)
    if mode == "planned":
        out["plan"] = trainer.plan_stats()
        out["trace_plan"] = trainer.trace_plan
    return out


def capture_child(name: str, bs: int) -> dict:
    """The graph PyTorch runs on the GPU against the one the planner
    captures on the CPU: operators that differ, bytes, the simulated
    baseline peak of each."""
    import collections

    import torch

    from waterwave import models
    from waterwave.capture import capture
    from waterwave.planner.baseline import replay

    out = {"mode": "capture", "model": name, "batch_size": bs}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        net, inputs, loss_fn = models.build(name, bs, device=device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        g = capture(net, inputs, loss_fn, opt, name=f"{name}-{device}")
        ops = collections.Counter(n.op for n in g.nodes)
        out[device] = {
            "nodes": len(g.nodes),
            "tensors": len(g.tensors),
            "transient_bytes": sum(t.size for t in g.tensors if not t.persistent),
            # what the planner's baseline says PyTorch reserves (program order)
            "simulated_baseline_peak": replay(g).peak_reserved,
            "ops": dict(ops),
        }
        del net, opt
        torch.cuda.empty_cache()
    cpu, gpu = out["cpu"]["ops"], out["cuda"]["ops"]
    out["ops_only_cpu"] = sorted(set(cpu) - set(gpu))
    out["ops_only_cuda"] = sorted(set(gpu) - set(cpu))
    for d in ("cpu", "cuda"):
        del out[d]["ops"]
    return out


def run_child(args) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False,
                       timeout=600)
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: " + (r.stderr or r.stdout)[-2000:], "args": args}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,mobilenet_v2,gpt2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default=",".join(MODES) + ",capture")
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "BS", "STEPS"))
    args = ap.parse_args()
    if args.child:
        mode, name, bs, steps = args.child
        res = capture_child(name, int(bs)) if mode == "capture" else child(mode, name, int(bs),
                                                                             int(steps))
        print(json.dumps(res))
        return
    import torch

    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "python": platform.python_version(), "batch_size": args.batch_size,
            "steps": args.steps, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            t = time.time()
            r = run_child(["--child", mode, name, str(args.batch_size), str(args.steps)])
            r.setdefault("model", name)
            r.setdefault("mode", mode)
            r["wall_seconds"] = round(time.time() - t, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(meta, rows)


def print_table(meta, rows):
    print(f"\n{meta['device']}, torch {meta['torch']}, batch {meta['batch_size']}, "
          f"{meta['steps']} steps")
    print("peaks over steps 3.. (after warm-up, and for 'planned' once the plan serves)")
    print(f"{'model':14} {'mode':10} {'peak reserved':>14} {'peak alloc':>11} {'ms/step':>8} "
          f"{'loss diff':>10}  notes")
    native = {r["model"]: r for r in rows if r.get("mode") == "native" and "losses" in r}
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14} {r['mode']:10} ERROR {r['error'].strip().splitlines()[-1][:80]}")
            continue
        if r["mode"] == "capture":
            c, g = r["cpu"], r["cuda"]
            print(f"{r['model']:14} capture    cpu {c['nodes']} nodes, sim peak "
                  f"{c['simulated_baseline_peak'] / MiB:.0f} MiB; cuda {g['nodes']} nodes, sim peak "
                  f"{g['simulated_baseline_peak'] / MiB:.0f} MiB; only cuda: "
                  f"{','.join(r['ops_only_cuda'])[:60]}")
            continue
        base = native.get(r["model"])
        diff = (max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
                if base else float("nan"))
        note = ""
        if r["mode"] == "planned":
            p = r["plan"]
            note = (f"planned {p['planned']}, unplanned {p['unplanned']}, fallback "
                    f"{p['fallback']}, deviations {p['deviations']}/{p['steps']} "
                    f"{p['last_deviation'][:70]}")
        print(f"{r['model']:14} {r['mode']:10} {r['peak_reserved'] / MiB:11.0f} MiB "
              f"{r['peak_allocated'] / MiB:7.0f} MiB {r['step_ms_median']:8.1f} {diff:10.2e}  {note}")


if __name__ == "__main__":
    main()
