"""Sharing under a cap, simulated: do the allocator's cached pieces run a
gated search out of memory, and which allocator setting stops it?

    python bench/fragmentation/sharing_cap.py [--seeds 5] [--out bench/results]

What it models, from the measured H100 snapshot of resnet50 at batch 64
(``bench/data/gpu-snapshots/r50_phased.pickle.gz``, one job's stream): an
Optuna search of 8 trials, 4 at a time, on one simulated GPU capped at
12 GiB, as ``bench/concurrent/search_measured.py`` runs it on an H200.
Each trial, on a stream of its own, first puts its batches on the GPU
outside any sharing block (20 of 36.75 MiB, on the default stream, as
``tensor.to("cuda")`` does), then runs the snapshot's allocations and frees
(its model, 4 training steps); a finished trial frees everything and the
next starts in its place. The trials' operators interleave in a random
order (``--seeds`` orders). A gate stands for the sharing session's: a
training step (a pass: from where the trial's bytes rise above 1 GiB to
where they fall back) starts only when its peak, with what the other
trials hold or have been admitted for, stays within the budget: 95% of the
cap less what lies outside the accounts (``GPU_MARGIN``; the batches),
measured again at every pass as the session measures it. When no trial is
in a pass and none fits, the one holding most starts anyway (a forced
admission).
An allocation the allocator then refuses, after its own retry, is what
killed trials on the H200: counted under the budget, yet the device full.

Each allocator setting runs the same orders. Reported per setting: trials
lost, forced admissions, the reserved peak, and at each refusal what the
cache held unallocated. Every figure is simulated (no GPU): kernels are
not modelled, so a freed block is reusable at once on any stream, which
flatters no setting over another. Writes sharing_cap.json and
sharing_cap.md.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from waterwave import _C  # noqa: E402
from waterwave.alloc import Allocator  # noqa: E402
from waterwave.pipeline.pass_profile import GPU_MARGIN  # noqa: E402
from waterwave.sim.trace import from_snapshot  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SNAPSHOT = ROOT / "bench" / "data" / "gpu-snapshots" / "r50_phased.pickle.gz"
CAP = 12 * GiB
BATCH_BYTES = 64 * 3 * 224 * 224 * 4  # one batch of 224x224 images, float32
BATCHES = 20
OUTSIDE_STREAM = 0  # the default stream: where a trial's batches are made
# A setting ending in AT_FIRST_PASS is made when the first pass starts, after
# the first trials' batches are in, as a sharing session on a GPU makes it.
AT_FIRST_PASS = " at the first pass"
SETTINGS = [("waterwave", ""), ("waterwave", "max_split_size_mb:20"),
            ("waterwave", "max_split_size_mb:20" + AT_FIRST_PASS),
            ("waterwave", "expandable_segments:True"), ("waterwave", "own_segments_first:True"),
            ("waterwave", "max_split_size_mb:20,own_segments_first:True"), ("pytorch", ""),
            ("pytorch", "max_split_size_mb:20"),
            ("pytorch", "max_split_size_mb:20" + AT_FIRST_PASS),
            ("pytorch", "expandable_segments:True")]


PASS_ABOVE = 1 * GiB  # a trial's bytes above this: it is in a training step


def program(trace) -> tuple[list, dict[int, tuple[int, int]]]:
    """One trial: its stream's operators, as (allocations, frees); and its
    passes, {the operator that starts one: (the operator after its end, its
    peak bytes)}."""
    stream = trace.streams[0]
    ops = [(list(op.alloc), list(op.free)) for op in trace.ops if op.stream == stream]
    live, sizes, profile = 0, {}, []
    for allocs, frees in ops:
        for block, n in allocs:
            sizes[block] = n
            live += n
        for block in frees:
            live -= sizes.pop(block)
        profile.append(live)
    passes, start = {}, None
    for i, now in enumerate(profile):
        before = profile[i - 1] if i else 0
        if start is None and before < PASS_ABOVE <= now:
            start = i
        elif start is not None and now < PASS_ABOVE:
            passes[start] = (i + 1, max(profile[start:i + 1]))
            start = None
    return ops, passes


class Trial:
    def __init__(self, number: int, stream: int, ops, passes):
        self.number, self.stream, self.ops, self.passes = number, stream, ops, passes
        self.at = 0
        self.ptr: dict[int, tuple[int, int]] = {}  # trace block -> (address, bytes)
        self.outside: list[int] = []
        self.counted = 0
        self.pass_end: int | None = None  # in a pass: the operator after it
        self.admitted = 0  # in a pass: its peak, which the gate admitted

    def holds(self) -> int:
        """What the gate counts for this trial: its bytes, or its pass's peak."""
        return max(self.counted, self.admitted) if self.pass_end is not None else self.counted

    def needs_gate(self) -> bool:
        return self.pass_end is None and self.at in self.passes


def run(policy: str, config: str, program, seed: int, trials: int = 8, slots: int = 4) -> dict:
    ops, passes = program
    device = _C.SimDevice(CAP, 0.0)
    later = config.endswith(AT_FIRST_PASS)
    a = Allocator(policy, device, "" if later else config)
    rng = random.Random(seed)
    waiting = list(range(trials))
    running: list[Trial] = []
    outside = 0  # bytes outside every account: the running trials' batches
    lost, forced, refusals = 0, 0, []

    def start_next() -> None:
        nonlocal outside
        number = waiting.pop(0)
        t = Trial(number, 1 + number, ops, passes)
        for _ in range(BATCHES):
            t.outside.append(a.alloc(BATCH_BYTES, OUTSIDE_STREAM))
        outside += BATCHES * BATCH_BYTES
        running.append(t)

    def finish(t: Trial) -> None:
        nonlocal outside
        for ptr, _ in t.ptr.values():
            a.free(ptr)
        for ptr in t.outside:
            a.free(ptr)
        outside -= BATCHES * BATCH_BYTES
        running.remove(t)
        if waiting:
            start_next()

    while waiting and len(running) < slots:
        start_next()
    while running:
        budget = int(CAP * (1 - GPU_MARGIN)) - outside

        def fits(t: Trial) -> bool:
            others = sum(u.holds() for u in running if u is not t)
            return others + passes[t.at][1] <= budget

        ready = [t for t in running if not t.needs_gate() or fits(t)]
        if not ready:  # every trial waits at its gate: the one holding most goes on
            ready = [max(running, key=lambda t: t.counted)]
            forced += 1
        t = rng.choice(ready)
        if t.needs_gate():
            t.pass_end, t.admitted = passes[t.at]
            if later:
                mb = int(config.removesuffix(AT_FIRST_PASS).partition(":")[2])
                a.set_max_split_size(mb * MiB)
                later = False
        allocs, frees = t.ops[t.at]
        try:
            for block, n in allocs:
                t.ptr[block] = (a.alloc(n, t.stream), n)
                t.counted += n
        except _C.OutOfMemoryError:
            s = a.stats()
            refusals.append({
                "trial": t.number, "asked_mib": n / MiB,
                "counted_gib": sum(u.counted for u in running) / GiB,
                "budget_gib": budget / GiB,
                "reserved_gib": s["reserved_bytes.all.current"] / GiB,
                "cached_gib": (s["reserved_bytes.all.current"]
                               - s["allocated_bytes.all.current"]) / GiB})
            lost += 1
            finish(t)
            continue
        for block in frees:
            ptr, n = t.ptr.pop(block)
            a.free(ptr)
            t.counted -= n
        t.at += 1
        if t.at == t.pass_end:
            t.pass_end, t.admitted = None, 0
        if t.at == len(t.ops):
            finish(t)
    a.check_invariants()
    s = a.stats()
    return {"policy": policy, "config": config or "(default)", "seed": seed, "lost": lost,
            "forced": forced, "reserved_peak_gib": s["reserved_bytes.all.peak"] / GiB,
            "allocated_peak_gib": s["allocated_bytes.all.peak"] / GiB, "refusals": refusals,
            "page_moves": s.get("num_page_moves", 0),
            "device_calls": s["num_device_alloc"] + s["num_device_free"]}


def report(rows: list[dict], seeds: int) -> str:
    lines = [
        "# Sharing under a cap, simulated: cached pieces against a gated search",
        "",
        "Simulated (no GPU) by `python bench/fragmentation/sharing_cap.py`: 8 resnet50 trials "
        "(the H100 snapshot's allocations at batch 64), 4 at a time, each with 20 batches "
        "made outside the sharing blocks, gated within 95% of a 12 GiB cap less those "
        f"batches; {seeds} random interleavings per setting.",
        "",
        "| policy | setting | trials lost (of 8 each run) | forced admissions | reserved peak GiB "
        "| cached at refusals GiB | page moves (most in a run) | segments made and given back "
        "(most in a run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (policy, config) in SETTINGS:
        mine = [r for r in rows if r["policy"] == policy and r["config"] == (config or "(default)")]
        lost = [r["lost"] for r in mine]
        cached = [f["cached_gib"] for r in mine for f in r["refusals"]]
        cached_txt = (f"{min(cached):.2f}–{max(cached):.2f}" if cached else "-")
        lines.append(f"| {policy} | {config or '(default)'} | {sum(lost)} ({', '.join(map(str, lost))}) "
                     f"| {sum(r['forced'] for r in mine)} "
                     f"| {max(r['reserved_peak_gib'] for r in mine):.2f} | {cached_txt} "
                     f"| {max(r['page_moves'] for r in mine):,} "
                     f"| {max(r['device_calls'] for r in mine):,} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    trial = program(from_snapshot(str(SNAPSHOT)))
    rows = [run(p, c, trial, seed) for p, c in SETTINGS for seed in range(args.seeds)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharing_cap.json").write_text(json.dumps(rows, indent=1))
    text = report(rows, args.seeds)
    (out / "sharing_cap.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
