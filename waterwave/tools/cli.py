"""The ``waterwave`` command line: ``bench alloc``, ``bench step``, ``demo``, ``plan``, ``pack``,
``simulate``, ``replay``."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from .. import _C
from ..capturing import KERNELS, CaptureError, capture
from ..graph import Graph
from ..planner import STRATEGIES, check_plan, pack, plan
from ..planner.baseline import replay
from ..planner.buffer_csv import read_buffer_csv, write_buffer_csv
from . import demo, gpu_alloc_bench, models, sim_commands, step_bench
from .gpu_alloc_bench import PATHS
from .plots import plan_memory, png_path
from .sim_commands import parse_size
from .step_bench import cpu_name


def _seconds(text: str) -> float:
    """A time limit: a positive, finite number of seconds (argparse says so otherwise)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text} is not a seed from 0 to 2**64-1")
    return value


def _bench_alloc(args) -> int:
    allocators = args.allocators.split(",")
    if args.gpu:  # a wrong name is refused before anything runs

        gpu_alloc_bench.check_names(allocators)
    t0 = time.time()
    cases = _C.bench_alloc(args.pairs, args.seed, args.repeats)
    result = {
        "cases": cases,
        "pairs_per_case": args.pairs,
        "repeats": args.repeats,
        "where": {
            "machine": platform.machine(),
            "processor": cpu_name(),
            "python": platform.python_version(),
            "note": ("CPU-side cost of the allocator on the simulated device; "
                     "no GPU was involved"),
        },
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - t0, 2),
    }
    if args.gpu:
        result["gpu"] = gpu_alloc_bench.run_all(allocators, args.gpu_pairs, args.repeats, args.seed)
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
        if args.gpu:
            _print_gpu_alloc(result["gpu"])
    if args.gpu and not any("cases" in r and r["cases"] for r in result["gpu"]):
        first = result["gpu"][0]
        reason = first.get("failed") or next(iter(first["errors"].values()))
        print(f"waterwave bench alloc --gpu: no allocator could be measured inside PyTorch "
              f"({first['allocator']}: {reason}). Run it on a machine with a CUDA GPU",
              file=sys.stderr)
        return 2
    return 0


def _bench_step(args) -> int:
    result = step_bench.run(args.snapshot, args.device, args.steps, args.warmup,
                            args.recorded_steps, args.config or "")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if args.json else step_bench.format_table(result))
    return 0


def _print_gpu_alloc(runs: list[dict]) -> None:
    print("\ninside PyTorch, ns per alloc+free pair (median), each allocator in its own process:")
    print(f"{'allocator':<20} {'device':<24} {'case':<14} " + " ".join(f"{p:>11}" for p in PATHS))
    for r in runs:
        if "failed" in r:
            print(f"{r['allocator']:<20} failed: {r['failed']}")
            continue
        for case, paths in r["cases"].items():
            cells = " ".join(f"{paths[p]['ns_per_pair']:>11.0f}" if p in paths else f"{'-':>11}"
                             for p in PATHS)
            print(f"{r['allocator']:<20} {r['device'][:24]:<24} {case:<14} {cells}")
        for path, error in r["errors"].items():
            print(f"{r['allocator']:<20} {path} path not measured: {error}")


def _demo(args) -> int:
    limit = parse_size(args.memory_limit, "--memory-limit")
    print(f"Two {args.model} training jobs on one simulated {args.gpu}, capped at "
          f"{limit / 2**30:.1f} GiB: the largest batch per job as PyTorch runs them side by "
          "side, and as Waterwave's NodeGroup pipeline does.\n")
    results = demo.run(args.out, args.model, args.gpu, limit, args.steps, plot=not args.no_plot)
    print(demo.format_table(results))
    if "plot" in results:
        print(f"\nmemory over time per job: {results['plot']}")
    print(f"numbers: {args.out}/demo.json  (all figures are simulated, not measured on a GPU)")
    bad = [s for s, r in results["schedules"].items() if r["hazards"]]
    if bad:
        print(f"HAZARDS detected under: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _load_or_capture(model: str, batch_size: int, optimizer: str, kernels: str, progress):
    if model.endswith(".json"):
        return Graph.load(model)
    import torch

    net, inputs, loss = models.build(model, batch_size)
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    task = progress.add_task(f"capturing {model} (batch {batch_size}, {kernels} kernels) with fake "
                             "tensors", total=None)
    g = capture(net, inputs, loss, opt, name=f"{model}-bs{batch_size}", kernels=kernels)
    progress.remove_task(task)
    return g


def _plan(args) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True, disable=args.json) as progress:
        g = _load_or_capture(args.model, args.batch_size, args.optimizer, args.kernels, progress)
        if args.save_graph:
            g.save(args.save_graph)
        task = progress.add_task("replaying program order through the pytorch policy", total=None)
        base = replay(g)
        progress.remove_task(task)
        task = progress.add_task(f"planning ({args.strategy}, up to {args.time_limit:g} s)", total=None)
        p = plan(g, args.strategy, time_limit=args.time_limit, gap_limit=args.gap_limit)
        progress.remove_task(task)
    check_plan(g, p)
    if args.out:
        p.save(args.out)
    if args.plot:
        plan_memory(g, p, base.peak_reserved, args.plot)
    result = {
        "model": g.name, "nodes": len(g.nodes), "tensors": len(g.tensors),
        "kernels": g.meta.get("kernels", "cpu"),  # graphs saved before kernels= were the CPU's
        "strategy": p.strategy, "status": p.status,
        "baseline_peak_bytes": base.peak_reserved,
        "baseline_allocated_peak_bytes": base.peak_allocated,
        "baseline_fragmentation": base.fragmentation,
        "program_order_ideal_bytes": base.ideal_peak,
        "plan_peak_bytes": p.arena_size,
        "lower_bound_bytes": p.stats.get("proven_lower_bound") or p.lower_bound,
        "order_lower_bound_bytes": p.lower_bound,
        "plan_fragmentation": p.fragmentation,
        "saving": 1 - p.arena_size / base.peak_reserved if base.peak_reserved else 0.0,
        "solve_seconds": p.solve_seconds,
        "persistent_bytes": g.persistent_bytes(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    t = Table(title=f"{g.name}: {len(g.nodes)} operators, {len(g.tensors)} tensors, "
                    f"{result['kernels']} kernels")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("baseline peak (PyTorch policy, program order)", mib(base.peak_reserved))
    t.add_row("baseline fragmentation at peak", f"{base.fragmentation:.1%}")
    t.add_row(f"plan peak ({p.strategy}, {p.status})", mib(p.arena_size))
    t.add_row("saving", f"{result['saving']:.1%}")
    t.add_row("plan fragmentation (vs its order's bound)", f"{p.fragmentation:.1%}")
    t.add_row("lower bound", mib(result["lower_bound_bytes"]))
    t.add_row("solve time", f"{p.solve_seconds:.2f} s")
    Console().print(t)
    if args.out:
        print(f"plan written to {args.out}")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def _pack(args) -> int:
    try:
        table = read_buffer_csv(args.file)
    except OSError as e:
        print(f"waterwave pack: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"waterwave pack: {e}", file=sys.stderr)
        return 2
    try:
        packed = pack(table.buffers, time_limit=args.time_limit)
    except ValueError as e:
        print(f"waterwave pack: {e}", file=sys.stderr)
        return 2
    write_buffer_csv(sys.stdout, table, packed.offsets)
    print(f"arena {packed.arena_size} bytes, lower bound {packed.lower_bound}, {packed.status}",
          file=sys.stderr)
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
    alloc.add_argument("--seed", type=_seed, default=1, help="0 to 2**64-1")
    alloc.add_argument("--out", help="also write the JSON here")
    alloc.add_argument("--gpu", action="store_true",
                       help="also time torch.empty+free and PyTorch's raw alloc+free on a GPU under "
                            "each allocator, each in its own process")
    alloc.add_argument("--allocators", default="native,cudaMallocAsync,waterwave:pytorch,"
                       "waterwave:waterwave,pluggable:pytorch,pluggable:waterwave",
                       help="with --gpu: which, comma-separated (waterwave:POLICY natively "
                       "registered, pluggable:POLICY through torch's pluggable allocator)")
    alloc.add_argument("--gpu-pairs", type=int, default=20_000,
                       help="with --gpu: pairs per case and repetition")
    alloc.set_defaults(func=_bench_alloc)
    step = bench_sub.add_parser("step", help="a recorded training step replayed through each "
                                "policy: host time and device calls per step")
    step.add_argument("snapshot", help="a PyTorch memory snapshot (.pickle, .pickle.gz), e.g. "
                      "bench/data/gpu-snapshots/r18_solo.pickle.gz")
    step.add_argument("--device", choices=step_bench.DEVICES, default="auto",
                      help="auto: the GPU's driver where one loads, else the fake driver built "
                      "from tests/cpp/fake_cuda.c; sim: the simulated GPU")
    step.add_argument("--steps", type=int, default=50, help="measured replays per policy")
    step.add_argument("--warmup", type=int, default=3, help="replays before measuring")
    step.add_argument("--recorded-steps", type=int, default=1,
                      help="training steps the snapshot holds (figures are per training step)")
    step.add_argument("--config", help="the allocator config, PYTORCH_CUDA_ALLOC_CONF-style")
    step.add_argument("--json", action="store_true", help="print JSON")
    step.add_argument("--out", help="also write the JSON here")
    step.set_defaults(func=_bench_step)

    demo = sub.add_parser("demo", help="two training jobs on a simulated GPU: PyTorch side by "
                                       "side, and Waterwave's NodeGroup pipeline")
    demo.add_argument("--out", default="out", help="folder for demo_memory.png and demo.json")
    demo.add_argument("--model", default="resnet18")
    demo.add_argument("--gpu", default="H100-80GB", choices=list(sim_commands.GPUS))
    demo.add_argument("--memory-limit", default="3GiB")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--no-plot", action="store_true")
    demo.set_defaults(func=_demo)

    plan = sub.add_parser("plan", help="capture a model's training step and plan its memory")
    plan.add_argument("model", help="a torchvision model (any classifier by name), bert-base, gpt2, "
                      "xlm-roberta-base, hf:<model_type>[,key=value...] (any transformers "
                      "model by its config), module:callable (your own model), or a saved "
                      "graph .json")
    plan.add_argument("--batch-size", type=int, default=1)
    plan.add_argument("--strategy", default="model", choices=STRATEGIES)
    plan.add_argument("--time-limit", type=_seconds, default=10.0, help="solver time limit (s)")
    plan.add_argument("--gap-limit", type=float, default=1e-3,
                      help="model: skip CP-SAT once within this relative gap of the proven bound "
                           "(0 to insist on a proof of optimality)")
    plan.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                      help="optimizer in the captured step (SGD with momentum, or Adam)")
    plan.add_argument("--kernels", choices=KERNELS, default=KERNELS[0],
                      help="record the kernels a CUDA device runs (dropout, attention), or the CPU's")
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--save-graph", help="write the captured graph JSON here")
    plan.add_argument("--plot", help="draw memory over time to this PNG")
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")
    plan.set_defaults(func=_plan)

    pk = sub.add_parser("pack", help="offsets for buffers with fixed lifetimes (id,lower,upper,size CSV)")
    pk.add_argument("file")
    pk.add_argument("--time-limit", type=_seconds, default=10.0, help="time limit (s)")
    pk.set_defaults(func=_pack)

    sim_commands.add_parsers(sub)
    debug_help = "on an unexpected error (a bug of ours), show its traceback"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    for p in [*sub.choices.values(), *bench_sub.choices.values()]:
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)

    args = parser.parse_args(argv)
    if getattr(args, "plot", None):
        try:
            args.plot = png_path(args.plot)
        except ValueError as e:
            parser.error(str(e))
    if sys.stdout is None:  # started with its standard output closed: print() would drop it all
        print(f"waterwave {args.command}: standard output is closed; give the command somewhere "
              "to write (a file, a pipe or /dev/null)", file=sys.stderr)
        return BAD_INPUT
    if min(getattr(args, "pairs", 1), getattr(args, "repeats", 1), getattr(args, "gpu_pairs", 1)) <= 0:
        parser.error("--pairs, --gpu-pairs and --repeats must be positive")
    if getattr(args, "steps", 1) <= 0 or getattr(args, "batch_size", 1) <= 0:
        parser.error("--steps and --batch-size must be positive")
    if getattr(args, "warmup", 0) < 0:
        parser.error("--warmup must not be negative")
    return one_line_errors(args.func, args.command, args.debug)(args)


# Exit codes: 2 for input the user can fix (argparse's too), 3 for a bug of
# ours, 130 for Ctrl-C (as a shell reports SIGINT).
BAD_INPUT, BUG, INTERRUPTED = 2, 3, 130


def one_line_errors(fn, command: str, debug: bool = False):
    """Run a command, turning a bad name or file (a ValueError, which the
    trace, graph and plan errors are, or an OSError) or a step that cannot be
    captured (a CaptureError: the model's loss is not a scalar, its forward
    raises) into one line on stderr and exit code 2: never a traceback for
    what the user can fix. Anything else is a bug of ours: one line saying
    so, exit code 3, and the traceback only with ``--debug``."""

    def run(args) -> int:
        try:
            return fn(args)
        except (ValueError, OSError, CaptureError) as e:
            print(f"waterwave {command}: {' '.join(str(e).split())}", file=sys.stderr)
            return BAD_INPUT
        except KeyboardInterrupt:
            print(f"waterwave {command}: interrupted", file=sys.stderr)
            return INTERRUPTED
        except MemoryError:
            print(f"waterwave {command}: this machine ran out of memory; try a smaller input",
                  file=sys.stderr)
            return BAD_INPUT
        except Exception as e:
            if debug:
                raise
            print(f"waterwave {command}: internal error, a bug in waterwave ({type(e).__name__}: "
                  f"{' '.join(str(e).split())[:500]}); please report it with the traceback that "
                  f"`waterwave --debug {command} ...` prints", file=sys.stderr)
            return BUG

    return run


if __name__ == "__main__":
    sys.exit(main())
