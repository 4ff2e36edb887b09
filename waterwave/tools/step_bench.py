"""``waterwave bench step SNAPSHOT``: a recorded training step (a PyTorch
memory snapshot) replayed through each policy over a device, reporting per
step the allocator's host time and the device calls it makes, by kind
(``csrc/bench/step_bench.h``, counted between the policy and the device).

The device: the CUDA driver where one loads (a GPU), else the fake driver
the test suite builds (``tests/cpp/fake_cuda.c``: host memory behind the
driver API, its events complete at once as an idle GPU's do), compiled once
from a source checkout; or the simulated GPU (``--device sim``). A driver
replay allocates the recording's bytes for real (host memory for the fake).

May import: waterwave._C, waterwave.alloc, waterwave.sim; nothing else.
"""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import time
from pathlib import Path

from .. import _C
from ..alloc.settings import AllocatorConfig
from ..sim.trace import Trace, from_snapshot

POLICIES = ("waterwave", "pytorch")
DEVICES = ("auto", "cuda", "fake", "sim")
ROOT = Path(__file__).resolve().parents[2]
FAKE_SOURCE = ROOT / "tests" / "cpp" / "fake_cuda.c"
FAKE_CAPACITY = 1 << 36  # the fake's whole address range: its pages cost memory only once touched


def recorded_ops(trace: Trace, one_stream: bool = False) -> list[tuple[bool, int, int, int]]:
    """The recording as (alloc?, block, bytes, stream) in order, its streams
    numbered from 0 (the default stream) in the order the trace lists them.
    ``one_stream``: a real driver takes stream handles of its own process
    only, so a recording of several streams is refused there."""
    streams = {s: k for k, s in enumerate(trace.streams)}
    if one_stream and len(streams) > 1:
        raise ValueError(f"the recording uses {len(streams)} streams, and replaying on a GPU "
                         "runs one (the default stream): use --device fake or --device sim")
    ops = []
    for op in trace.ops:
        for block, n in op.alloc:
            ops.append((True, _block(block), n, streams[op.stream]))
        for block in op.free:
            ops.append((False, _block(block), 0, 0))
    if not any(alloc for alloc, *_ in ops):
        raise ValueError("the recording allocates nothing: record a training step "
                         "(torch.cuda.memory._record_memory_history before it)")
    return ops


def _block(block: int) -> int:
    if not 0 <= block < 1 << 32:
        raise ValueError(f"block number {block} is out of range (0 to 2**32-1)")
    return block


def gpu_driver() -> str | None:
    """``libcuda.so.1`` where it loads and sees a GPU, else None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return "libcuda.so.1" if count.value > 0 else None


def fake_driver(folder: Path | None = None) -> str:
    """The fake driver, compiled from the checkout's source when it is newer
    than the library, its events completing at once and its capacity the
    whole range it reserves."""
    if not FAKE_SOURCE.exists():
        raise ValueError(f"no GPU here, and the fake driver's source ({FAKE_SOURCE}) is not: "
                         "run from a source checkout, or use --device sim")
    folder = folder or ROOT / "build" / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    lib_path = folder / "libfakecuda.so"
    if not lib_path.exists() or lib_path.stat().st_mtime < FAKE_SOURCE.stat().st_mtime:
        built = subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o",
                                str(lib_path), str(FAKE_SOURCE), "-lpthread", "-ldl"],
                               capture_output=True, text=True)
        if built.returncode:
            raise ValueError(f"building the fake driver failed ({built.stderr.strip()[:300]}); "
                             "install a C compiler, or use --device sim")
    lib = ctypes.CDLL(str(lib_path))  # the handle the allocator's dlopen shares
    lib.fake_cuda_set_capacity.argtypes = [ctypes.c_size_t]
    lib.fake_cuda_set_capacity(FAKE_CAPACITY)
    lib.fake_cuda_set_idle(1)
    return str(lib_path)


def run(snapshot: str, device: str = "auto", steps: int = 50, warmup: int = 3,
        recorded_steps: int = 1, config: str = "", policies=POLICIES) -> dict:
    """Each policy's replay of ``snapshot``'s step (see the module's opening).
    ``recorded_steps``: the training steps the snapshot holds; figures are
    per training step."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if recorded_steps < 1:
        raise ValueError(f"recorded_steps must be at least 1, got {recorded_steps}")
    trace = from_snapshot(snapshot)
    driver = ""
    if device in ("auto", "cuda"):
        driver = gpu_driver() or ""
        if not driver and device == "cuda":
            raise ValueError("no GPU here (libcuda.so.1 does not load or sees no device): use "
                             "--device fake or --device sim")
        device = "cuda" if driver else "fake"
    if device == "fake":
        driver = fake_driver()
    ops = recorded_ops(trace, one_stream=device == "cuda")
    settings = AllocatorConfig(config)
    out = {"snapshot": os.path.basename(snapshot), "device": device,
           "driver": os.path.basename(driver) if driver else None,
           "recorded_steps": recorded_steps, "steps": steps, "warmup": warmup,
           "operations_per_step": len(ops) / recorded_steps,
           "where": {"machine": platform.machine(), "processor": cpu_name()},
           "date": time.strftime("%Y-%m-%d"), "policies": {}}
    replays = _C.bench_step("sim" if device == "sim" else "cuda", driver, list(policies),
                            settings, ops, steps, warmup)
    per = 1 / recorded_steps
    for policy, r in replays.items():
        out["policies"][policy] = {
            "host_ns_per_step": r["host_ns_per_step"] * per,
            "min_ns": r["min_ns"] * per, "max_ns": r["max_ns"] * per,
            "driver_calls_per_step": r["driver_calls_per_step"] * per,
            "calls": {k: v * per for k, v in r["calls"].items()},
            "peak_reserved": r["peak_reserved"], "device_segments": r["device_segments"]}
    return out


def format_table(result: dict) -> str:
    kinds = sorted({k for r in result["policies"].values() for k in r["calls"]})
    lines = [f"{result['snapshot']}: {result['steps']} replays per policy, taking turns, on "
             f"{result['device']}" + (f" ({result['driver']})" if result["driver"] else "")
             + f", {result['operations_per_step']:.0f} allocations and frees per step",
             f"{'policy':<10} {'µs/step':>9} {'min':>8} {'max':>8} {'calls/step':>11}  by kind"]
    for name, r in result["policies"].items():
        by_kind = ", ".join(f"{k} {r['calls'][k]:.1f}" for k in kinds if k in r["calls"])
        lines.append(f"{name:<10} {r['host_ns_per_step'] / 1e3:>9.1f} {r['min_ns'] / 1e3:>8.1f} "
                     f"{r['max_ns'] / 1e3:>8.1f} {r['driver_calls_per_step']:>11.1f}  {by_kind}")
    lines.append(f"measured on {result['where']['processor']}, {result['date']}"
                 + ("" if result["device"] == "cuda" else "; no GPU was involved"))
    return "\n".join(lines)


def cpu_name() -> str:
    """The host's processor, as /proc/cpuinfo names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
