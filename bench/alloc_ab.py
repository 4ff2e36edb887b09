"""Allocator hot paths of two builds, measured in one run: does a change
make `waterwave bench alloc` slower?

    python bench/alloc_ab.py BEFORE_TREE AFTER_TREE [--rounds 3] [--out results.md]

Each tree is a checkout with its waterwave/_C built in place (for example a
`git worktree` of the earlier commit, built with `setup.py build_ext
--inplace`). The two builds run alternately, each in its own process,
`rounds` times; each run is `waterwave bench alloc`'s own median of 5
repetitions. The table gives the median run and the range of runs, and the
ratio after/before. glibc's row is the yardstick for the machine's noise:
its code is the same in both builds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN = ("import json, sys; sys.path.insert(0, sys.argv[1]); from waterwave import _C; "
       "print(json.dumps(_C.bench_alloc(int(sys.argv[2]), 1, 5)))")


def measure(tree: str, pairs: int) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", RUN, tree, str(pairs)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for which, tree in (("before", args.before), ("after", args.after)):
            for c in measure(tree, args.pairs):
                times.setdefault((c["name"], c["policy"]), {}).setdefault(which, []).append(
                    c["ns_per_pair"])
    fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})"
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {cpu_name()}: {args.rounds} alternating "
             f"runs of each build, {args.pairs:,} pairs per case; ns per alloc+free pair, median "
             "run (range). Simulated device: CPU-side cost only, no GPU involved.", "",
             f"before: `{args.before}`, after: `{args.after}`", "",
             "| case | policy | before | after | after / before |", "|---|---|---|---|---|"]
    for (case, policy), d in times.items():
        ratio = statistics.median(d["after"]) / statistics.median(d["before"])
        lines.append(f"| {case} | {policy} | {fmt(d['before'])} | {fmt(d['after'])} | {ratio:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
