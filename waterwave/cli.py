"""The ``waterwave`` command line."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time


def _bench_alloc(args) -> int:
    from . import _C

    t0 = time.time()
    cases = _C.bench_alloc(args.pairs, args.seed, args.repeats)
    result = {
        "cases": cases,
        "pairs_per_case": args.pairs,
        "repeats": args.repeats,
        "where": {
            "machine": platform.machine(),
            "processor": _cpu_name(),
            "python": platform.python_version(),
            "note": ("CPU-side cost of the allocator on the simulated device; "
                     "no GPU was involved"),
        },
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - t0, 2),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'case':<18} {'policy':<10} {'ns/pair':>9} {'min':>8} {'max':>8}")
        for c in cases:
            print(f"{c['name']:<18} {c['policy']:<10} {c['ns_per_pair']:>9.1f} "
                  f"{c['min_ns']:>8.1f} {c['max_ns']:>8.1f}")
        print(f"measured on {result['where']['processor']} ({result['where']['note']})")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _demo(args) -> int:
    from . import demo

    print("Two training jobs, out of phase, on two streams of a simulated GPU "
          "(launch 5 us, kernels 120 us).")
    print("Each job: 96 MiB weights, 24 layers of 24-64 MiB activations, a backward pass "
          "that frees them.\n")
    results = demo.run(args.out, iterations=args.iterations, plot=not args.no_plot)
    print(demo.format_table(results))
    if "plot" in results:
        print(f"\nmemory over time: {results['plot']}")
    print(f"numbers: {args.out}/demo.json  (all figures are simulated, not measured on a GPU)")
    bad = [p for p in demo.POLICIES if results[p]["hazards"]]
    if bad:
        print(f"HAZARDS detected under: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="waterwave", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="micro-benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    alloc = bench_sub.add_parser("alloc", help="ns per alloc+free pair, both policies and glibc")
    alloc.add_argument("--json", action="store_true", help="print JSON")
    alloc.add_argument("--pairs", type=int, default=200_000, help="pairs per case and repetition")
    alloc.add_argument("--repeats", type=int, default=5, help="repetitions; the median is reported")
    alloc.add_argument("--seed", type=int, default=1)
    alloc.add_argument("--out", help="also write the JSON here")
    alloc.set_defaults(func=_bench_alloc)

    demo = sub.add_parser("demo", help="two out-of-phase jobs on a simulated GPU, both policies")
    demo.add_argument("--out", default="out", help="folder for demo_memory.png and demo.json")
    demo.add_argument("--iterations", type=int, default=3)
    demo.add_argument("--no-plot", action="store_true")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    if getattr(args, "pairs", 1) <= 0 or getattr(args, "repeats", 1) <= 0:
        parser.error("--pairs and --repeats must be positive")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
