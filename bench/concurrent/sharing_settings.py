"""Sharing members' settings near the cap, simulated: does another margin or
allocator setting for the members train convolutional nets wherever a GPU
session's settings do, and wherever one job after another fits?

    python bench/concurrent/sharing_settings.py [--steps 4] [--case resnet18:2:72 ...]
                                                [--out bench/results]

Two jobs of one model (resnet18 under 2 and 3 GiB, resnet50 under 4 and 6
GiB, the batches up to where one after another runs out) on a simulated
H100, as sharing members under each of:

* ``session``: a GPU session's settings (a 5% margin; blocks of 20 MiB or
  more kept whole, ``alloc/cache_splits.py``);
* ``margin 4%``: the same with 4% of the budget left to fragmentation;
* ``21 MiB, own segments, 4%``: blocks above 20 MiB kept whole, so that a
  20 MiB segment whose blocks were all freed serves the next pass's
  activations again, each stream kept to its own large segments
  (``own_segments_first``), and a 4% margin: the settings under which the
  MLP mixes of ``sharing_vs_plain.py`` (``--margin 0.04 --sharing-config
  max_split_size_mb:21,own_segments_first:True``) all came within 3% of the
  best plain schedule.

Reported per case: one after another's samples per second (or out of
memory) and each setting's; and per setting, the cases where one after
another fits and it runs out. Every figure is simulated. Writes
sharing_settings.json and sharing_settings.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharing_vs_plain import GPU, Members, write_results  # noqa: E402

GiB = 1 << 30
SETTINGS = {
    "session": Members(),
    "margin 4%": Members(0.04),
    "21 MiB, own segments, 4%": Members(0.04, "max_split_size_mb:21,own_segments_first:True"),
}
# (model, cap in GiB, batch per job): two jobs each.
CASES = ([("resnet18", 2, b) for b in (48, 56, 64, 72, 80)]
         + [("resnet18", 3, b) for b in (96, 104, 112, 120)]
         + [("resnet50", 4, b) for b in (24, 32, 40, 48)]
         + [("resnet50", 6, b) for b in (48, 56, 64)])


def parse_case(text: str) -> tuple[str, float, int]:
    """``MODEL:GIB:BATCH``, as ``--case`` takes it."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"--case {text!r}: give MODEL:GIB:BATCH, such as resnet18:2:72")
    model, gib, batch = parts
    try:
        gib_value, batch_value = float(gib), int(batch)
    except ValueError:
        raise ValueError(f"--case {text!r}: GIB is a number and BATCH a whole number") from None
    if not 0 < gib_value <= 79 or batch_value < 1:
        raise ValueError(f"--case {text!r}: a cap above 0 and within the H100's 79 GiB, a batch "
                         "of at least 1")
    return model, gib_value, batch_value


def measure(cases, steps: int = 4) -> list[dict]:
    from waterwave.sim.kernels import KernelModel
    from waterwave.sim.maxbatch import simulate_models
    from waterwave.tools import models

    kernels = KernelModel.load()
    rows = []
    for model, gib, batch in cases:
        jm = models.job_model(model)
        cap = int(gib * GiB)

        def rate(schedule, **kw):
            r = simulate_models([jm, jm], batch, GPU, schedule, cap, kernels, steps,
                                record=False, **kw)[0]
            return r.throughput if r.ok else None

        row = {"model": model, "cap_gib": gib, "batch": batch,
               "one_after_another": rate("sequential"), "sharing": {}}
        for name, members in SETTINGS.items():
            config = {"config": members.config} if members.config else {}
            row["sharing"][name] = rate("sharing", sharing_margin=members.margin, **config)
        rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], steps: int) -> str:
    def cell(v):
        return "out of memory" if v is None else f"{v:,.0f}"

    lines = ["# Sharing members' settings near the cap (simulated)", "",
             f"`python bench/concurrent/sharing_settings.py --steps {steps}`: two jobs of one "
             f"model on a simulated {GPU}, {steps} steps each, as sharing members under each "
             "setting, beside one after another under PyTorch's policy. Samples per second.", ""]
    for name in SETTINGS:
        lost = [r for r in rows if r["one_after_another"] is not None
                and r["sharing"][name] is None]
        fits = sum(r["sharing"][name] is not None for r in rows)
        lines.append(f"- {name}: trains {fits} of {len(rows)} cases; runs out of memory where "
                     f"one after another fits in {len(lost)}"
                     + (": " + ", ".join(f"{r['model']} at {r['batch']} under {r['cap_gib']:g} "
                                         "GiB" for r in lost) if lost else ""))
    lines += ["", "| model | cap GiB | batch | one after another | "
              + " | ".join(SETTINGS) + " |", "|---|---|---|---|" + "---|" * len(SETTINGS)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['cap_gib']:g} | {r['batch']} | "
                     f"{cell(r['one_after_another'])} | "
                     + " | ".join(cell(r["sharing"][n]) for n in SETTINGS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="steps each job trains")
    ap.add_argument("--case", action="append", default=[], metavar="MODEL:GIB:BATCH",
                    help="a case instead of the built-in ones (repeat for more)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: a job trains at least one step")
    try:
        cases = [parse_case(c) for c in args.case] or CASES
    except ValueError as e:
        ap.error(str(e))
    from waterwave.tools import models
    unknown = [m for m, _, _ in cases if not models.is_known(m)]
    if unknown:
        ap.error(f"--case: unknown model {unknown[0]!r}: choose one of "
                 f"{', '.join(models.names())}")
    rows = measure(cases, args.steps)
    write_results(Path(args.out), "sharing_settings", rows, report(rows, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
