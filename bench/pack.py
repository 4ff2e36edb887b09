"""Offset packing on instances whose optimum is known or tight: how often
`pack` settles them at the max-live bound (which proves the layout optimal),
how long it takes, and which of the two searches does it.

Families:
  * zero-slack tilings: guillotine cuts of a 40-step x 64-unit rectangle
    (tests/test_planner.py::zero_slack); the buffers tile the memory exactly;
    also on a 400-step x 1024-unit rectangle;
  * slack at the peak: random lifetimes and sizes with the capacity at their
    max-live bound (tests/test_planner.py::slack_at_peak), tight only at the
    peak, as in MiniMalloc's benchmarks;
  * CSV files given with --csv (id,lower,upper,size or MiniMalloc's
    buffer,start,end,size), e.g. MiniMalloc's benchmarks/challenging/*.csv (once asplos2024) from
    github.com/google/minimalloc (not shipped here).

    python bench/pack.py [--time-limit 10] [--seeds 6] [--csv FILE ...]
        [--out bench/results/pack.md]
"""
import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_planner import slack_at_peak, zero_slack

from waterwave import _C
from waterwave.planner import pack
from waterwave.planner.buffer_csv import read_buffer_csv
from waterwave.planner.offsets import greedy_pack, max_live


def settles_alone(bufs, strategy, seconds):
    """Whether one search alone finds a layout at the max-live bound."""
    status, _, _ = _C.search_offsets([b.lower for b in bufs], [b.upper for b in bufs],
                                     [b.size for b in bufs], max_live(bufs), seconds, strategy)
    return status == "found"


def family_row(label, instances, limit):
    solved, greedy_ok, spot, buffer, times = 0, 0, 0, 0, []
    for name, bufs in instances:
        lb = max_live(bufs)
        greedy_ok += greedy_pack(bufs)[1] == lb
        t = time.time()
        packed = pack(bufs, time_limit=limit)
        arena, status = packed.arena_size, packed.status
        took = time.time() - t
        spot += settles_alone(bufs, "spot", limit)
        buffer += settles_alone(bufs, "buffer", limit)
        print(f"{label} {name}: {status}, arena {arena} vs bound {lb}, {took:.2f} s", flush=True)
        if arena == lb:
            solved += 1
            times.append(took)
    n = len(instances)
    timing = f"{statistics.median(times):.2f} | {max(times):.2f}" if times else "- | -"
    return (f"| {label} | {solved} of {n} | {timing} | {spot} of {n} | {buffer} of {n} | "
            f"{greedy_ok} of {n} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pieces", default="60,150,300,450",
                    help="zero-slack tiling sizes on the 40-step x 64-unit grid")
    ap.add_argument("--fine-pieces", default="300,450",
                    help="zero-slack tiling sizes on a 400-step x 1024-unit grid")
    ap.add_argument("--counts", default="100,200,400", help="slack-at-peak instance sizes")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--csv", nargs="*", default=[], help="buffer CSV files to pack as well")
    ap.add_argument("--out", default="bench/results/pack.md")
    args = ap.parse_args()
    limit = args.time_limit
    seeds = range(1, args.seeds + 1)
    lines = [
        "# Offset packing at the max-live bound",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this project's CPU machine "
        f"({os.cpu_count()} cores, {platform.processor() or platform.machine()}), "
        f"`python bench/pack.py --time-limit {limit:g}`"
        + (" --csv ..." if args.csv else "") + f", seeds 1..{args.seeds}. "
        "`pack` runs best fit, then the spot and the buffer search side by side "
        "(csrc/planner/offset_search.h), first at the max-live bound: a layout there is "
        "optimal. \"Settled\" means a layout at the bound within the time limit; the two "
        "middle columns run each search alone at the bound with the same limit.",
        "",
        "| instances | pack settled | median s | worst s | spot search alone | buffer search alone | best fit |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in (int(x) for x in args.pieces.split(",") if x):
        lines.append(family_row(f"zero-slack tiling, {n} buffers",
                                [(f"seed {s}", zero_slack(s, n)) for s in seeds], limit))
    # The same cuts on a finer grid: fewer buffers start together and fewer
    # are one unit wide, closer to the lifetimes of real programs.
    for n in (int(x) for x in args.fine_pieces.split(",") if x):
        lines.append(family_row(f"zero-slack tiling on 400 x 1024, {n} buffers",
                                [(f"seed {s}", zero_slack(s, n, steps=400, units=1024))
                                 for s in seeds], limit))
    for n in (int(x) for x in args.counts.split(",") if x):
        lines.append(family_row(f"slack at the peak, {n} buffers",
                                [(f"seed {s}", slack_at_peak(s, n)[0]) for s in seeds], limit))
    if args.csv:
        lines += ["", "CSV files: `pack` minimizes the arena; where the file name carries a "
                  "capacity (MiniMalloc's `A.1048576.csv`), the search is also asked the "
                  "benchmark's own question, a layout within that capacity.", "",
                  "| file | buffers | max-live bound | pack: arena | proven bound | status | s "
                  "| within the file's capacity | s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for path in args.csv:
            bufs = read_buffer_csv(path).buffers
            t = time.time()
            packed = pack(bufs, time_limit=limit)
            arena, bound, status = packed.arena_size, packed.lower_bound, packed.status
            took = time.time() - t
            row = (f"| {os.path.basename(path)} | {len(bufs)} | {max_live(bufs):,} | "
                   f"{arena:,} | {bound:,} | {status} | {took:.2f} |")
            named = [int(p) for p in os.path.basename(path).split(".") if p.isdigit()]
            if named:
                t = time.time()
                found, _, _ = _C.search_offsets([b.lower for b in bufs], [b.upper for b in bufs],
                                                [b.size for b in bufs], named[0], limit)
                row += f" {named[0]:,}: {found} | {time.time() - t:.2f} |"
            else:
                row += " - | - |"
            print(row, flush=True)
            lines.append(row)
    lines.append("")
    open(args.out, "w").write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
