"""Offset packing on zero-slack instances: guillotine tilings of a 40-step x
64-unit rectangle (each unit 512 bytes), whose optimum is exactly their
max-live bound. Per size: how many of the seeds `pack` settles at the bound
within the time limit, and how long it took.

    python bench/pack.py [--pieces 60,150,300,450] [--seeds 6] [--time-limit 20]
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

from test_planner import zero_slack  # noqa: E402  (the tests' generator, one definition)

from waterwave.planner import pack  # noqa: E402
from waterwave.planner.offsets import greedy_pack, max_live  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pieces", default="60,150,300,450")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--out", default="bench/results/pack.md")
    args = ap.parse_args()
    lines = [
        "# Offset packing on zero-slack instances",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this project's CPU machine "
        f"({os.cpu_count()} cores, {platform.processor() or platform.machine()}), "
        f"`python bench/pack.py --time-limit {args.time_limit:g}`. Instances: guillotine "
        "tilings of a 40-step x 64-unit rectangle (tests/test_planner.py::zero_slack), seeds "
        f"1..{args.seeds}; the optimum equals the max-live bound. `pack` runs best fit, then "
        "the complete offset search (csrc/planner/offset_search.h).",
        "",
        "| buffers | settled at the bound | best fit at the bound | median s (settled) | worst s (settled) |",
        "|---|---|---|---|---|",
    ]
    for n in (int(x) for x in args.pieces.split(",")):
        solved, greedy_ok, times = 0, 0, []
        for seed in range(1, args.seeds + 1):
            bufs = zero_slack(seed, n)
            lb = max_live(bufs)
            greedy_ok += greedy_pack(bufs)[1] == lb
            t = time.time()
            _, arena, _, status = pack(bufs, time_limit=args.time_limit)
            took = time.time() - t
            print(f"{n} buffers, seed {seed}: {status}, arena {arena} vs bound {lb}, {took:.2f} s",
                  flush=True)
            if arena == lb:
                solved += 1
                times.append(took)
        lines.append(f"| {n} | {solved} of {args.seeds} | {greedy_ok} of {args.seeds} | "
                     + (f"{statistics.median(times):.2f} | {max(times):.2f} |" if times else "- | - |"))
    lines.append("")
    open(args.out, "w").write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
