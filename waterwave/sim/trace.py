"""Traces: a program's allocations and frees, operator by operator, on any
number of streams; saved, loaded, and replayed through a policy on the
simulated GPU. ``waterwave.trace`` is this module.

Two sources:

- ``from_snapshot(path)``: a PyTorch memory snapshot, the pickle that
  ``torch.cuda.memory._dump_snapshot`` writes (gzipped or not). Its
  ``device_traces`` give every ``alloc`` and ``free_requested`` with its
  stream; each becomes an operator of its own (no kernel: a snapshot does
  not say what ran). Blocks live before recording began are allocated
  first.
- ``from_graph(graph, gpu=...)`` (``eager.py``): a captured training step, as eager PyTorch
  runs it (``eager.py``): persistent memory where PyTorch makes it, then
  each operator's outputs and workspaces, its kernel with a roofline time on
  the named GPU, and the frees of what it used last.

JSON format (``format: "waterwave-trace"``, ``version: 1``)::

    {"format": "waterwave-trace", "version": 1, "name": "resnet50-bs64",
     "meta": {...},
     "persistent": [[block, size, stream, at], ...],
     "ops": [{"name": "convolution", "stream": 0, "phase": "forward",
              "gpu_us": 41.0, "cpu_us": 10.0, "first_us": 2300.0,
              "alloc": [[block, size], ...], "free": [block, ...],
              "use": [block, ...], "sm": 0.25, "bw": 0.8}, ...]}

An operator allocates its ``alloc`` blocks, launches its kernel (when
``gpu_us`` > 0) touching those, ``use`` and ``free``, then frees ``free``.
``sm`` and ``bw`` (optional, 1 when absent) are the shares of the GPU's SMs
and memory bandwidth its kernel takes beside other streams' kernels, when
the simulated GPU runs kernels concurrently.
``time_us``, in traces from snapshots, is when the event happened on the
host. ``first_us`` is host time an operator costs the first time it runs (in the
first step: library kernels choosing their algorithms). ``persistent``
blocks are allocated once and never freed: before the first
operator (``at`` -1) or, in the first step, right before operator ``at``
(PyTorch creates optimizer state and library workspaces lazily); ``stream``
is an index from 0; ``phase`` is ``forward``,
``backward``, ``optimizer`` or empty. A replay of several steps runs the
operators again with fresh blocks.

May import: waterwave._C, waterwave.alloc, waterwave.graph, this package.
"""
from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass, field

from .. import _C
from ..alloc import Allocator
from ..graph import check_header, input_limits, read_bytes, read_json, round_size, write_json

FORMAT = "waterwave-trace"
VERSION = 1
PHASES = ("", "forward", "backward", "optimizer")
MAX_STREAM_ID = (1 << 62) - 1


class TraceError(ValueError):
    """A trace or snapshot that cannot be read, named with what is wrong."""


def over_block_limit(where: str, size: int, limit: int) -> TraceError:
    """The error for a block past ``InputLimits.block_bytes``, naming how to raise it."""
    return TraceError(f"{where}: a block of {size:,} bytes is over the limit of {limit:,} for one "
                      "block (waterwave.set_input_limits(block_bytes=...) raises it)")


@dataclass
class Op:
    name: str
    stream: int = 0
    phase: str = ""
    gpu_us: float = 0.0
    cpu_us: float = 0.0
    first_us: float = 0.0  # more host time in the first step
    time_us: float | None = None  # host time it happened at (snapshots)
    alloc: list[tuple[int, int]] = field(default_factory=list)  # (block, bytes)
    free: list[int] = field(default_factory=list)
    use: list[int] = field(default_factory=list)
    sm: float = 1.0  # the kernel's share of the SMs beside other streams' kernels
    bw: float = 1.0  # and of the memory bandwidth

    def to_dict(self) -> dict:
        d = {"name": self.name, "stream": self.stream, "phase": self.phase,
             "gpu_us": self.gpu_us, "cpu_us": self.cpu_us, "first_us": self.first_us,
             "alloc": [list(a) for a in self.alloc], "free": self.free, "use": self.use}
        if self.time_us is not None:
            d["time_us"] = self.time_us
        if (self.sm, self.bw) != (1.0, 1.0):
            d["sm"], d["bw"] = self.sm, self.bw
        return d


@dataclass
class Trace:
    name: str
    ops: list[Op] = field(default_factory=list)
    # (block, bytes, stream, at): allocated before operator `at` of the first step, -1 first
    persistent: list[tuple[int, int, int, int]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # Shape --------------------------------------------------------------
    @property
    def streams(self) -> list[int]:
        return sorted({op.stream for op in self.ops} | {p[2] for p in self.persistent})

    def persistent_bytes(self) -> int:
        return sum(p[1] for p in self.persistent)

    def persistent_at(self) -> dict[int, list[tuple[int, int, int]]]:
        """Persistent blocks by the operator they come before: -1 for the start."""
        out: dict[int, list[tuple[int, int, int]]] = {}
        for b, n, s, at in self.persistent:
            out.setdefault(at, []).append((b, n, s))
        return out

    def peak_live(self) -> int:
        """The most bytes live at once over the first step (persistent included)."""
        at = self.persistent_at()
        size, live = {}, sum(n for _, n, _ in at.get(-1, []))
        peak = live
        for k, op in enumerate(self.ops):
            live += sum(n for _, n, _ in at.get(k, []))
            for b, n in op.alloc:
                size[b] = n
                live += n
            peak = max(peak, live)
            for b in op.free:
                live -= size.pop(b, 0)
        return peak

    def validate(self) -> None:
        """Every block is allocated once, freed at most once and only after
        its allocation, with a positive size; streams and phases are known."""
        where = f"trace {self.name!r}"
        limits = input_limits()
        streams = self.streams
        if len(streams) > limits.streams or (streams and streams[-1] > MAX_STREAM_ID):
            raise TraceError(f"{where}: it uses {len(streams)} streams, numbered up to {streams[-1]}; "
                             f"the limits are {limits.streams} streams (replay's memory grows with "
                             f"the square of it) numbered below 2^62: raise the first with "
                             "waterwave.set_input_limits(streams=...) if the trace is genuine")
        sizes = [n for _, n, _, _ in self.persistent] + [n for op in self.ops for _, n in op.alloc]
        if sizes and max(sizes) > limits.block_bytes:
            raise over_block_limit(where, max(sizes), limits.block_bytes)
        seen: dict[int, bool] = {}  # block -> still live
        persistent = {p[0] for p in self.persistent}
        at = self.persistent_at()
        for b, n, s, k in self.persistent:
            if n <= 0 or s < 0 or not -1 <= k < max(1, len(self.ops)):
                raise TraceError(f"{where}: persistent block {b} has size {n}, stream {s} or "
                                 f"comes before operator {k}, which does not exist")
        if len(persistent) != len(self.persistent):
            raise TraceError(f"{where}: a persistent block is listed twice")
        for b, _, _ in at.get(-1, []):
            seen[b] = True
        for i, op in enumerate(self.ops):
            for b, _, _ in at.get(i, []):
                seen[b] = True
            times = (op.gpu_us, op.cpu_us, op.first_us, 0.0 if op.time_us is None else op.time_us)
            if (op.phase not in PHASES or op.stream < 0
                    or not all(0 <= t < math.inf for t in times[:3])
                    or not math.isfinite(times[3]) or not (0 < op.sm <= 1 and 0 < op.bw <= 1)):
                raise TraceError(f"{where}: operator {i} ({op.name}) has a bad stream, phase, time "
                                 "or share (times must be finite and not negative, sm and bw in "
                                 "(0, 1])")
            for b, n in op.alloc:
                if n <= 0 or b in seen:
                    raise TraceError(f"{where}: operator {i} ({op.name}) allocates block {b} "
                                     f"again or with size {n}")
                seen[b] = True
            for b in op.use:
                if not seen.get(b):
                    raise TraceError(f"{where}: operator {i} ({op.name}) uses block {b}, "
                                     "which is not live")
            for b in op.free:
                if not seen.get(b) or b in persistent:
                    raise TraceError(f"{where}: operator {i} ({op.name}) frees block {b}, which "
                                     "is not a live, non-persistent block")
                seen[b] = False

    # Files ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "meta": self.meta,
                "persistent": [list(p) for p in self.persistent],
                "ops": [op.to_dict() for op in self.ops]}

    def save(self, path: str) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict, source: str = "trace") -> "Trace":
        try:
            check_header(d, FORMAT, VERSION, TraceError, "write the trace again")
            t = cls(str(d["name"]), meta=dict(d.get("meta", {})),
                    persistent=[(int(b), int(n), int(s), int(k)) for b, n, s, k in d["persistent"]])
            for o in d["ops"]:
                t.ops.append(Op(str(o["name"]), int(o.get("stream", 0)), str(o.get("phase", "")),
                                gpu_us=float(o.get("gpu_us", 0.0)),
                                cpu_us=float(o.get("cpu_us", 0.0)),
                                first_us=float(o.get("first_us", 0.0)),
                                time_us=None if o.get("time_us") is None else float(o["time_us"]),
                                alloc=[(int(b), int(n)) for b, n in o.get("alloc", [])],
                                free=[int(b) for b in o.get("free", [])],
                                use=[int(b) for b in o.get("use", [])],
                                sm=float(o.get("sm", 1.0)), bw=float(o.get("bw", 1.0))))
        except TraceError as e:
            raise TraceError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TraceError(f"{source}: the trace is corrupt ({type(e).__name__}: {e})") from None
        try:
            t.validate()
        except TraceError as e:
            raise TraceError(f"{source}: {e}") from None
        return t

    @classmethod
    def load(cls, path: str) -> "Trace":
        return cls.from_dict(read_json(path, TraceError), source=path)

    # Replay -----------------------------------------------------------------
    def replay(self, policy: str = "pytorch", capacity: int | None = None, steps: int = 1,
               config: str = "", record: bool = False, **kwargs) -> dict:
        """Run the trace ``steps`` times through ``policy`` on a simulated GPU
        of ``capacity`` bytes (default: unlimited), one allocator stream per
        trace stream. Returns the allocator's ``stats()`` plus ``hazards``
        (the list of hazards found) and ``gpu_time_us``; with ``record``,
        ``timeline``: reserved bytes and each stream's allocated bytes after
        each operator. Out of memory raises ``OutOfMemoryError``;
        ``config``/keywords as for ``Allocator``."""
        device = _C.SimDevice(capacity or 1 << 50, 0.0)
        a = Allocator(policy, device, config, **kwargs)
        at, kept = self.persistent_at(), {}
        streams = self.streams
        timeline = {"reserved": [], "allocated": {s: [] for s in streams}}
        held, sizes = dict.fromkeys(streams, 0), {}
        for b, n, s in at.get(-1, []):
            kept[b] = a.alloc(n, s)
            held[s] += n
        for step in range(steps):
            ptr: dict[int, int] = {}
            for k, op in enumerate(self.ops):
                for b, n, s in at.get(k, []) if step == 0 else ():
                    kept[b] = a.alloc(n, s)
                    held[s] += n
                if record:  # bytes as requested, by the stream that allocated them
                    for b, n in op.alloc:
                        sizes[b] = (n, op.stream)
                        held[op.stream] += n
                    for b in op.free:
                        n, s = sizes.pop(b)
                        held[s] -= n
                run_op(a, op, ptr, kept)
                if record:
                    timeline["reserved"].append(device.reserved_bytes())
                    for s in streams:
                        timeline["allocated"][s].append(held[s])
        stats = a.stats()
        stats["hazards"] = a.hazards()
        stats["gpu_time_us"] = device.gpu_busy_until()
        if record:
            stats["timeline"] = timeline
        return stats


def run_op(a: Allocator, op: Op, ptr: dict[int, int], persistent: dict[int, int] | None = None
           ) -> None:
    """One operator through an allocator: its host time, allocations, kernel,
    frees. ``ptr`` maps the step's blocks to addresses (updated);
    ``persistent`` the persistent blocks', which kernels may use."""
    if op.cpu_us:
        a.device.advance_host(op.cpu_us)
    for b, n in op.alloc:
        ptr[b] = a.alloc(n, op.stream)
    if op.gpu_us > 0:
        uses = [ptr.get(b) or (persistent or {}).get(b) for b in (*op.use, *op.free)]
        uses += [ptr[b] for b, _ in op.alloc]
        a.launch(op.stream, op.gpu_us, [p for p in uses if p], op.sm, op.bw)
    for b in op.free:
        a.free(ptr.pop(b))


# Snapshots ------------------------------------------------------------------
class _PlainData(pickle._Unpickler):
    """Unpickles plain data only: a snapshot is dicts, lists, strings and
    numbers, and nothing in it may run code. The pure-Python unpickler
    (CPython's ``pickle._Unpickler``), not the C one: the C one sizes its
    memo table by the largest index a PUT names, so a 200-byte file naming
    index 10^9 takes gigabytes (found by the fuzzer); this one keeps the memo
    in a dict. It reads about 5 MB/s, as fast as a replay consumes events.
    A bytearray (which it allocates at the length the file declares, before
    reading) has no place in a snapshot and is refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def _no_bytearray(self):
        raise pickle.UnpicklingError("it holds a bytearray, which no snapshot does")

    dispatch[pickle.BYTEARRAY8[0]] = _no_bytearray

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it holds a {module}.{name} object, not plain data")


def _read_snapshot(path: str) -> dict:
    try:
        raw = read_bytes(path, TraceError, gunzip=True)
    except OSError as e:
        raise TraceError(f"{path}: cannot read the snapshot: {e.strerror or e}") from None
    try:
        d = _PlainData(io.BytesIO(raw)).load()
    except EOFError:
        raise TraceError(f"{path}: the snapshot is truncated (the pickle ends early); copy it "
                         "again") from None
    except MemoryError:  # a length field far beyond the file's bytes
        raise TraceError(f"{path}: not a PyTorch memory snapshot (it declares an object larger "
                         "than memory); the file is corrupt") from None
    except Exception as e:  # a pickle from elsewhere can fail in any way: all are "not a snapshot"
        raise TraceError(f"{path}: not a PyTorch memory snapshot ({type(e).__name__}: {e}). "
                         "Write one with torch.cuda.memory._dump_snapshot(path)") from None
    if not isinstance(d, dict) or not isinstance(d.get("device_traces"), list):
        raise TraceError(f"{path}: not a PyTorch memory snapshot (no 'device_traces'). Write one "
                         "with torch.cuda.memory._record_memory_history(enabled='all') before "
                         "the run and torch.cuda.memory._dump_snapshot(path) after it")
    return d


def from_snapshot(path: str, device: int = 0) -> Trace:
    """The allocation history of ``device`` in a PyTorch memory snapshot as a
    trace: each ``alloc`` and ``free_requested`` an operator on its stream
    (streams numbered from 0 in order of appearance; ``meta["stream_ids"]``
    keeps PyTorch's). A free of a block allocated before recording began
    allocates it first."""
    d = _read_snapshot(path)
    traces = d["device_traces"]
    if not 0 <= device < len(traces) or not isinstance(traces[device], list):
        raise TraceError(f"{path}: the snapshot has no trace for device {device} "
                         f"({len(traces)} devices)")
    events = [e for e in traces[device]
              if isinstance(e, dict) and e.get("action") in ("alloc", "free_requested")]
    if not events:
        raise TraceError(f"{path}: device {device}'s trace holds no allocations: record with "
                         "torch.cuda.memory._record_memory_history(enabled='all')")
    stream_ids: list[int] = []
    stream_index: dict[int, int] = {}
    limits = input_limits()
    most_streams, most_bytes = limits.streams, limits.block_bytes
    t = Trace(path.rsplit("/", 1)[-1], meta={"source": "snapshot", "device": device})
    block_at: dict[int, int] = {}  # address -> live block
    blocks = 0
    early: list[Op] = []  # blocks freed that were live before recording began
    for i, e in enumerate(events):
        try:
            addr, size, stream = int(e["addr"]), int(e["size"]), int(e["stream"])
            when = float(e.get("time_us", 0.0)) - float(events[0].get("time_us", 0.0))
            if not math.isfinite(when):
                raise ValueError("time_us is not finite")
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TraceError(f"{path}: event {i} of device {device} lacks addr, size, stream or a "
                             "finite time_us: the snapshot is corrupt") from None
        if stream not in stream_index:
            if len(stream_ids) == most_streams:
                raise TraceError(f"{path}: device {device}'s trace uses more than {most_streams} "
                                 "streams, the limit for traces read (replay's memory grows with "
                                 "the square of it): raise it with waterwave.set_input_limits("
                                 "streams=...) or WATERWAVE_MAX_STREAMS if the snapshot is genuine")
            stream_index[stream] = len(stream_ids)
            stream_ids.append(stream)
        s = stream_index[stream]
        if size > most_bytes:  # before rounding: the allocator's arithmetic stops at 2**62
            raise over_block_limit(f"{path}: event {i}", size, most_bytes)
        if e["action"] == "alloc":
            if addr in block_at:
                raise TraceError(f"{path}: event {i} allocates {addr:#x} twice without a free: "
                                 "the snapshot is corrupt")
            block_at[addr] = blocks
            blocks += 1
            t.ops.append(Op("alloc", s, alloc=[(block_at[addr], round_size(size))], time_us=when))
        else:
            b = block_at.pop(addr, None)
            if b is None:  # live before recording began: allocate it up front
                b = -(len(early) + 1)
                early.append(Op("alloc (before recording)", s, alloc=[(b, round_size(size))]))
            t.ops.append(Op("free", s, free=[b], time_us=when))
    t.ops = early + t.ops
    t.meta["stream_ids"] = stream_ids
    t.validate()
    return t
