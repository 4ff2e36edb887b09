"""Coverage-guided fuzzing (atheris, over libFuzzer) of everything that reads
input from elsewhere, and of the allocator driven by random programs.

    python tests/fuzz/fuzz_inputs.py TARGET [libFuzzer options] [corpus dirs]

TARGET is one of ``config``, ``slots``, ``snapshot``, ``trace``, ``graph``,
``plan``, ``csv``, ``program``. Each turns the fuzzer's bytes into one input and feeds it where
users' input enters. What the input may do: be refused with the error its
reader documents (a ValueError or one of its subclasses, or out of memory
on the simulated GPU). What it must never do: raise anything else, crash
the process, hand out memory twice, or break the allocator's invariants
(checked after every step). ``tests/test_fuzz.py`` runs every target for
a few seconds in ``make test``; an input it finds that fails becomes a
regular test.

May import: waterwave, atheris, the standard library.
"""
from __future__ import annotations

import gzip
import json
import os
import pickle
import sys
import tempfile

import atheris

# Coverage is Waterwave's own code: instrumenting the standard library and
# the packages it imports too took 8 s of every run's start.
with atheris.instrument_imports(include=["waterwave"]):
    import waterwave as ww
    from waterwave.graph import Graph
    from waterwave.planner import Plan, check_plan, pack, plan, plan_slots
    from waterwave.planner.buffer_csv import read_buffer_csv
    from waterwave.sim import trace

MiB = 1 << 20
CAPACITY = 256 * MiB
WORK = tempfile.mkdtemp(prefix="waterwave-fuzz-")
REFUSED = (ValueError, ww.OutOfMemoryError)  # what a reader or the allocator may answer


def _as_file(data: bytes, name: str) -> str:
    path = os.path.join(WORK, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


class Live:
    """The blocks a program holds: a new one must not overlap any of them."""

    def __init__(self):
        self.blocks: dict[int, int] = {}

    def add(self, ptr: int, size: int) -> None:
        if size == 0:
            return
        for p, n in self.blocks.items():
            if ptr < p + n and p < ptr + size:
                raise AssertionError(f"{ptr:#x}+{size} handed out over the live block {p:#x}+{n}")
        self.blocks[ptr] = size


def _run_program(a: ww.Allocator, fdp: atheris.FuzzedDataProvider, steps: int) -> None:
    live = Live()
    for _ in range(steps):
        if fdp.remaining_bytes() == 0:
            break
        op = fdp.ConsumeIntInRange(0, 9)
        try:
            if op <= 5:
                size = fdp.ConsumeIntInRange(0, 1 << fdp.ConsumeIntInRange(0, 30))
                stream = fdp.ConsumeIntInRange(0, 3)
                live.add(a.alloc(size, stream), size)
            elif op <= 7 and live.blocks:
                ptr = list(live.blocks)[fdp.ConsumeIntInRange(0, len(live.blocks) - 1)]
                if fdp.ConsumeBool():
                    a.record_stream(ptr, fdp.ConsumeIntInRange(0, 3))
                a.free(ptr)
                del live.blocks[ptr]
            elif op == 8:
                a.sync_and_coalesce()
            else:
                a.empty_cache()
        except ww.OutOfMemoryError:
            pass
        a.check_invariants()
    for ptr in list(live.blocks):
        a.free(ptr)
    a.check_invariants()


def fuzz_config(data: bytes) -> None:
    """A settings string, then a program under those settings."""
    fdp = atheris.FuzzedDataProvider(data)
    text = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 200))
    policy = "pytorch" if fdp.ConsumeBool() else "waterwave"
    try:
        a = ww.Allocator(policy, ww.SimDevice(CAPACITY, 0.0), text)
    except ValueError:
        return
    _run_program(a, fdp, 30)


def fuzz_slots(data: bytes) -> None:
    """A plan of slots (any numbers, huge and unaligned ones included) on a
    stream beside a policy serving others: refused, or served without ever
    overlapping a live block."""
    fdp = atheris.FuzzedDataProvider(data)
    big = [0, 1, 511, 512, MiB, (1 << 63) - 1, (1 << 64) - 1, 1 << 64]
    slots = []
    for _ in range(fdp.ConsumeIntInRange(0, 8)):
        pick = lambda: (big[fdp.ConsumeIntInRange(0, len(big) - 1)] if fdp.ConsumeBool()  # noqa: E731
                        else fdp.ConsumeIntInRange(0, 8 * MiB))
        slots.append((pick(), pick()))
    arena = None if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 1 << 64)
    a = ww.Allocator("waterwave", ww.SimDevice(CAPACITY, 0.0))
    try:
        a.set_plan(0, slots, arena)
    except REFUSED:
        return
    live = Live()
    for _ in range(2 * len(slots) + 2):
        size = slots[fdp.ConsumeIntInRange(0, len(slots) - 1)][0] if slots and fdp.ConsumeBool() \
            else fdp.ConsumeIntInRange(0, 4 * MiB)
        try:
            live.add(a.alloc(size, fdp.ConsumeIntInRange(0, 1)), size)
        except REFUSED:
            pass
        a.check_invariants()


def fuzz_snapshot(data: bytes) -> None:
    """A snapshot file (pickle, or gzipped pickle), replayed when it reads."""
    fdp = atheris.FuzzedDataProvider(data)
    raw = fdp.ConsumeBytes(fdp.remaining_bytes())
    _replayed(trace.from_snapshot, _as_file(gzip.compress(raw) if raw[:1] == b"z" else raw,
                                            "snapshot"))


def _replayed(load, path) -> None:
    """What ``load`` reads from ``path``, replayed; what it refuses, refused
    with one of the errors a bad file gets."""
    try:
        load(path).replay("waterwave", capacity=CAPACITY)
    except REFUSED:
        pass


def fuzz_graph(data: bytes) -> None:
    """A graph file, planned and checked when it reads."""
    path = _as_file(data, "graph.json")
    try:
        g = Graph.load(path)
        check_plan(g, plan(g, "greedy", time_limit=0.2))
    except REFUSED:
        pass


def _seed_graph() -> Graph:
    g = Graph("seed")
    x = g.add_tensor("x", 1024, "input")
    w = g.add_tensor("w", 2048, "param", True)
    h = g.add_tensor("h", 4096)
    y = g.add_tensor("y", 512)
    g.add_node("mm", "aten.mm", [x, w], [h])
    g.add_node("relu", "aten.relu", [h], [y], inplace_ok=[h])
    g.meta["outputs"] = [y]
    return g


def fuzz_plan(data: bytes) -> None:
    """A plan file for the seed graph: checked, turned into slots and served
    on the simulated GPU; a plan the checker passes must never put two live
    tensors over each other (the allocator's own checks run too)."""
    path = _as_file(data, "plan.json")
    g = _seed_graph()
    try:
        p = Plan.load(path)
        slots, arena = plan_slots(g, p)
        a = ww.Allocator("waterwave", ww.SimDevice(CAPACITY, 0.0))
        a.set_plan(0, slots, arena)
        live = Live()
        for size, _ in slots:
            live.add(a.alloc(size, 0), size)
        a.check_invariants()
    except REFUSED:
        pass


def fuzz_trace(data: bytes) -> None:
    """A trace file, replayed when it reads."""
    _replayed(trace.Trace.load, _as_file(data, "trace.json"))


def fuzz_csv(data: bytes) -> None:
    """A buffer CSV, packed (briefly) when it reads; the packing must not overlap."""
    path = _as_file(data, "buffers.csv")
    try:
        table = read_buffer_csv(path)
        packed = pack(table.buffers, time_limit=0.05)
        offsets, arena, bound = packed.offsets, packed.arena_size, packed.lower_bound
    except REFUSED:
        return
    bufs = table.buffers
    assert bound <= arena
    for i, x in enumerate(bufs):
        assert 0 <= offsets[x.id] and offsets[x.id] + x.size <= arena
        for y in bufs[i + 1:]:
            if x.lower < y.upper and y.lower < x.upper and x.size and y.size:
                assert not (offsets[x.id] < offsets[y.id] + y.size and
                            offsets[y.id] < offsets[x.id] + x.size), (x, y)


def fuzz_program(data: bytes) -> None:
    """A random program of allocations, frees, record_stream, SyncAndCoalesce
    and empty_cache on either policy, with expandable segments, own memory
    first, or neither."""
    fdp = atheris.FuzzedDataProvider(data)
    policy = "pytorch" if fdp.ConsumeBool() else "waterwave"
    config = fdp.PickValueInList(["", "expandable_segments:True", "own_segments_first:True"])
    _run_program(ww.Allocator(policy, ww.SimDevice(CAPACITY, 0.0), config), fdp, 200)


TARGETS = {"config": fuzz_config, "slots": fuzz_slots, "snapshot": fuzz_snapshot,
           "trace": fuzz_trace, "graph": fuzz_graph, "plan": fuzz_plan, "csv": fuzz_csv,
           "program": fuzz_program}


def seeds(target: str) -> list[bytes]:
    """Valid inputs to start from, so the fuzzer mutates real formats."""
    if target == "config":
        return [b"\x00max_split_size_mb:64,expandable_segments:True",
                b"\x00own_segments_first:True,max_split_size_mb:20",
                b"\x01garbage_collection_threshold:0.5,roundup_power2_divisions:[256:4,>:1]"]
    if target == "snapshot":
        events = [{"action": "alloc", "addr": 4096 * i, "size": 512 * (i + 1), "stream": i % 2}
                  for i in range(4)] + [{"action": "free_requested", "addr": 0, "size": 512,
                                         "stream": 0}]
        return [pickle.dumps({"segments": [], "device_traces": [events]})]
    if target == "graph":
        return [json.dumps(_seed_graph().to_dict()).encode()]
    if target == "plan":
        g = _seed_graph()
        return [json.dumps(plan(g, strategy).to_dict()).encode()
                for strategy in ("greedy", "pytorch")]
    if target == "trace":
        t = trace.Trace("seed")
        t.ops.append(trace.Op("a", 0, "forward", gpu_us=5.0, alloc=[(0, 512), (1, 4096)]))
        t.ops.append(trace.Op("b", 1, "backward", gpu_us=3.0, alloc=[(2, 1024)], use=[1]))
        t.ops.append(trace.Op("c", 0, "optimizer", gpu_us=1.0, free=[0, 1, 2]))
        return [json.dumps(t.to_dict()).encode()]
    if target == "csv":
        return [b"id,lower,upper,size\na,0,5,512\nb,2,7,1024\nc,5,9,512\n",
                b"buffer,start,end,size\nx,0,4,4\ny,5,9,4\n"]
    return [bytes(range(256))]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [corpus]")
    target = sys.argv.pop(1)
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    for d in corpus:  # seed an empty corpus directory
        os.makedirs(d, exist_ok=True)
        if not os.listdir(d):
            for k, s in enumerate(seeds(target)):
                with open(os.path.join(d, f"seed{k}"), "wb") as f:
                    f.write(s)
    atheris.Setup(sys.argv, TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
