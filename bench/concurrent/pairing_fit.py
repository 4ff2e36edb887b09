"""The memory pairing's budget against the segments an allocator holds,
simulated: how often paired rounds, run on their own, ran out of memory
where a plain schedule (one after another, in turn, side by side) fits the
same cap, under three rules: paired rounds keeping back only their margin
of the budget (bytes counted), or that margin or a part-empty segment of
each pool a job, whichever is more (``pairing.SEGMENT_SLACK``); and the
jobs running free where their bytes fit with a 5% margin, or with each
job's segment spare as measured alone (``JobPlan.segment_spare``).

    python bench/concurrent/pairing_fit.py [--draws 300] [--seed 2] [--out bench/results]

Random mixes of 2-4 MLP training jobs (the shapes of
``tests/test_session_choice.py``) on a simulated H100, under caps from one
that fits a job at a time to one with room for all side by side; seven
draws in ten take the cap anywhere in that range, three near its low end
(0, 5% or 10% of the way), where segments weigh most. Every schedule runs
under the session's allocator (the waterwave policy, each stream keeping
to its own large segments), 12 steps a job, first calls made before. For
each rule: the draws where the pairing's plan keeps to its budget
(``MemoryPairing.fits``; a session probes the pairing only there), and
those of them and of the rest that ran out of memory; then the session as
a trainer on a GPU runs it (``SessionSchedule``): where
its probe of the pairing ran out of memory (on a GPU, a job lost), and
where its whole run did; under every rule it skips a plan that runs past
its budget (before 2026-12-02 a trainer probed those too). Every figure is
simulated. Writes pairing_fit.json and pairing_fit.md.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sharing_vs_plain import (GPU, PLAIN, SHAPES, cap_between, mlp_graph,  # noqa: E402
                              write_results)

from waterwave.sim.eager import eager_trace  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.multijob import simulate  # noqa: E402
from waterwave.sim.schedules import ALLOCATORS, SessionSchedule, segment_spares  # noqa: E402
from waterwave.pipeline.pairing import SEGMENT_SLACK  # noqa: E402
from waterwave.pipeline.schedules import MEMORY  # noqa: E402

STEPS = 12
# Each rule: what paired rounds keep back (a margin, or a part-empty segment
# pair a job where more), whether running free counts each job's segment
# spare as measured alone (else a margin of the bytes), and its description.
RULES = {"bytes": (0, False, "3%; 5% of the bytes"),
         "segments": (SEGMENT_SLACK, False, "3% or a segment pair a job; 5% of the bytes"),
         "spares": (SEGMENT_SLACK, True,
                    "3% or a segment pair a job; each job's segment spare measured alone")}


def measure(draws: int, seed: int) -> dict:
    torch.manual_seed(seed)
    graphs = [mlp_graph(*s) for s in SHAPES]
    kernels = KernelModel.load()
    policy, config = ALLOCATORS["session"]
    cut = SessionSchedule().partition
    rng = random.Random(seed)
    counts = {rule: {"fits": 0, "fits_oom": 0, "past_budget": 0, "past_budget_oom": 0,
                     "trainer_probe_oom": 0, "trainer_oom": 0} for rule in RULES}
    ran = 0
    for _ in range(draws):
        picks = [rng.randrange(len(SHAPES)) for _ in range(rng.randint(2, 4))]
        room = rng.random() if rng.random() < 0.7 else rng.choice([0.0, 0.05, 0.1])
        concurrent = rng.random() < 0.5

        def sim(traces, cap, schedule, steps=STEPS):
            return simulate(traces, GPU, cap, schedule, policy, steps, config=config,
                            record=False, concurrent_kernels=concurrent, warm=True)

        whole = [eager_trace(graphs[k], GPU, kernels) for k in picks]
        cap = cap_between(sim(whole, None, "sequential", 6).peak_reserved,
                          sim(whole, None, "lockstep", 6).peak_reserved, room)
        if not any(sim(whole, cap, s).ok for s in PLAIN):
            continue
        ran += 1
        grouped = [eager_trace(graphs[k], GPU, kernels, partition=cut(graphs[k]))
                   for k in picks]
        # Each job alone, as a session measures it.
        spares = segment_spares((t, sim([t], cap, "lockstep", 3)) for t in grouped)
        for rule, (slack, measured, _) in RULES.items():
            pairing = SessionSchedule(cap, segment_slack=slack).pairing(
                spares if measured else None)
            kept = pairing.planner(grouped, STEPS).fits
            ok = sim(grouped, cap, pairing).ok
            c = counts[rule]
            c["fits" if kept else "past_budget"] += 1
            if not ok:
                c["fits_oom" if kept else "past_budget_oom"] += 1
            trainer = SessionSchedule(cap, segment_slack=slack,
                                      segment_spares=measured)
            session = sim(grouped, cap, trainer)
            probed = session.session and f"{MEMORY} did not fit" in session.session["why"]
            c["trainer_probe_oom"] += bool(kept and probed)
            c["trainer_oom"] += not session.ok
        print(json.dumps({"jobs": picks, "cap_mib": round(cap / 2**20, 1),
                          "counts": counts}), flush=True)
    return {"draws": draws, "seed": seed, "a_plain_schedule_fits": ran, "steps": STEPS,
            "gpu": GPU, "simulated": True, "rules": counts}


def report(result: dict) -> str:
    lines = [f"# The memory pairing's budget against the allocator's segments (simulated, {GPU})",
             "", f"`python bench/concurrent/pairing_fit.py --draws {result['draws']} --seed "
             f"{result['seed']}`: {result['a_plain_schedule_fits']} draws where a plain schedule "
             f"fits, {result['steps']} steps a job. Every figure is simulated.", "",
             "| paired rounds keep back; running free counts | plan keeps to its budget "
             "| of those, out of memory "
             "| plan runs past it | of those, out of memory | a trainer's probe of it ran out "
             "| a trainer's session ran out |",
             "|---|---|---|---|---|---|---|"]
    for rule, c in result["rules"].items():
        lines.append(f"| {RULES[rule][2]} (`{rule}`) | {c['fits']} | {c['fits_oom']} "
                     f"| {c['past_budget']} | {c['past_budget_oom']} | {c['trainer_probe_oom']} "
                     f"| {c['trainer_oom']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    if args.draws < 1:
        ap.error(f"--draws must be at least 1, not {args.draws}")
    result = measure(args.draws, args.seed)
    write_results(args.out, "pairing_fit", result, report(result))


if __name__ == "__main__":
    main()
