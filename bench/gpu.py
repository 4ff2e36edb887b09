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
The runs under Waterwave's two policies are recorded from their first
allocation (waterwave.cuda.start_recording); the traces go to gpu_traces/
beside the JSON, and the report replays each through the simulated device
(waterwave.planner.baseline.replay_trace): does the simulator reserve what
the GPU did for the same sequence, and how does the eager sequence differ
from the captured graph's? --report does that part with no GPU.
And a capture process captures the model three ways: on the CPU with the
CPU's kernels, on the CPU with the CUDA kernels the planner emulates
(waterwave.capturing.cuda_kernels), and on the GPU itself; it replays each through the
simulated pytorch policy and says whether the emulated graph is the GPU's.
Each allocator runs ``--repeats`` times (5 by default), the allocators taking
turns run by run, so that what the GPU does meanwhile (its clocks, another
tenant) falls on them alike; a row reports the median of the runs' medians
and their spread, and says whether every run gave the same losses.
Prints a table and writes JSON. Needs a GPU.
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
    from waterwave.tools import models

    if mode != "native":
        ww.install_allocator(policy="waterwave" if mode == "planned" else mode)
    recording = mode in ("pytorch", "waterwave")
    if recording:  # from the first allocation: the weights' too
        wc.start_recording(0)
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
    if recording:
        out["trace"] = wc.stop_recording(0)
    return out


def capture_child(name: str, bs: int) -> dict:
    """The graph PyTorch runs on the GPU against the one the planner
    captures on the CPU: operators that differ, bytes, the simulated
    baseline peak of each."""
    import collections

    import torch

    from waterwave.capturing import capture
    from waterwave.planner.baseline import replay
    from waterwave.tools import models

    out = {"mode": "capture", "model": name, "batch_size": bs}
    # (label, where the model lives, whose kernels the graph records)
    for label, device, kernels in (("cpu", "cpu", "cpu"), ("emulated", "cpu", "cuda"),
                                   ("cuda", "cuda", "cuda")):
        torch.manual_seed(0)
        net, inputs, loss_fn = models.build(name, bs, device=device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        g = capture(net, inputs, loss_fn, opt, name=f"{name}-{label}", kernels=kernels)
        ops = collections.Counter(n.op for n in g.nodes)
        out[label] = {
            "nodes": len(g.nodes),
            "tensors": len(g.tensors),
            "transient_bytes": sum(t.size for t in g.tensors if not t.persistent),
            # what the planner's baseline says PyTorch reserves (program order)
            "simulated_baseline_peak": replay(g).peak_reserved,
            "ops": dict(ops),
        }
        del net, opt
        torch.cuda.empty_cache()
    cpu, gpu, emulated = out["cpu"]["ops"], out["cuda"]["ops"], out["emulated"]["ops"]
    out["ops_only_cpu"] = sorted(set(cpu) - set(gpu))
    out["ops_only_cuda"] = sorted(set(gpu) - set(cpu))
    # Batch norm is left to the CPU's kernel on purpose (cuDNN's keeps the same bytes).
    out["emulated_ops_not_on_cuda"] = sorted(set(emulated) - set(gpu))
    out["emulated_same_bytes"] = all(out["emulated"][k] == out["cuda"][k]
                                     for k in ("transient_bytes", "simulated_baseline_peak"))
    for d in ("cpu", "emulated", "cuda"):
        del out[d]["ops"]
    return out


def combine_runs(runs: list[dict]) -> dict:
    """One allocator's repeated runs of a model as one row: the first run's
    figures (losses, peaks, traces), its step time the median of the runs'
    medians, with each run's, the spread ((max - min) / median) and whether
    every run gave the first one's losses. Failed runs are counted; a row
    of failures is the first failure."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return dict(runs[0], failed_runs=len(runs))
    row = dict(done[0])
    medians = [r["step_ms_median"] for r in done if "step_ms_median" in r]
    if medians:
        mid = statistics.median(medians)
        row.update(step_ms_median=round(mid, 2), step_ms_runs=medians,
                   step_ms_spread=round((max(medians) - min(medians)) / mid, 4) if mid else 0.0)
    if "losses" in row:
        row["same_losses_every_run"] = all(r.get("losses") == row["losses"] for r in done)
    row["runs"], row["failed_runs"] = len(runs), len(runs) - len(done)
    return row


def paired_to_native(runs: list[dict], native: list[dict]) -> dict:
    """An allocator's step time against native PyTorch's, run by run: the
    k-th run of each was made in the same round of turns, so their ratio
    leaves out whatever drifts from round to round (on an H200, 2026-11-27,
    the ratios spread as widely as the runs: the noise was each run's). The
    median ratio, and each round's; empty where no round has both."""
    ratios = [r["step_ms_median"] / n["step_ms_median"] for r, n in zip(runs, native)
              if "error" not in r and "error" not in n
              and r.get("step_ms_median") and n.get("step_ms_median")]
    if not ratios:
        return {}
    return {"to_native_paired": round(statistics.median(ratios), 4),
            "to_native_rounds": [round(x, 4) for x in ratios]}


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
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs of each allocator, taking turns; the median of their medians")
    ap.add_argument("--modes", default=",".join(MODES) + ",capture")
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "BS", "STEPS"))
    ap.add_argument("--report", metavar="JSON", help="write the markdown report of a saved run "
                    "next to it (needs no GPU)")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        md = os.path.splitext(args.report)[0] + ".md"
        with open(md, "w") as f:
            f.write(report(data["meta"], data["rows"], os.path.dirname(os.path.abspath(args.report))))
        print(f"wrote {md}")
        return
    if args.child:
        mode, name, bs, steps = args.child
        res = capture_child(name, int(bs)) if mode == "capture" else child(mode, name, int(bs),
                                                                             int(steps))
        print(json.dumps(res))
        return
    import torch

    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "python": platform.python_version(), "batch_size": args.batch_size,
            "steps": args.steps, "repeats": args.repeats,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = []
    modes = args.modes.split(",")
    for name in args.models.split(","):
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                if mode == "capture" and repeat:  # a capture is not timed: once is enough
                    continue
                t = time.time()
                r = run_child(["--child", mode, name, str(args.batch_size), str(args.steps)])
                r.setdefault("model", name)
                r.setdefault("mode", mode)
                r["wall_seconds"] = round(time.time() - t, 1)
                trace = r.pop("trace", None)
                if trace is not None and not any("trace_file" in x for x in runs[mode]):
                    r["trace_file"] = save_trace(args.out, name, mode, trace)
                runs[mode].append(r)
                print(json.dumps(r), flush=True)
        for mode in modes:
            row = combine_runs(runs[mode])
            if mode not in ("native", "capture") and "native" in runs and "error" not in row:
                row.update(paired_to_native(runs[mode], runs["native"]))
            rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(meta, rows)


def save_trace(out: str, name: str, mode: str, trace) -> str:
    """Writes a run's recorded blocks beside the results; returns the path
    relative to them."""
    rel = os.path.join("gpu_traces", f"{name}-{mode}.json")
    path = os.path.join(os.path.dirname(os.path.abspath(out)), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"blocks": "(size, allocated, freed): times on one clock of allocations "
                             "and frees, freed -1 if never freed", "trace": trace}, f)
    return rel


def trace_rows(rows, where: str) -> list[str]:
    """The recorded runs replayed on the simulated device, as markdown."""
    from waterwave.planner.baseline import replay_trace

    out = []
    by = {(r["model"], r["mode"]): r for r in rows if "error" not in r}
    for (name, mode), r in by.items():
        path = os.path.join(where, r.get("trace_file") or "")
        if not r.get("trace_file") or not os.path.exists(path):
            continue
        with open(path) as f:
            trace = [tuple(b) for b in json.load(f)["trace"]]
        sim = replay_trace(trace, mode)
        capture = by.get((name, "capture"))
        graph = (_mib(capture["cuda"]["simulated_baseline_peak"]) if capture else "-")
        out.append(f"| {name} | `{mode}` | {len(trace)} | {_mib(r['peak_reserved'])} | "
                   f"{_mib(sim.peak_reserved)} | {_mib(sim.ideal_peak)} | {graph} |")
    return out


def _ms(row) -> str:
    spread = row.get("step_ms_spread")
    return f"{row['step_ms_median']:.2f}" + ("" if spread is None else f" (±{spread:.0%})")


def _mib(n) -> str:
    return f"{n / MiB:,.0f}"


def report(meta, rows, where: str = ".") -> str:
    """The run as markdown: allocators side by side, then capture against
    reality; ``where`` holds the JSON and its gpu_traces/."""
    by = {(r["model"], r["mode"]): r for r in rows if "error" not in r}
    names = list(dict.fromkeys(r["model"] for r in rows))
    out = [
        "# Training on a GPU: PyTorch's allocator, Waterwave's, and a planned step",
        "",
        (f"Measured by `bench/gpu.py` on one {meta['device']} (lent to one session), torch "
        f"{meta['torch']}, Python {meta['python']}, {meta['when']}. Batch size "
        f"{meta['batch_size']}, SGD with momentum, {meta['steps']} steps per run, each run in its "
        "own process; cuDNN deterministic. Peaks are over steps 3 onwards: the planned trainer "
        "warms up on step 1, records step 2 and serves steps 3 onwards from the plan, so the "
        "other allocators are measured over the same steps. Reserved memory includes the "
        "weights and momentum buffers (allocated before training) and, for `planned`, the "
        "plan's whole arena. ms/step is the median over steps 2 onwards of each run, then the "
        f"median over {meta.get('repeats', 1)} runs per allocator, the allocators taking turns; "
        "the spread, (max - min) / median of the runs, follows it."),
        "",
        ("| model | native reserved MiB | `pytorch` policy | `waterwave` policy | planned | "
        "planned saving | plan arena MiB (bound) | ms/step native / `pytorch` / `waterwave` / "
        "planned (spread) | max loss diff |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        nat, pt, ww, pl = (by.get((name, m)) for m in MODES)
        if not (nat and pt and ww and pl):
            out.append(f"| {name} | run failed: see gpu.json | | | | | | | |")
            continue
        diff = max(abs(a - b) for r in (pt, ww, pl) for a, b in zip(r["losses"], nat["losses"]))
        tp = pl["trace_plan"]
        bound = "= bound" if tp["arena_bytes"] == tp["bound"] else f"bound {_mib(tp['bound'])}"
        saving = 1 - pl["peak_reserved"] / nat["peak_reserved"]
        out.append(
            f"| {name} | {_mib(nat['peak_reserved'])} | {_mib(pt['peak_reserved'])} | "
            f"{_mib(ww['peak_reserved'])} | {_mib(pl['peak_reserved'])} | {saving:.1%} | "
            f"{_mib(tp['arena_bytes'])} ({bound}) | {_ms(nat)} / {_ms(pt)} / {_ms(ww)} / "
            f"{_ms(pl)} | {diff:.1e} |")
    out += [
        "",
        ("- `pytorch` is Waterwave's re-implementation of PyTorch's caching policy, installed "
        "through `waterwave.install_allocator(policy=\"pytorch\")`; `waterwave` the multi-stream "
        "policy; `planned` is `waterwave.optimize(..., strategy=\"greedy\")` with the allocator "
        "installed. Plan statistics per planned run (allocations served from the plan / "
        "by the online allocator / deviations over the planned steps):"),
    ]
    for name in names:
        pl = by.get((name, "planned"))
        if pl:
            p = pl["plan"]
            out.append(f"  - {name}: {p['planned']} / {p['fallback']} / {p['deviations']} over "
                       f"{p['steps']} steps; plan made in {pl['plan_seconds']} s, the recorded "
                       f"step packed in one arena of {tp_status(pl)}.")
    out += [
        "",
        "## What the CPU capture predicts",
        "",
        ("The planner captures the step with fake tensors on the CPU, by default with the "
        "kernels a CUDA device runs (`waterwave/cuda_kernels.py`; a '-' marks a run made "
        "before that existed). Here the same model is also captured with the CPU's kernels and "
        "with CUDA fake tensors on the GPU, and every graph is replayed through the "
        "simulated `pytorch` policy (program order), against what native PyTorch reserved "
        "and allocated in eager training (steps 3 onwards; its reserved memory never shrinks, "
        "so that is also the whole run's). `tests/test_cuda_kernels.py` checks on the CPU that "
        "the emulated capture reproduces this run's CUDA captures."),
        "",
        ("| model | simulated, CPU capture MiB | simulated, CPU capture with CUDA kernels MiB | "
         "simulated, CUDA capture MiB | native reserved / allocated MiB (steps 3..) | "
         "operators only on CUDA |"),
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        c, nat = by.get((name, "capture")), by.get((name, "native"))
        if not (c and nat):
            continue
        # runs from before the emulation existed have no "emulated" capture
        emulated = _mib(c["emulated"]["simulated_baseline_peak"]) if "emulated" in c else "-"
        out.append(f"| {name} | {_mib(c['cpu']['simulated_baseline_peak'])} | {emulated} | "
                   f"{_mib(c['cuda']['simulated_baseline_peak'])} | {_mib(nat['peak_reserved'])} / "
                   f"{_mib(nat['peak_allocated'])} | "
                   f"{', '.join(o.replace('aten.', '') for o in c['ops_only_cuda'])} |")
    traced = trace_rows(rows, where)
    if traced:
        out += [
            "",
            "## The eager runs, replayed on the simulator",
            "",
            ("Each run under a Waterwave policy was recorded from its first allocation (weights, "
             "momentum, every step, cuDNN and cuBLAS workspaces included) and replayed through "
             "the same policy on the simulated device (reserved memory only grows in these runs, "
             "so the whole run's peak is that of steps 3 onwards). Where the simulator reserves "
             "what the GPU "
             "did, the policy's model holds and any gap between the planner's baseline and "
             "eager PyTorch lies in the allocation sequence itself, which the last two columns "
             "compare: the most bytes the recorded sequence had live, and the simulated baseline "
             "of the graph captured on the GPU (one step, program order)."),
            "",
            ("| model | policy | blocks recorded | reserved on the GPU MiB | reserved on the "
             "simulator MiB | most live in the recording MiB | simulated baseline of the captured "
             "graph MiB |"),
            "|---|---|---|---|---|---|---|",
        ] + traced
    return "\n".join(out) + "\n"


def tp_status(row) -> str:
    tp = row["trace_plan"]
    return f"{_mib(tp['arena_bytes'])} MiB ({tp['status']}, {tp['allocations']} allocations)"


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
                  f"{g['simulated_baseline_peak'] / MiB:.0f} MiB; emulated same bytes: "
                  f"{r.get('emulated_same_bytes', '-')}; only cuda: "
                  f"{','.join(r['ops_only_cuda'])[:60]}")
            continue
        base = native.get(r["model"])
        diff = (max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
                if base else float("nan"))
        note = ""
        if r["mode"] == "planned":
            p = r["plan"]
            note = (f"planned {p['planned']}, fallback {p['fallback']}, deviations "
                    f"{p['deviations']}/{p['steps']} {p['last_deviation'][:70]}")
        if "to_native_paired" in r:
            note = f"{r['to_native_paired']:.3f}x native, run by run; " + note
        # a plan allocator's allocated peak leaves out its planned blocks: not comparable
        alloc = "-" if r["mode"] == "planned" else f"{r['peak_allocated'] / MiB:7.0f}"
        print(f"{r['model']:14} {r['mode']:10} {r['peak_reserved'] / MiB:11.0f} MiB "
              f"{alloc:>7} MiB {r['step_ms_median']:8.1f} {diff:10.2e}  {note}")


if __name__ == "__main__":
    main()
