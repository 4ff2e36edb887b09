"""Measure on a GPU what bench/concurrent/run.py simulates, and write it where
run.py reads it (bench/results/concurrent_gpu.json, the schema of
bench/data/gpu-snapshots/h100_measured.json), so the next run.py puts the
new measurements beside the simulated figures.

    python bench/concurrent/gpu.py [--cap-gib 12] [--out bench/results]

Each trial runs in its own process (PyTorch swaps its allocator once per
process) through bench/data/gpu-snapshots/probe.py, the probe that measured
the shared H100 figures: peaks of the snapshots' workloads under native
PyTorch and under Waterwave's two policies, and the largest resnet50 batch
per job under the cap, alone, lockstep and phased. Needs a CUDA GPU and a
CUDA build of torch; without them it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "bench" / "data" / "gpu-snapshots" / "probe.py"
WORKLOADS = [  # as in h100_measured.json
    ("resnet18 x1, batch 32", ["resnet18"], 32, "lockstep"),
    ("resnet18 x2, batch 32", ["resnet18", "resnet18"], 32, "lockstep"),
    ("resnet50 x1, batch 64", ["resnet50"], 64, "lockstep"),
    ("resnet50 x2, batch 64, phased", ["resnet50", "resnet50"], 64, "phased"),
]
MODES = {"pytorch": "native", "waterwave": "waterwave"}  # run.py's policy -> probe's mode


def probe(*args: str, phased: bool = False, timeout: int = 1800) -> list[dict]:
    env = dict(os.environ, WW_SRC=str(ROOT), PHASED="1" if phased else "0")
    r = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"probe {' '.join(args)} printed no result: {r.stderr[-600:]}")
    return rows


def have_gpu() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-gib", type=float, default=12.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    why = have_gpu()
    if why:
        print(f"bench/concurrent/gpu.py measures on a GPU: {why}. Run it where a CUDA GPU and a "
              "CUDA build of torch are; bench/concurrent/run.py simulates without one.",
              file=sys.stderr)
        return 2
    import torch

    name = torch.cuda.get_device_name(0)
    whole = str(torch.cuda.get_device_properties(0).total_memory / 2**30)  # no cap
    out = {"source": f"bench/concurrent/gpu.py on one {name}, torch {torch.__version__}, "
                     f"{time.strftime('%Y-%m-%d')}", "peaks_mib": [], "max_batch_12gib": {}}
    for workload, models, batch, schedule in WORKLOADS:
        row = {"workload": workload, "models": models, "batch": batch, "schedule": schedule}
        for policy, mode in MODES.items():
            r = probe("run", mode, ",".join(dict.fromkeys(models)), str(batch), str(len(models)),
                      whole, "4", phased=schedule == "phased")[-1]
            row[policy] = {"reserved": r["peak_reserved_mib"], "allocated": r["peak_allocated_mib"]}
            print(json.dumps({workload: row[policy], "policy": policy}), flush=True)
        out["peaks_mib"].append(row)
    spec = {"model": "resnet50", "cap_gib": args.cap_gib, "step": 8}
    for label, njobs, phased in (("sole", 1, False), ("lockstep", 2, False), ("phased", 2, True)):
        spec[label] = {}
        for policy, mode in MODES.items():
            r = probe("maxbatch", "resnet50", str(njobs), str(args.cap_gib), "--modes", mode,
                      phased=phased, timeout=7200)[-1]
            spec[label][policy] = r["max_batch"]
            print(json.dumps({label: spec[label]}), flush=True)
    out["max_batch_12gib"] = spec
    path = Path(args.out) / "concurrent_gpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"measured on {name}: {path}; now run bench/concurrent/run.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
