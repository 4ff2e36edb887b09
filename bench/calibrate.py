"""Measure what library kernels do beside a captured graph (workspaces, and
the host time of first calls) from the H100 snapshots, and fit the rules for
models without a snapshot; writes waterwave/sim/data/h100_kernels.json.

    python bench/calibrate.py [--snapshots bench/data/gpu-snapshots]

Each snapshot is aligned with a capture of the same model at the same batch
(``waterwave.sim.kernels.measure``). Workspaces come from each snapshot's
first stream. First calls come from the streams where they ran in a warm
process, beside the other job: in r50_phased.pickle.gz, the forward of the
job that starts second (stream 0: its thread's first cuDNN calls) and the
backward of the job that starts first (stream 1: the autograd engine
thread's). r18_solo's first step also holds the process's one-time library
loading, so it gives workspaces only.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from waterwave.sim import trace as traces  # noqa: E402
from waterwave.sim.jobs import capture_step  # noqa: E402
from waterwave.sim.kernels import DATA, KernelModel, fit, measure  # noqa: E402
from waterwave.sim.phases import phases  # noqa: E402
from waterwave.tools import models  # noqa: E402

# snapshot -> (model, batch size, {phase: stream whose first step times it})
SNAPSHOTS = {
    "r18_solo.pickle.gz": ("resnet18", 32, {}),
    "r50_phased.pickle.gz": ("resnet50", 64, {"forward": 0, "backward": 1}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--snapshots", default=str(ROOT / "bench" / "data" / "gpu-snapshots"))
    args = ap.parse_args()
    kernels = KernelModel(source="measured on an H100 (torch 2.11, cuDNN benchmark off) from "
                                 + ", ".join(SNAPSHOTS))
    tables, first_calls = [], []
    for file, (name, batch, timing) in SNAPSHOTS.items():
        snap = traces.from_snapshot(str(Path(args.snapshots) / file))
        g = capture_step(name, batch, lambda b, name=name: models.build(name, b))
        nodes = measure(snap, g, 0)
        timed = {s: measure(snap, g, s) for s in set(timing.values())}
        phase = dict(zip((n.name for n in g.nodes), phases(g)))
        for entry_name, entry in nodes.items():
            stream = timing.get(phase[entry_name])
            entry["first_us"] = (timed[stream].get(entry_name, {}).get("first_us", 0.0)
                                 if stream is not None else 0.0)
        convs = sum(1 for n in g.nodes if n.op.startswith("aten.convolution"))
        measured = sum(1 for n in g.nodes if n.name in nodes and n.op.startswith("aten.conv"))
        print(f"{file}: {name} at batch {batch}: {len(nodes)} of {len(g.nodes)} operators aligned "
              f"({measured} of {convs} convolutions)" + (", with first calls" if timing else ""))
        kernels.tables[name] = {"batch": batch, "nodes": nodes}
        tables.append((g, nodes))
        if timing:
            first_calls.append((g, nodes))
    kernels.rules = fit(tables, first_calls)
    for kind, ratios in sorted(kernels.rules["workspaces"].items()):
        print(f"  workspaces of {kind}: {ratios} x (input + output bytes)")
    for op, (a, b) in sorted(kernels.rules["first_us"].items()):
        print(f"  first call of {op}: {a:.0f} us" + (f" + {b:.0f} us per MiB of weight" if b else ""))
    kernels.save(DATA)
    print(f"written: {DATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
