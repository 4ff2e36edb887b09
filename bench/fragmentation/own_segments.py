"""Own memory first or not, simulated: the least cap under which each
allocator setting trains a mix of jobs, and how the captured session fares
under each.

    python bench/fragmentation/own_segments.py [--mixes 24] [--seed 0] [--out bench/results]

The mixes are ``bench/concurrent/sharing_vs_plain.py``'s: 2-4 MLP training
jobs (launch-bound digits-sized steps to steps that keep the GPU busy alone),
each on a stream of its own, kernels of different jobs side by side or not,
on a simulated H100. Part 1: for each mix and each plain schedule (in turn,
one after another, side by side), the least cap (to 2 MiB, by bisection)
under which the jobs train 6 steps each, under PyTorch's policy, the
waterwave policy as it comes, and the waterwave policy with
``own_segments_first`` (a stream takes other streams' free memory only once
the device is out, for large-pool requests). Part 2: the captured session
(``capture=True``: it probes side by side, in turn, one after another and
the memory pairing and keeps the fastest) under random caps, 30 steps a job,
with the policy as it comes and with the setting (as a trainer's run sets
it): runs out of memory where a plain schedule fits, and within 3% of the
best plain schedule. Every figure is simulated. Writes
own_segments.json and own_segments.md.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "concurrent"))

import torch  # noqa: E402

from sharing_vs_plain import GPU, PLAIN, SHAPES, WITHIN, cap_between, mlp_graph  # noqa: E402
from waterwave.sim.eager import eager_trace  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.multijob import simulate  # noqa: E402
from waterwave.pipeline.schedules import OWN_SEGMENTS, SIM_MAX_SPLIT  # noqa: E402
from waterwave.sim.schedules import ALLOCATORS, SessionSchedule  # noqa: E402

MiB = 1 << 20
# (name, policy, config) of part 1.
SETTINGS = [("pytorch", "pytorch", ""), ("waterwave", "waterwave", ""),
            ("own segments first", "waterwave", OWN_SEGMENTS)]
# The captured session's two ways in part 2: the policy as it comes (the
# setting chosen off), and as a trainer's run sets it.
SESSIONS = [("session, as it comes", f"{SIM_MAX_SPLIT},own_segments_first:False"),
            ("session, own segments first", f"{SIM_MAX_SPLIT},{OWN_SEGMENTS}")]
STEPS_LEAST_CAP, STEPS_SESSION = 6, 30


def least_cap(traces, schedule: str, concurrent: bool, policy: str, config: str) -> int:
    """The least cap, to 2 MiB, under which ``traces`` train by ``schedule``."""
    def fits(cap):
        return simulate(traces, GPU, cap, schedule, policy, STEPS_LEAST_CAP, config=config,
                        record=False, concurrent_kernels=concurrent).ok
    hi = simulate(traces, GPU, None, schedule, policy, STEPS_LEAST_CAP, config=config,
                  record=False, concurrent_kernels=concurrent).peak_reserved
    lo = hi // 2
    while hi - lo > 2 * MiB:
        mid = (lo + hi) // 2
        hi, lo = (mid, lo) if fits(mid) else (hi, mid)
    return hi


def mixes(count: int, seed: int) -> list[tuple[list[int], bool, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):  # drawn as sharing_vs_plain.py draws them: the same mixes
        picks = [rng.randrange(len(SHAPES)) for _ in range(rng.randint(2, 4))]
        room, concurrent = rng.random(), rng.random() < 0.5
        out.append((picks, concurrent, room))
    return out


def measure(count: int, seed: int) -> dict:
    torch.manual_seed(0)
    graphs = [mlp_graph(*s) for s in SHAPES]
    kernels = KernelModel.load()
    least, sessions = [], []
    session_policy, _ = ALLOCATORS["session"]
    for picks, concurrent, room in mixes(count, seed):
        plain = [eager_trace(graphs[k], GPU, kernels) for k in picks]
        names = [f"mlp{w}x{n}-bs{b}" for w, n, b in (SHAPES[k] for k in picks)]
        for schedule in PLAIN:
            row = {"jobs": names, "concurrent_kernels": concurrent, "schedule": schedule}
            for name, policy, config in SETTINGS:
                row[name] = least_cap(plain, schedule, concurrent, policy, config) / MiB
            least.append(row)
            print(json.dumps(row), flush=True)
        one = simulate(plain, GPU, None, "sequential", "pytorch", STEPS_LEAST_CAP,
                       record=False, concurrent_kernels=concurrent).peak_reserved
        side = simulate(plain, GPU, None, "lockstep", "pytorch", STEPS_LEAST_CAP,
                        record=False, concurrent_kernels=concurrent).peak_reserved
        cap = cap_between(one, side, room)
        fits = {}
        for s in PLAIN:
            r = simulate(plain, GPU, cap, s, "pytorch", STEPS_SESSION, record=False,
                         concurrent_kernels=concurrent)
            if r.ok:
                fits[s] = r.throughput
        cut = SessionSchedule().partition
        traces = [eager_trace(graphs[k], GPU, kernels, partition=cut(graphs[k])) for k in picks]
        row = {"jobs": names, "cap_mib": cap / MiB, "concurrent_kernels": concurrent,
               "best_plain": max(fits.values()) if fits else None}
        for name, config in SESSIONS:
            r = simulate(traces, GPU, cap, "session", session_policy, STEPS_SESSION,
                         config=config, record=False, concurrent_kernels=concurrent)
            row[name] = {"ok": r.ok, "throughput": r.throughput if r.ok else None,
                         "ran": (r.session or {}).get("pairing")}
        sessions.append(row)
        print(json.dumps(row), flush=True)
    return {"mixes": count, "seed": seed, "least_cap": least, "sessions": sessions}


def report(data: dict) -> str:
    least, sessions = data["least_cap"], data["sessions"]
    names = [n for n, _, _ in SETTINGS]
    lines = ["# Own memory first or not (simulated)", "",
             f"`python bench/fragmentation/own_segments.py --mixes {data['mixes']} "
             f"--seed {data['seed']}`: random mixes of MLP jobs on a simulated {GPU}, each job "
             "on a stream of its own. Every figure is simulated.", "",
             f"## The least cap each setting trains under ({STEPS_LEAST_CAP} steps a job)", "",
             "Over PyTorch's policy's least cap, per mix and plain schedule "
             f"({len(least)} cases):", "",
             "| setting | needs more than PyTorch's (over 2 MiB) | needs less (over 2 MiB) | "
             "most more | most less |", "|---|---|---|---|---|"]
    for name in names[1:]:
        diff = [r[name] - r["pytorch"] for r in least]
        more, less = [d for d in diff if d > 2], [d for d in diff if d < -2]
        lines.append(f"| {name} | {len(more)} | {len(less)} | "
                     f"{max(more, default=0):+.0f} MiB | {min(less, default=0):+.0f} MiB |")
    lines += ["", "| jobs | kernels side by side | schedule | " + " | ".join(names) + " |",
              "|---|---|---|" + "---|" * len(names)]
    for r in least:
        lines.append(f"| {', '.join(r['jobs'])} | {'yes' if r['concurrent_kernels'] else 'no'} | "
                     f"{r['schedule']} | " + " | ".join(f"{r[n]:.0f}" for n in names) + " |")
    judged = [r for r in sessions if r["best_plain"]]
    lines += ["", f"## The captured session under random caps ({STEPS_SESSION} steps a job)", "",
              f"{len(judged)} of {len(sessions)} mixes have a plain schedule (PyTorch's policy) "
              "that fits.", "",
              "| setting | out of memory where a plain schedule fits | within 3% of the best "
              "plain schedule, or faster |", "|---|---|---|"]
    for way, _ in SESSIONS:
        oom = sum(not r[way]["ok"] for r in judged)
        within = sum(r[way]["ok"] and r[way]["throughput"] >= WITHIN * r["best_plain"]
                     for r in judged)
        lines.append(f"| {way} | {oom} | {within} |")
    lines += ["", "| jobs | cap MiB | kernels side by side | " +
              " | ".join(way for way, _ in SESSIONS) + " |", "|---|---|---|---|---|"]
    for r in judged:
        def cell(s):
            return ("out of memory" if not s["ok"] else
                    f"{s['throughput'] / r['best_plain']:.3f} ({s['ran']})")
        lines.append(f"| {', '.join(r['jobs'])} | {r['cap_mib']:.0f} | "
                     f"{'yes' if r['concurrent_kernels'] else 'no'} | " +
                     " | ".join(cell(r[way]) for way, _ in SESSIONS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.mixes < 1:
        ap.error("--mixes must be at least 1")
    data = measure(args.mixes, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "own_segments.json").write_text(json.dumps(data, indent=1))
    (out / "own_segments.md").write_text(report(data))
    print(f"wrote {out / 'own_segments.md'} (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
