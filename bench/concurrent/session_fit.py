"""A training session's choice against the plain schedules, simulated: how
often the session (as a trainer on a GPU makes it), and one that runs side
by side only where the peaks fit, train below 97% of the best plain
schedule that fits the same cap or run out of memory where one fits; and
the edge of a trainer's rule for side by side.

    python bench/concurrent/session_fit.py [--draws 140] [--seeds 11 12]
        [--edge-draws 300] [--edge-seeds 5 6 7] [--check-steps 64] [--out bench/results]

*Random caps*: mixes of 2-4 MLP training jobs (the shapes of
``tests/test_session_choice.py``) on a simulated H100, each under a cap
drawn between one that fits a job at a time and one with room for all side
by side. Every schedule runs under the session's allocator (the waterwave
policy, each stream keeping to its own large segments), first calls made
before; a way's rate is the samples of 8 more steps of every job over the
time they add (``waterwave.sim.rates``). The session probes every way
where side by side does not surely fit (``side_by_side_need``), side by
side too: a trainer on a GPU puts back a job whose step runs out there
(``exec/rollback.py``), and the table counts how often that happened.
Where it chose side by side from its probe (which a trainer then runs
guarded for ``session_choice.GUARDED_STEPS`` steps, as the simulated
session models), side by side is run ``--check-steps`` steps under the cap
to see whether it lasts past the guard. A plain schedule fits where it
lasts ``--check-steps`` steps too: side by side can last 12 and run out by
the 20th.
*Peaks only* (``SessionSchedule(probed=CPU_PROBES)``, a trainer before
2026-12-02) runs side by side only where the peaks measured alone fit and
otherwise probes turns, one after another and the pairing.

*The edge*: each mix capped at exactly what a trainer counts for side by
side (each job's bytes reserved alone, and a small-pool segment where the
jobs' small segments held less than one spare, ``pairing.shared_small_pool``),
and for comparison at the bytes reserved alone added up: does side by side
train 12 steps a job? Every figure is simulated. Writes session_fit.json
and session_fit.md.
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

from waterwave.pipeline.schedules import FREE  # noqa: E402
from waterwave.pipeline.session_choice import (CPU_PROBES, MeasuredAlone,  # noqa: E402
                                               side_by_side_need)
from waterwave.sim.eager import eager_trace  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.multijob import simulate  # noqa: E402
from waterwave.sim.rates import added_steps_rate  # noqa: E402
from waterwave.sim.schedules import ALLOCATORS, SessionSchedule, segment_spares  # noqa: E402

SHORT, LONG = 4, 12  # the runs whose difference in steps a rate is taken over
WITHIN = 0.97  # issue 41's 3%
WAYS = {"session": lambda cap: SessionSchedule(cap),
        "peaks only": lambda cap: SessionSchedule(cap, probed=CPU_PROBES)}


class Mixes:
    """The jobs' graphs and the simulator, shared by every draw."""

    def __init__(self):
        torch.manual_seed(0)
        self.graphs = [mlp_graph(*s) for s in SHAPES]
        self.kernels = KernelModel.load()
        self.policy, self.config = ALLOCATORS["session"]
        self.cut = SessionSchedule().partition

    def traces(self, picks, grouped: bool):
        return [eager_trace(self.graphs[k], GPU, self.kernels,
                            partition=self.cut(self.graphs[k]) if grouped else None)
                for k in picks]

    def run(self, schedule, picks, cap, concurrent: bool, steps: int):
        grouped = isinstance(schedule, SessionSchedule)
        return simulate(self.traces(picks, grouped), GPU, cap, schedule, self.policy, steps,
                        config=self.config, record=False, concurrent_kernels=concurrent,
                        warm=True)

    def rate(self, schedule, picks, cap, concurrent: bool):
        """Samples per second of the added steps, and the long run (None:
        out of memory)."""
        short, long = (self.run(schedule, picks, cap, concurrent, n) for n in (SHORT, LONG))
        return (added_steps_rate(short, long) if short.ok and long.ok else None), long


def random_caps(mixes: Mixes, draws: int, seeds: list[int], check_steps: int) -> dict:
    counts = {way: {"below": 0, "lowest": None, "oom": 0, "side_by_side_from_peaks": 0,
                    "side_by_side_probe_ran_out": 0, "side_by_side_probed": 0,
                    "side_by_side_from_probe": 0, "ran_out_by_check_steps": 0}
              for way in WAYS}
    fits_somewhere = plain_ran_out_later = 0
    for seed in seeds:
        rng = random.Random(seed)
        for _ in range(draws):
            picks = [rng.randrange(len(SHAPES)) for _ in range(rng.randint(2, 4))]
            room, concurrent = rng.random(), rng.random() < 0.5
            cap = cap_between(mixes.run("sequential", picks, None, concurrent, 6).peak_reserved,
                              mixes.run("lockstep", picks, None, concurrent, 6).peak_reserved,
                              room)
            plain = {s: mixes.rate(s, picks, cap, concurrent)[0] for s in PLAIN}
            for s, r in plain.items():  # a plain schedule fits where it lasts check_steps
                if r is not None and not mixes.run(s, picks, cap, concurrent, check_steps).ok:
                    plain[s] = None
                    plain_ran_out_later += 1
            fitted = [r for r in plain.values() if r is not None]
            if not fitted:
                continue
            fits_somewhere += 1
            row = {"jobs": picks, "cap_mib": round(cap / 2**20, 1), "plain": plain}
            for way, make in WAYS.items():
                rate, long = mixes.rate(make(cap), picks, cap, concurrent)
                c = counts[way]
                chose = long.session or {}
                why = chose.get("why", "")
                c["side_by_side_from_peaks"] += (chose.get("pairing") == FREE and
                                                 why.startswith("side by side"))
                # A trainer on a GPU puts back the jobs whose step ran out there.
                c["side_by_side_probed"] += f"{FREE} " in why
                c["side_by_side_probe_ran_out"] += f"{FREE} did not fit" in why
                if chose.get("pairing") == FREE and why.startswith("fastest"):
                    # Past the guard: does side by side last check_steps steps?
                    c["side_by_side_from_probe"] += 1
                    c["ran_out_by_check_steps"] += not mixes.run(
                        "lockstep", picks, cap, concurrent, check_steps).ok
                if rate is None:
                    c["oom"] += 1
                    row[way] = None
                    continue
                ratio = rate / max(fitted)
                row[way] = round(ratio, 3)
                if ratio < WITHIN:
                    c["below"] += 1
                    c["lowest"] = ratio if c["lowest"] is None else min(c["lowest"], ratio)
            print(json.dumps(row), flush=True)
    return {"draws": draws, "seeds": seeds, "a_plain_schedule_fits": fits_somewhere,
            "check_steps": check_steps, "plain_ran_out_later": plain_ran_out_later,
            "ways": counts}


def edge(mixes: Mixes, draws: int, seeds: list[int]) -> dict:
    counted = {"need": {"oom": 0}, "sum": {"oom": 0}, "segment_counted": 0, "mixes": 0}
    for seed in seeds:
        rng = random.Random(seed)
        for _ in range(draws):
            picks = [rng.randrange(len(SHAPES)) for _ in range(rng.randint(2, 4))]
            concurrent = rng.random() < 0.5
            traces = mixes.traces(picks, True)
            runs = [(t, simulate([t], GPU, None, "lockstep", mixes.policy, 3,
                                 config=mixes.config, record=False,
                                 concurrent_kernels=concurrent, warm=True)) for t in traces]
            spares = segment_spares(runs)
            alone = [MeasuredAlone(r.peak_reserved, 1.0, 1, spares[t.name]) for t, r in runs]
            caps = {"need": side_by_side_need(alone), "sum": sum(a.peak for a in alone)}
            counted["mixes"] += 1
            counted["segment_counted"] += caps["need"] > caps["sum"]
            for rule, cap in caps.items():
                ok = simulate(traces, GPU, cap, "lockstep", mixes.policy, LONG,
                              config=mixes.config, record=False, concurrent_kernels=concurrent,
                              warm=True).ok
                counted[rule]["oom"] += not ok
    return {"draws": draws, "seeds": seeds, **counted}


def report(result: dict) -> str:
    caps, at = result["random_caps"], result["edge"]
    seeds = " ".join(map(str, caps["seeds"]))
    edge_seeds = " ".join(map(str, at["seeds"]))
    lines = [f"# A session's choice against the plain schedules (simulated, {GPU})", "",
             f"`python bench/concurrent/session_fit.py --draws {caps['draws']} --seeds {seeds} "
             f"--edge-draws {at['draws']} --edge-seeds {edge_seeds} --check-steps "
             f"{caps['check_steps']}`. Every figure is simulated.",
             "", f"Random caps: {caps['a_plain_schedule_fits']} draws where a plain schedule "
             f"fits (lasts {caps['check_steps']} steps under the cap: "
             f"{caps['plain_ran_out_later']} plain schedules fitted 12 and not "
             f"{caps['check_steps']}); rates of the added steps over the best plain "
             "schedule's.", "",
             "| way | below 97% of the best (lowest) | out of memory where a plain schedule fits "
             "| ran side by side from its peaks alone | probed side by side "
             "| its probe ran out of memory | ran side by side from its probe "
             f"| of those, ran out within {caps['check_steps']} steps |",
             "|---|---|---|---|---|---|---|---|"]
    for way, c in caps["ways"].items():
        lowest = "" if c["lowest"] is None else f" ({c['lowest']:.3f})"
        lines.append(f"| {way} | {c['below']}{lowest} | {c['oom']} "
                     f"| {c['side_by_side_from_peaks']} | {c['side_by_side_probed']} "
                     f"| {c['side_by_side_probe_ran_out']} | {c['side_by_side_from_probe']} "
                     f"| {c['ran_out_by_check_steps']} |")
    lines += ["", f"The edge: {at['mixes']} mixes, side by side capped at exactly", "",
              "| cap | side by side ran out of memory |", "|---|---|",
              f"| what a trainer counts for it (a small-pool segment more in "
              f"{at['segment_counted']}) | {at['need']['oom']} |",
              f"| the bytes the jobs reserved alone, added up | {at['sum']['oom']} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=140, help="random-cap draws a seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[11, 12])
    ap.add_argument("--edge-draws", type=int, default=300, help="edge draws a seed")
    ap.add_argument("--edge-seeds", type=int, nargs="+", default=[5, 6, 7])
    ap.add_argument("--check-steps", type=int, default=64,
                    help="steps side by side chosen from its probe is run to see it last")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    if args.draws < 0 or args.edge_draws < 0:
        ap.error("--draws and --edge-draws must be 0 or more")
    if args.check_steps < 1:
        ap.error("--check-steps must be 1 or more")
    mixes = Mixes()
    result = {"gpu": GPU, "simulated": True,
              "random_caps": random_caps(mixes, args.draws, args.seeds, args.check_steps),
              "edge": edge(mixes, args.edge_draws, args.edge_seeds)}
    write_results(args.out, "session_fit", result, report(result))


if __name__ == "__main__":
    main()
