"""The MODeL paper's experiment: per model and batch size, the baseline peak
(program order through the pytorch policy), the ideal peak of program order,
and the greedy, mxnet, paddle and model plans (peak, gap, time).

    python bench/planner.py [--models a,b] [--batch-sizes 1,32] [--time-limit 30]
        [--kernels cuda|cpu] [--out bench/results/planner.json]

Steps are captured with the kernels a CUDA device runs (the default) or with
the CPU's (--kernels cpu).

Writes JSON; bench/planner_report.py turns it into planner.md and a chart.
Captured graphs are cached under bench/results/graphs/ (not committed).
"""
import argparse
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from waterwave.capturing import KERNELS  # noqa: E402
from waterwave.graph import Graph  # noqa: E402
from waterwave.planner import check_plan, plan  # noqa: E402
from waterwave.planner.baseline import replay  # noqa: E402
from waterwave.tools import models  # noqa: E402


def graph_for(name, bs, cache, kernels):
    import torch

    from waterwave.capturing import capture

    path = os.path.join(cache, f"{name}-bs{bs}-{kernels}.json")
    timing = path + ".seconds"
    if os.path.exists(path) and os.path.exists(timing):
        return Graph.load(path), float(open(timing).read())
    net, inputs, loss = models.build(name, bs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    t = time.time()
    g = capture(net, inputs, loss, opt, name=f"{name}-bs{bs}", kernels=kernels)
    took = time.time() - t
    g.save(path)
    with open(timing, "w") as f:
        f.write(f"{took:.2f}")
    return g, took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(models.names()))
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--kernels", choices=KERNELS, default=KERNELS[0],
                    help="whose kernels the captured steps record (see waterwave.capturing.cuda_kernels)")
    ap.add_argument("--out", default="bench/results/planner.json")
    args = ap.parse_args()
    cache = os.path.join(os.path.dirname(args.out), "graphs")
    os.makedirs(cache, exist_ok=True)
    rows = []
    if os.path.exists(args.out):
        previous = json.load(open(args.out))
        if previous.get("kernels", "cpu") == args.kernels:  # else start afresh
            rows = previous.get("rows", [])
    done = {(r["model"], r["batch_size"]) for r in rows}
    for name in args.models.split(","):
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            if (name, bs) in done:
                continue
            row = {"model": name, "batch_size": bs}
            try:
                g, took = graph_for(name, bs, cache, args.kernels)
                row.update(nodes=len(g.nodes), tensors=len(g.tensors), capture_seconds=round(took, 2),
                           persistent_bytes=g.persistent_bytes())
                base = replay(g)
                row.update(baseline_peak=base.peak_reserved, baseline_fragmentation=base.fragmentation,
                           program_order_ideal=base.ideal_peak)
                row["plans"] = {}
                for strategy in ("greedy", "mxnet", "paddle", "model"):
                    p = plan(g, strategy, time_limit=args.time_limit)
                    check_plan(g, p)
                    row["plans"][strategy] = {"peak": p.arena_size, "seconds": p.solve_seconds,
                                     "status": p.status, "order_bound": p.lower_bound,
                                     "inplace_pairs": len(p.inplace),
                                     "proven_bound": p.stats.get("proven_lower_bound"),
                                     "bound_without_inplace": p.stats.get("bound_without_inplace"),
                                     "inplace_bound": p.stats.get("inplace_bound"),
                                     "arena_without_inplace": p.stats.get("arena_without_inplace"),
                                     "gap": p.stats.get("gap")}
            except Exception as e:  # record and go on: the report shows failures
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
            json.dump({"rows": rows, "time_limit": args.time_limit, "kernels": args.kernels,
                       "where": {"processor": platform.processor() or platform.machine(),
                                 "cores": os.cpu_count()},
                       "date": time.strftime("%Y-%m-%d")}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
