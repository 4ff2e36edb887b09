"""bench/results/planner.json -> bench/results/planner.md and planner.png.

    python bench/planner_report.py bench/results/planner.json bench/results/planner.md
"""
import json
import os
import statistics
import sys

STRATS = ("greedy", "mxnet", "paddle", "model")


KERNEL_WORDS = {
    "cuda": ("with the kernels a CUDA device runs (fused dropout, memory-efficient attention: "
             "`waterwave/cuda_kernels.py`)"),
    "cpu": "with the CPU's kernels",
}


def main(src, dst):
    d = json.load(open(src))
    rows = d["rows"]
    ok = [r for r in rows if "error" not in r]
    mib = lambda b: f"{b / 2**20:,.0f}"
    kernels = d.get("kernels", "cpu")  # runs from before kernels= were the CPU's
    lines = [
        "# Planner benchmark (MODeL experiment)",
        "",
        f"Measured {d['date']} on this project's CPU machine ({d['where']['cores']} cores), "
        f"`python bench/planner.py --time-limit {d['time_limit']:g} --kernels {kernels}`. Each "
        "model's full training step (forward, backward, SGD with momentum) was captured with "
        f"fake tensors, {KERNEL_WORDS[kernels]}; sizes are "
        "what PyTorch's CUDA caching allocator would request. Peaks are computed, not measured on "
        "a GPU: the baseline replays program order through the allocator core's `pytorch` policy "
        "(PyTorch 2.14's caching rules, fragmentation included) on the simulated device.",
        "",
        "Columns: baseline peak (MiB); the ideal peak of program order (no fragmentation); then "
        "each strategy's peak and its saving against the baseline; for `model` (CP-SAT, warm-"
        "started from greedy, stopping at a 0.1% gap), the gap to the lower bound it proved and "
        "its solve time; last, the most any order and layout could save: the saving at the "
        "proven bound without in-place sharing, and at the bound with it (the cut bound less "
        "what sharing can save at each operator; it holds for every order, layout and "
        "sharing, `waterwave/planner/cut_bound.py`). `greedy` and `model` share an input's "
        "memory with an operator's output along their order where that is smaller (the runtime "
        "runs those operators in place); such a plan is marked *, and its gap is against the "
        "bound with sharing.",
        "",
        "| model | batch | ops | baseline | program order ideal | greedy | mxnet | paddle | model "
        "| model gap | model s | saving at the bound without sharing | with sharing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch_size']} | failed: {r['error'][:120]} |||||||||||")
            continue
        b = r["baseline_peak"]
        p = r["plans"]
        def cell(s, p=p, b=b):
            return (f"{mib(p[s]['peak'])}{'*' if p[s].get('inplace_pairs') else ''} "
                    f"({1 - p[s]['peak'] / b:.0%})")
        gap = p["model"]["gap"]
        no_share = p["model"].get("bound_without_inplace")
        if gap is None and no_share:
            gap = 1 - no_share / p["model"]["peak"]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['nodes']} | {mib(b)} | "
                     f"{mib(r['program_order_ideal'])} | {cell('greedy')} | {cell('mxnet')} | "
                     f"{cell('paddle')} | {cell('model')} | "
                     f"{'-' if gap is None else f'{gap:.2%}'} | {p['model']['seconds']:.1f} | "
                     f"{_saving(r, _bound_without_sharing(r))} | {_saving(r, _bound_with_sharing(r))} |")
    lines += ["", "## Averages", ""]
    lines.append("| batch | models | " + " | ".join(f"{s} saving" for s in STRATS)
                 + " | model without in-place | model median s | model worst s "
                 "| saving at the bound without sharing | with sharing |")
    lines.append("|---|---|" + "---|" * len(STRATS) + "---|---|---|---|---|")
    summary, ceilings = {}, {}
    times_all = []
    for bs in sorted({r["batch_size"] for r in ok}):
        rs = [r for r in ok if r["batch_size"] == bs]
        sav = {s: statistics.mean(1 - r["plans"][s]["peak"] / r["baseline_peak"] for r in rs)
               for s in STRATS}
        times = [r["plans"]["model"]["seconds"] for r in rs]
        summary[bs] = sav
        ceilings[bs] = {
            kind: [1 - bound / r["baseline_peak"] for r in rs if (bound := fn(r))]
            for kind, fn in (("without", _bound_without_sharing), ("with", _bound_with_sharing))}
        unshared = statistics.mean(
            1 - (r["plans"]["model"].get("arena_without_inplace") or r["plans"]["model"]["peak"])
            / r["baseline_peak"] for r in rs)
        times_all.extend(times)
        lines.append(f"| {bs} | {len(rs)} | " + " | ".join(f"{sav[s]:.1%}" for s in STRATS)
                     + f" | {unshared:.1%} | {statistics.median(times):.1f} | {max(times):.1f} | "
                     + " | ".join(_mean_of(ceilings[bs][kind]) for kind in ("without", "with"))
                     + " |")
    frag = [(1 - r["plans"]["model"]["order_bound"] / r["plans"]["model"]["peak"],
             f"{r['model']} batch {r['batch_size']}", r["plans"]["model"].get("inplace_pairs", 0))
            for r in ok]
    worst = max(frag)
    wasted = [f for f in frag if f[0] > 0]
    if not wasted:
        frag_line = (f"- Zero fragmentation against each order's bound: every one of the {len(frag)} "
                     "`model` plans meets its order's bound"
                     + (f" ({sum(1 for f in frag if f[2])} of them with in-place sharing)"
                        if any(f[2] for f in frag) else "") + ". Met.")
    else:
        frag_line = (f"- Zero fragmentation against each order's bound: {len(wasted)} of {len(frag)} "
                     f"plans waste some; worst {worst[0]:.2%} ({worst[1]}"
                     + (", in-place sharing" if worst[2] else "") + "). Not met.")
    lines += [
        "",
        "## Targets",
        "",
        "- Average peak reduction of at least 35% at batch 1 and at batch 32: "
        + "; ".join(f"batch {bs}: {summary[bs]['model']:.1%} ({'met' if summary[bs]['model'] >= 0.35 else 'not met'})"
                    for bs in summary) + "."
        + ("" if not all(ceilings[bs]["with"] for bs in summary) else
           " The most any order, layout and in-place sharing could save, on average: "
           + "; ".join(f"batch {bs}: {_mean_of(ceilings[bs]['with'])}" for bs in summary) + "."),
        frag_line,
        f"- Median solve time at most 2 s and worst at most 30 s: median "
        f"{statistics.median(times_all):.1f} s, worst {max(times_all):.1f} s "
        f"({'met' if statistics.median(times_all) <= 2 and max(times_all) <= 30 else 'not met'}).",
        "",
    ]
    open(dst, "w").write("\n".join(lines))
    _chart(ok, os.path.splitext(dst)[0] + ".png")
    print("\n".join(lines))


def _bound_without_sharing(r):
    m = r["plans"]["model"]
    return m.get("bound_without_inplace") or (None if m.get("inplace_pairs") else m.get("proven_bound"))


def _bound_with_sharing(r):
    return r["plans"]["model"].get("inplace_bound")


def _saving(r, bound):
    return "-" if not bound else f"{1 - bound / r['baseline_peak']:.1%}"


def _mean_of(savings):
    return f"{statistics.mean(savings):.1%} ({len(savings)} models)" if savings else "-"


def _chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for ax, bs in zip(axes, (1, 32)):
        rs = [r for r in rows if r["batch_size"] == bs]
        names = [r["model"] for r in rs]
        x = range(len(rs))
        width = 0.18
        series = [("baseline", [1.0] * len(rs))] + [
            (s, [r["plans"][s]["peak"] / r["baseline_peak"] for r in rs]) for s in STRATS]
        for i, (label, vals) in enumerate(series):
            ax.bar([xi + (i - 2) * width for xi in x], vals, width, label=label)
        ax.set_ylabel(f"peak / baseline (batch {bs})")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=5, fontsize=8)
    fig.suptitle("Planned peak memory of one training step, relative to PyTorch's caching allocator")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(*sys.argv[1:3])
