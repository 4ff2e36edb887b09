"""`make gpu-check`: every GPU test and every GPU benchmark, in one command,
for the session that is lent a GPU.

    python bench/gpu_check.py [--out bench/results] [--budget-min 25]

Runs, in this order, each as a child process with its time measured:

1. the GPU tests of sharing (``pytest -m gpu -k sharing``: trials sharing a
   capped GPU, each against its eager loop);
2. the measured Optuna searches (trials per hour, what the project is
   for): these two first, so that one 10-minute call measures them;
3. the other GPU tests (``-k 'not sharing'``: the allocator, torch's memory
   functions under it, cuDNN, CUDA graphs, ``torch.compile``, CuPy, the
   concurrent trainer);
4. the other GPU benchmarks (``make bench-gpu`` runs every benchmark
   alone): how far rounding moves float16 Adam, eagerly and through
   ``job.train``, a recorded step through each policy, allocator cost
   inside PyTorch, training under each allocator, concurrent jobs under 12
   GiB, the ConcurrentTrainer's largest batch.

The GPU machines reach no package index, and their Python lacks Optuna, so
the tests of a study on the GPU would skip. ``make gpu-wheels`` (here, with
an index) downloads Optuna and its dependencies as wheels for the GPU
machine's Python into build/gpu-wheels; carried there (the device tool's
``carry``), this script installs those the machine lacks into build/gpu-site
before the first part and puts that on every part's PYTHONPATH (the image
holds scikit-learn, PyYAML, tqdm and the like already, which stay as they
are). A module still missing is named in the report.

Each benchmark writes its own figures under ``--out`` naming the device; this
script adds ``gpu_check.json`` and ``gpu_check.md``: the device, torch, the
date, each part's exit status and time, rewritten after every part (so a
run stopped from outside still leaves what it measured), the GPU tests'
output in ``gpu_tests_sharing.log`` and ``gpu_tests.log``, each ending with
every test's time, and each benchmark's in ``gpu_part_<name>.log``
(what a benchmark stopped by the budget printed before it wrote its
files). ``--only WORD ...`` runs the parts whose names hold one of the
words (``--only concurrent``: what a previous check's budget left out);
``--tests EXPR`` narrows the GPU tests to those pytest's ``-k EXPR``
selects. A part still running when the budget (9 minutes by default) is
spent is stopped and reported as such, so the whole ends within the
budget. Without a CUDA GPU it says so and exits 2 before running anything:
a GPU check that skips everything proves nothing.

May import: the standard library; torch (to name the device).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


SHARING_TESTS = "GPU tests of sharing (pytest -m gpu -k sharing)"
# Named without "sharing", so that --only sharing chooses the sharing tests alone.
OTHER_TESTS = "the other GPU tests (pytest -m gpu, the rest)"
TEST_LOGS = {SHARING_TESTS: "gpu_tests_sharing.log", OTHER_TESTS: "gpu_tests.log"}
# pytest's exit 5: --tests left a test part nothing to run (not a failure).
NO_TESTS = "no test selected"


def pytest_part(py: str, select: str, tests: str | None) -> list[str]:
    """``pytest -m gpu`` over the GPU tests ``-k select`` chooses, narrowed
    by ``tests`` (a ``-k`` expression) where given; each test's time at the
    end of its log."""
    expr = f"({select}) and ({tests})" if tests else select
    return [py, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
            "--durations=0", "-k", expr]


def parts(out: Path, tests: str | None = None) -> list[tuple[str, list[str]]]:
    """Every part, in order; ``tests``: a pytest ``-k`` expression choosing
    among the GPU tests (None: all of them). What the project is for comes
    first: the sharing tests (trials sharing a capped GPU), then trials per
    hour, so that one 10-minute call measures them (the whole GPU suite ran
    past 7 minutes on an H200); the other GPU tests after."""
    py = sys.executable
    return [
        (SHARING_TESTS, pytest_part(py, "sharing", tests)),
        ("an Optuna search of small trials, five ways",
         [py, "bench/concurrent/search_measured.py", "--family", "small", "--out", str(out)]),
        ("an Optuna search of memory-bound trials, six ways",
         [py, "bench/concurrent/search_measured.py", "--family", "memory-bound",
          "--out", str(out)]),
        (OTHER_TESTS, pytest_part(py, "not sharing", tests)),
        ("rounding spread of float16 Adam",
         [py, "bench/rounding_spread.py", "--device", "cuda",
          "--out", str(out / "rounding_spread_cuda.json")]),
        ("a recorded step through each policy on the GPU's driver",
         [py, "-m", "waterwave", "bench", "step", "bench/data/gpu-snapshots/r18_solo.pickle.gz",
          "--device", "cuda", "--recorded-steps", "4", "--steps", "200",
          "--out", str(out / "step_bench_cuda.json")]),
        ("allocator cost inside PyTorch",
         [py, "-m", "waterwave", "bench", "alloc", "--gpu", "--out", str(out / "alloc_gpu.json")]),
        ("allocator cost report",
         [py, "bench/alloc_report.py", str(out / "alloc_gpu.json"), str(out / "alloc_gpu.md")]),
        # 40 steps a run: each run's median stands on 39 steps, not 5.
        ("resnet18's step under each allocator, 5 runs each, taking turns",
         [py, "bench/gpu.py", "--models", "resnet18", "--repeats", "5", "--steps", "40",
          "--out", str(out / "gpu.json")]),
        ("training report", [py, "bench/gpu.py", "--report", str(out / "gpu.json")]),
        ("concurrent jobs under 12 GiB", [py, "bench/concurrent/gpu.py", "--out", str(out)]),
        ("ConcurrentTrainer's largest batch",
         [py, "bench/concurrent/trainer_gpu.py", "--out", str(out)]),
    ]


# What the GPU parts import beyond torch: the module, and what provides it.
EXTRAS = {"optuna": "make gpu-wheels here, then carry build/gpu-wheels",
          "pynvml": "make gpu-wheels here, then carry build/gpu-wheels (the searches' GPU busy "
                    "share reads NVML through it)"}


def missing(modules) -> list[str]:
    """The modules this interpreter cannot import, without importing them."""
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def not_installed(wheels) -> list[Path]:
    """The wheels whose distribution this interpreter does not have: the
    others stay out, so that nothing shadows what the machine holds (its
    torch imports its own typing_extensions, say)."""
    import importlib.metadata

    out = []
    for wheel in wheels:
        name = wheel.name.split("-")[0]
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(wheel)
    return out


def install_extras(wheels: Path, site: Path) -> list[str]:
    """Install the wheels in ``wheels`` that this interpreter lacks into
    ``site`` (no index, no dependency resolution: the directory holds them
    all) when an extra is missing; what is then still missing, each with its
    fix."""
    gone = missing(EXTRAS)
    needed = not_installed(sorted(wheels.glob("*.whl"))) if gone else []
    if needed:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", str(site), *map(str, needed)], check=False)
        sys.path.insert(0, str(site))
        import importlib

        importlib.invalidate_caches()
        gone = missing(EXTRAS)
    return [f"{m} (not importable: {EXTRAS[m]})" for m in gone]


def child_env(site: Path) -> dict:
    """The parts' environment: ``site`` (when it exists) and the repository
    on PYTHONPATH, so that a benchmark run as a script finds ``waterwave``
    where it was built in place (the GPU machines' Python has it nowhere
    else; a script's own directory is bench/..., not the root)."""
    env = dict(os.environ)
    paths = [str(site)] if site.is_dir() else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, str(ROOT), env.get("PYTHONPATH")]))
    return env


def slug(name: str) -> str:
    """A part's name as a file name: "concurrent jobs under 12 GiB" ->
    "concurrent_jobs_under_12_gib"."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def chosen(all_parts: list, benchmarks_only: bool, only: list[str] | None) -> list:
    """The parts to run: all, or the benchmarks (``--benchmarks-only``), or
    those whose names hold one of ``only``'s words. A word no part's name
    holds is a ValueError naming the parts."""
    todo = [(name, c) for name, c in all_parts
            if not (benchmarks_only and c[1:3] == ["-m", "pytest"])]
    if not only:
        return todo
    words = [w.lower() for w in only]
    unknown = [w for w in words if not any(w in name.lower() for name, _ in todo)]
    if unknown:
        names = "; ".join(name for name, _ in todo)
        raise ValueError(f"--only {' '.join(unknown)}: no part's name holds that; the parts: "
                         f"{names}")
    return [(name, c) for name, c in todo if any(w in name.lower() for w in words)]


def device_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--benchmarks-only", action="store_true",
                    help="the benchmarks without the GPU tests (make bench-gpu)")
    ap.add_argument("--budget-min", type=float, default=9.0,
                    help="stop whatever still runs after this many minutes (default 9: one "
                         "10-minute call of the device tool, the build before it)")
    ap.add_argument("--only", nargs="+", metavar="WORD",
                    help="only the parts whose names hold one of these words (case ignored)")
    ap.add_argument("--tests", metavar="EXPR",
                    help="only the GPU tests pytest -k EXPR selects (make gpu-check GPU_TESTS=)")
    ap.add_argument("--pack", metavar="FILE",
                    help="also write everything under --out into this .tgz after each part "
                         "(the device tool brings back 8 files of $OUT at most: "
                         "make gpu-check RESULTS=/tmp/gpu GPU_PACK=$OUT/gpu_check.tgz)")
    ap.add_argument("--wheels", default=str(ROOT / "build" / "gpu-wheels"),
                    help="wheels of the extras to install first when missing "
                         "(make gpu-wheels; default build/gpu-wheels)")
    args = ap.parse_args(argv)
    try:
        todo = chosen(parts(Path(args.out), args.tests), args.benchmarks_only, args.only)
    except ValueError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    device = device_name()
    if device is None:
        print("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): run it on the "
              "machine the device tool lends", file=sys.stderr)
        return 2
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_min * 60
    site = ROOT / "build" / "gpu-site"
    report = {"device": device, "torch": torch.__version__,
              "date": dt.date.today().isoformat(), "budget_min": args.budget_min,
              "missing": install_extras(Path(args.wheels), site), "parts": []}
    for name, command in todo:
        left = deadline - time.monotonic()
        if left <= 0:
            report["parts"].append({"part": name, "status": "not run: budget spent", "seconds": 0})
            continue
        print(f"gpu-check: {name}: {' '.join(command[1:])}", flush=True)
        start = time.monotonic()
        log_path = out / TEST_LOGS.get(name, f"gpu_part_{slug(name)}.log")
        log = open(log_path, "w")
        try:
            rc = subprocess.run(command, cwd=ROOT, timeout=left, stdout=log, env=child_env(site),
                                stderr=subprocess.STDOUT).returncode
            status = ("passed" if rc == 0 else NO_TESTS if rc == 5 and name in TEST_LOGS
                      else f"failed (exit {rc})")
        except subprocess.TimeoutExpired:
            status = "stopped: budget spent"
        finally:
            log.close()
            print(log_path.read_text(errors="replace")[-4000:], flush=True)
        report["parts"].append({"part": name, "status": status,
                                "seconds": round(time.monotonic() - start, 1)})
        write_report(report, out, args.pack)
    write_report(report, out, args.pack)
    return 0 if all(p["status"] in ("passed", NO_TESTS) for p in report["parts"]) else 1


def write_report(report: dict, out: Path, pack: str | None = None) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# gpu-check on one {report['device']}", "",
             f"Measured by `make gpu-check` on {report['date']}, torch {report['torch']}, within "
             f"a budget of {report['budget_min']:g} minutes. Each benchmark's figures are in its "
             "own file beside this one; the GPU tests' output is in gpu_tests_sharing.log and "
             "gpu_tests.log.", "",
             *([f"Missing here, so their tests skipped: {', '.join(report['missing'])}.", ""]
               if report.get("missing") else []),
             "| part | status | seconds |", "|---|---|---:|"]
    lines += [f"| {p['part']} | {p['status']} | {p['seconds']} |" for p in report["parts"]]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(report["parts"]) - 2:]), flush=True)
    if pack:  # all of it as one file, rewritten with the report (a stopped run keeps it)
        import tarfile

        skip = {Path(pack).resolve(), Path(f"{pack}.part").resolve()}  # a pack inside --out
        with tarfile.open(f"{pack}.part", "w:gz") as tar:
            tar.add(out, arcname=out.name, filter=lambda info: None if (
                out.parent / info.name).resolve() in skip else info)
        os.replace(f"{pack}.part", pack)


if __name__ == "__main__":
    sys.exit(main())
