"""Sharing members (``job.train``'s default, ``ww.sharing``) against the plain
schedules that fit, simulated: issue 41's "never slower than the best
schedule that fits" asked of the default way.

    python bench/concurrent/sharing_vs_plain.py [--mixes 24] [--seed 0] [--steps 6]
                                                [--margin 0.05] [--sharing-config S]
                                                [--out bench/results]

Random mixes of 2-4 MLP training jobs (the shapes of
``tests/test_session_choice.py``: launch-bound digits-sized steps to steps
that keep the GPU busy alone) under random caps, from one that fits a job at
a time to one with room for all side by side, kernels of different jobs
side by side or not, on a simulated H100. Each mix runs one after another,
in turn and side by side under PyTorch's policy, the captured session's
choice (``capture=True``) and the jobs as sharing members under the
waterwave policy, whose large blocks the run keeps whole as a GPU session
does. Reported: sharing's samples per second over the best plain schedule
that fits (1.0 or more: never slower), out of memory where a plain schedule
fits, the same over the whole run (the quickest plain schedule's length over
sharing's), and the captured session's ratio beside it. The sharing jobs are
``job.train``'s: a step the device refuses before its update is undone and
runs again alone (counted as *undone*), where a loop in ``ww.sharing``
would fail. Each rate is taken
three ways: within the steady window (``SimResult.throughput``); over 8
steps of every job added to a run whose threads made their first calls
before (``waterwave.sim.rates``: what a search waits for, which the window,
counting whichever jobs' steps fall in it, does not say); and over 32 steps
added after those, where what a way's start leaves (jobs staggered by first
passes run alone) weighs less. Every figure is
simulated. Each way trains ``--steps`` steps a job; a sharing member's first
pass runs alone (it is measured), which weighs more the fewer the steps.
``--margin`` and ``--sharing-config`` run the members otherwise than a GPU
session does (another share of the budget left to fragmentation, other
allocator settings), to see what each costs or saves.
Writes sharing_vs_plain.json and sharing_vs_plain.md (with another
``--steps``: sharing_vs_plain_<steps>steps.*; other members' settings add
their own tail, such as _margin0.04).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import waterwave as ww  # noqa: E402
from waterwave import AllocatorConfig, ConfigError  # noqa: E402
from waterwave.pipeline.pass_profile import GPU_MARGIN  # noqa: E402
from waterwave.sim.eager import eager_trace  # noqa: E402
from waterwave.sim.kernels import KernelModel  # noqa: E402
from waterwave.sim.multijob import simulate  # noqa: E402
from waterwave.sim.rates import added_steps_rate  # noqa: E402
from waterwave.sim.schedules import ALLOCATORS, SessionSchedule  # noqa: E402

GPU = "H100-80GB"
MiB = 1 << 20
PLAIN = ("sequential", "turns", "lockstep")
# (width, hidden layers, batch): the property test's shapes.
SHAPES = [(64, 1, 64), (256, 3, 64), (2048, 2, 64), (1024, 3, 1024), (4096, 2, 256),
          (512, 1, 1024)]
WITHIN = 0.97  # the 3%
SHORT, LONG = 4, 12  # the warm runs whose difference in steps a rate is taken over
# A later, longer window (12 and 44 steps): what remains of a way's start
# (first passes run alone stagger the jobs, and their kernels meet
# otherwise for some steps) weighs less there.
LATER = 44


def mlp_graph(width: int, layers: int, batch: int):
    mods, features = [], 64
    for _ in range(layers):
        mods += [torch.nn.Linear(features, width), torch.nn.ReLU()]
        features = width
    model = torch.nn.Sequential(*mods, torch.nn.Linear(features, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ww.capture(model, (torch.randn(batch, 64),), loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=opt, targets=torch.randint(0, 10, (batch,)),
                      name=f"mlp{width}x{layers}-bs{batch}")


def cap_between(one_at_a_time: int, side_by_side: int, room: float) -> int:
    """A cap ``room`` (0 to 1) of the way from one that fits a job at a time
    (5% under one after another's reserved peak) to one with room for all
    side by side (10% over side by side's): the caps the mixes are measured
    under, here and in the property tests."""
    lo, hi = 0.95 * one_at_a_time, 1.1 * max(side_by_side, one_at_a_time)
    return int(lo + room * (hi - lo))


@dataclass(frozen=True)
class Members:
    """How the sharing members run: the share of the budget they leave to
    the allocator's fragmentation, and their allocator's settings ("": the
    session's, large blocks kept whole; any max_split_size_mb replaces that
    rule). The defaults are a GPU session's; others show what it trades."""
    margin: float = GPU_MARGIN
    config: str = ""

    def stem(self) -> str:
        """The results' file name's tail for settings other than a GPU session's."""
        tail = "" if self.margin == GPU_MARGIN else f"_margin{self.margin:g}"
        return tail + ("" if not self.config else
                       "_" + self.config.replace(":", "").replace(",", "_"))


def run(graphs, kernels, schedule: str, picks, cap, concurrent: bool, steps: int = 6,
        warm: bool = False, members: Members = Members()):
    policy, config = ALLOCATORS[schedule]
    margin = GPU_MARGIN
    if schedule == "sharing":
        config, margin = members.config or config, members.margin
    cut = SessionSchedule().partition if schedule == "session" else (lambda g: None)
    traces = [eager_trace(graphs[k], GPU, kernels, partition=cut(graphs[k])) for k in picks]
    return simulate(traces, GPU, cap, schedule, policy, steps, config=config, record=False,
                    concurrent_kernels=concurrent, warm=warm, sharing_margin=margin)


def added_rates(graphs, kernels, schedule: str, picks, cap, concurrent: bool,
                members: Members = Members()) -> tuple[float | None, float | None]:
    """Samples per second of LONG - SHORT more steps of every job, first
    calls made before, and of LATER - LONG more after those (None: out of
    memory)."""
    short, long, later = (run(graphs, kernels, schedule, picks, cap, concurrent, n, True,
                              members) for n in (SHORT, LONG, LATER))
    return added_steps_rate(short, long), added_steps_rate(long, later)


def measure(mixes: int, seed: int, steps: int = 6, members: Members = Members()) -> list[dict]:
    torch.manual_seed(seed)
    graphs = [mlp_graph(*s) for s in SHAPES]
    kernels = KernelModel.load()
    rng = random.Random(seed)
    rows = []
    for _ in range(mixes):
        picks = [rng.randrange(len(SHAPES)) for _ in range(rng.randint(2, 4))]
        room, concurrent = rng.random(), rng.random() < 0.5
        one = run(graphs, kernels, "sequential", picks, None, concurrent).peak_reserved
        side = run(graphs, kernels, "lockstep", picks, None, concurrent).peak_reserved
        cap = cap_between(one, side, room)
        fits, whole, firsts, added, added_later = {}, {}, {}, {}, {}
        for s in PLAIN:
            r = run(graphs, kernels, s, picks, cap, concurrent, steps)
            if r.ok:
                fits[s], whole[s], firsts[s] = r.throughput, r.elapsed_us, r.first_step_us
            a, later = added_rates(graphs, kernels, s, picks, cap, concurrent)
            if a is not None:
                added[s] = a
            if later is not None:
                added_later[s] = later
        row = {"jobs": [f"mlp{w}x{n}-bs{b}" for w, n, b in (SHAPES[k] for k in picks)],
               "cap_mib": cap / MiB, "concurrent_kernels": concurrent, "plain": fits,
               "plain_elapsed_us": whole, "plain_first_step_us": firsts, "plain_added": added,
               "plain_added_later": added_later}
        for way in ("sharing", "session"):
            r = run(graphs, kernels, way, picks, cap, concurrent, steps, members=members)
            a, later = added_rates(graphs, kernels, way, picks, cap, concurrent, members)
            row[way] = {"ok": r.ok, "throughput": r.throughput if r.ok else None,
                        "elapsed_us": r.elapsed_us if r.ok else None,
                        "first_step_us": r.first_step_us if r.ok else None,
                        "forced": (r.sharing or {}).get("forced"),
                        "put_back": (r.sharing or {}).get("put_back"),
                        "oom": r.oom["message"][:160] if r.oom else None,
                        "added": a, "added_later": later}
        if fits:
            best = max(fits, key=fits.get)
            row["best"] = best
            for way in ("sharing", "session"):
                t, e = row[way]["throughput"], row[way]["elapsed_us"]
                row[way]["of_best"] = t / fits[best] if t else 0.0
                # The whole run: the quickest plain schedule's length over this one's.
                row[way]["whole_of_best"] = min(whole.values()) / e if e else 0.0
                a = row[way]["added"]
                row[way]["added_of_best"] = (a or 0.0) / max(added.values()) if added else None
                a = row[way]["added_later"]
                row[way]["added_later_of_best"] = ((a or 0.0) / max(added_later.values())
                                                   if added_later else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict], seed: int, steps: int = 6, members: Members = Members()) -> str:
    judged = [r for r in rows if "best" in r]
    flags = ("" if members.margin == GPU_MARGIN else f" --margin {members.margin:g}") + (
        f" --sharing-config {members.config}" if members.config else "")
    lines = ["# Sharing members against the best plain schedule that fits (simulated)", "",
             f"`python bench/concurrent/sharing_vs_plain.py --mixes {len(rows)} --seed {seed} "
             f"--steps {steps}{flags}`: {len(rows)} random mixes of MLP jobs under random caps on a "
             f"simulated {GPU}, {steps} steps a job; {len(judged)} had a plain schedule that "
             "fits. Samples per second over the best of one after another, in turn and side "
             "by side (PyTorch's policy) that fits.", ""]
    for way, name in (("sharing", "sharing members (job.train's default)"),
                      ("session", "the captured session (capture=True)")):
        ratios = [r[way]["of_best"] for r in judged]
        wholes = [r[way]["whole_of_best"] for r in judged]
        added = [r[way]["added_of_best"] for r in judged if r[way]["added_of_best"] is not None]
        later = [r[way]["added_later_of_best"] for r in judged
                 if r[way]["added_later_of_best"] is not None]
        ooms = sum(not r[way]["ok"] for r in judged)
        within = sum(x >= WITHIN for x in ratios)
        lines.append(f"- {name}: {within} of {len(judged)} within 3% of the best or faster, "
                     f"{ooms} out of memory where a plain schedule fits; ratio min "
                     f"{min(ratios, default=0):.3f}, median "
                     f"{sorted(ratios)[len(ratios) // 2] if ratios else 0:.3f}; over the "
                     f"whole run, {sum(x >= WITHIN for x in wholes)} of {len(judged)} end "
                     "within 3% of the quickest plain schedule or sooner; over added steps, "
                     f"{sum(x >= WITHIN for x in added)} of {len(added)} within 3% or faster "
                     f"(lowest {min(added, default=0):.3f}); over the later added steps, "
                     f"{sum(x >= WITHIN for x in later)} of {len(later)} (lowest "
                     f"{min(later, default=0):.3f})")
    lines += ["", "Rates are of the steady steps: from the moment every job has ended its "
              "first step to the moment the first job ends its last. *Whole run*: the "
              "quickest plain schedule's length, to its last job's last step, over the way's "
              "(first steps, where each thread pays for its first calls, included). *Added "
              f"steps*: the samples of {LONG - SHORT} more steps of every job over the time "
              f"they add ({SHORT} and {LONG} steps, first calls made before), over the best "
              f"plain schedule's. *Later added steps*: the same of {LATER - LONG} more "
              f"steps after those ({LONG} and {LATER} steps), where less of a way's start "
              "remains. *Forced*: admissions the budget forced where every job "
              "waited at a gate; *undone*: steps the device refused before their update, "
              "undone and run again alone, as job.train's are (a loop in ww.sharing would "
              "fail there instead).", "",
              "| jobs | cap MiB | kernels side by side | best plain | sharing | sharing, whole "
              "run | sharing, added steps | sharing, later added steps | forced | undone | "
              "captured session | captured session, added steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in judged:
        ok = r["sharing"]["ok"]
        sharing = f"{r['sharing']['of_best']:.3f}" if ok else "out of memory"
        whole = f"{r['sharing']['whole_of_best']:.3f}" if ok else "-"
        session = (f"{r['session']['of_best']:.3f}" if r["session"]["ok"] else "out of memory")
        added = {w: "-" if r[w]["added_of_best"] is None else
                 f"{r[w]['added_of_best']:.3f}" if r[w]["added"] else "out of memory"
                 for w in ("sharing", "session")}
        later = ("-" if r["sharing"]["added_later_of_best"] is None else
                 f"{r['sharing']['added_later_of_best']:.3f}" if r["sharing"]["added_later"]
                 else "out of memory")
        lines.append(f"| {', '.join(r['jobs'])} | {r['cap_mib']:.0f} | "
                     f"{'yes' if r['concurrent_kernels'] else 'no'} | {r['best']} | {sharing} | "
                     f"{whole} | {added['sharing']} | {later} | {r['sharing']['forced']} | "
                     f"{r['sharing']['put_back']} | {session} | {added['session']} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, stem: str, result, text: str) -> None:
    """``result`` as ``stem``.json and ``text`` as ``stem``.md in ``out``
    (made if missing), the text printed: how this bench, pairing_fit.py
    and session_fit.py leave their figures."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / stem}.md and {stem}.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6, help="steps each job trains")
    ap.add_argument("--margin", type=float, default=GPU_MARGIN,
                    help="the share of the budget the sharing members leave to the allocator's "
                         f"fragmentation (default {GPU_MARGIN:g}, a GPU session's)")
    ap.add_argument("--sharing-config", default="",
                    help="the sharing members' allocator settings, such as "
                         "max_split_size_mb:1000000 (default: a GPU session's, blocks of 20 MiB "
                         "or more kept whole)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: a job trains at least one step")
    if not 0 <= args.margin < 1:
        ap.error(f"--margin {args.margin}: a share of the budget, from 0 up to (not including) 1")
    members = Members(args.margin, args.sharing_config)
    try:
        AllocatorConfig(members.config)
    except ConfigError as e:
        ap.error(f"--sharing-config: {e}")
    rows = measure(args.mixes, args.seed, args.steps, members)
    stem = ("sharing_vs_plain" + ("" if args.steps == 6 else f"_{args.steps}steps")
            + members.stem())
    write_results(Path(args.out), stem, rows, report(rows, args.seed, args.steps, members))
    return 0


if __name__ == "__main__":
    sys.exit(main())
