"""``waterwave bench alloc --gpu``: what one allocation and its free cost
inside PyTorch on a GPU, under each allocator PyTorch can use.

Allocators: ``native`` (PyTorch's caching allocator), ``cudaMallocAsync``
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``) and Waterwave's two
policies through ``install_allocator``. PyTorch chooses its allocator once
per process, so each runs in a process of its own (this module, run as a
worker), one after another, and checks that PyTorch reports the backend it
was meant to get.

Two paths, each timed on the host (an allocation launches no kernel; its
cost is the CPU's):
- ``tensor``: ``torch.empty(n, dtype=uint8, device="cuda")`` and dropping
  it, which is what a training step pays (dispatcher, tensor and storage
  included);
- ``raw``: ``torch._C._cuda_cudaCachingAllocator_raw_alloc`` and
  ``raw_delete``, the allocator behind PyTorch's interface without a
  tensor, on stream 0. It skips CUDA's lazy init, so on a machine without
  a GPU it runs over the fake driver the tests build: that is how the
  suite exercises this module; such figures are labelled ``fake driver``
  and are no GPU's.

Two more, to find where Waterwave's raw pair spends the 1.0-1.6 us more
than PyTorch's that the H200 measured while its tensor pair cost less
(docs/results.md):
- ``raw_current``: the same binding on the current stream's handle, which
  the tensor path allocates on (stream 0 is CUDA's legacy default stream);
- ``core``: Waterwave's runtime called straight from Python
  (``waterwave._C.cuda_malloc``/``cuda_free``), past PyTorch's binding and
  registration; Waterwave's allocators only.

Each case: warm-up pairs (the cache then holds what the case needs), then
``repeats`` timed runs of ``pairs`` pairs, median and range in ns per pair;
the paths take turns, one run of each path's cases at a time.

May import: waterwave.cuda, torch lazily.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque

from ..cuda import install_allocator

KiB, MiB = 1024, 1024**2

# name -> (environment, install_allocator's policy and registration or None, the backend
# PyTorch must report). waterwave:POLICY is the native registration (what users get where it
# builds); pluggable:POLICY goes through torch's CUDAPluggableAllocator.
ALLOCATORS = {
    "native": ({}, None, "native"),
    "cudaMallocAsync": ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, None,
                        "cudaMallocAsync"),
    "waterwave:pytorch": ({}, ("pytorch", "native"), "waterwave"),
    "waterwave:waterwave": ({}, ("waterwave", "native"), "waterwave"),
    "pluggable:pytorch": ({}, ("pytorch", "pluggable"), "pluggable"),
    "pluggable:waterwave": ({}, ("waterwave", "pluggable"), "pluggable"),
}
PATHS = ("raw", "raw_current", "tensor", "core")
WINDOW = 8  # live allocations in the mixed case, freed oldest first


def cases(seed: int = 1) -> dict[str, list[int]]:
    """Each case's sizes, cycled: one size alloc+free at a time, or a FIFO
    window of mixed sizes (log-uniform 512 B to 1 MiB, seeded)."""
    rng = random.Random(seed)
    mixed = [int(2 ** rng.uniform(9, 20)) for _ in range(64)]
    return {"512B": [512], "64KiB": [64 * KiB], "2MiB": [2 * MiB], "32MiB": [32 * MiB],
            "window8_mixed": mixed}


def _timed(alloc, free, sizes: list[int], pairs: int) -> float:
    """ns per alloc+free pair over ``pairs`` pairs, WINDOW live at a time
    for mixed sizes, one at a time otherwise."""
    window = WINDOW if len(sizes) > 1 else 1
    n = len(sizes)
    live = deque(alloc(sizes[i % n]) for i in range(window - 1))
    start = time.perf_counter_ns()
    for i in range(pairs):
        live.append(alloc(sizes[i % n]))
        free(live.popleft())
    elapsed = time.perf_counter_ns() - start
    for handle in live:
        free(handle)
    return elapsed / pairs


def _paths(torch, waterwave: bool) -> dict:
    """Each path's (alloc, free); ``core`` only under Waterwave's
    allocators."""
    def tensor_alloc(size):
        return torch.empty(size, dtype=torch.uint8, device="cuda")

    raw_alloc = torch._C._cuda_cudaCachingAllocator_raw_alloc
    raw_delete = torch._C._cuda_cudaCachingAllocator_raw_delete
    current = []  # the current stream's handle, read once CUDA is up

    def raw_current_alloc(size):
        if not current:
            current.append(torch.cuda.current_stream().cuda_stream)
        return raw_alloc(size, current[0])

    paths = {
        "raw": (lambda size: raw_alloc(size, 0), raw_delete),
        "raw_current": (raw_current_alloc, raw_delete),
        "tensor": (tensor_alloc, lambda t: None),  # dropping the reference frees it
    }
    if waterwave:
        from .. import _C

        paths["core"] = (lambda size: (_C.cuda_malloc(size, 0, 0), size),
                         lambda held: _C.cuda_free(held[0], held[1], 0, 0))
    return paths


def measure(allocator: str, pairs: int, repeats: int, seed: int = 1) -> dict:
    """In a fresh process: set the allocator up, time every case on each
    path. A path that cannot run here (the tensor path without a GPU)
    carries its error instead of figures."""
    env, install, backend = ALLOCATORS[allocator]
    for k, v in env.items():
        if os.environ.get(k) != v:
            raise RuntimeError(f"run {allocator} in a process started with {k}={v}")
    import torch

    if install is not None:
        policy, registration = install
        install_allocator(policy=policy, registration=registration)
    got = torch.cuda.memory.get_allocator_backend()
    if got != backend:
        raise RuntimeError(f"PyTorch reports the {got!r} allocator, not {backend!r}")
    out: dict = {"allocator": allocator, "backend": got, "cases": {}, "errors": {}}
    try:
        # PyTorch's own allocators serve raw allocations only once CUDA is
        # initialized ("Allocator not initialized for device").
        torch.cuda.init()
    except Exception:  # noqa: BLE001 - no GPU: the tensor path reports why; raw may still run
        pass
    try:  # whether raw_current's handle is stream 0's (the legacy default stream) or not
        out["current_stream"] = torch.cuda.current_stream().cuda_stream
    except Exception:  # noqa: BLE001 - no GPU and no fake runtime describing one
        out["current_stream"] = None
    paths = _paths(torch, install is not None)
    runs: dict = {}  # (path, case) -> ns per pair, a run each repeat
    # The paths take turns, a repeat of every path and case at a time, so
    # that no path alone carries what the process's first seconds cost. (On
    # an H200, timed one path after another, Waterwave's raw pair on stream
    # 0, first, cost 1.3-2.1 us more than on the current stream's handle,
    # second, while under PyTorch's allocator the two cost the same.)
    for repeat in range(-1, repeats):  # -1: the warm-up, which fills the cache
        for path, (alloc, free) in paths.items():
            if path in out["errors"]:
                continue
            try:
                for name, sizes in cases(seed).items():
                    ns = _timed(alloc, free, sizes, pairs if repeat >= 0 else min(pairs, 2000))
                    if repeat >= 0:
                        runs.setdefault((path, name), []).append(ns)
            except Exception as e:  # noqa: BLE001 - reported per path; the others still run
                out["errors"][path] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for (path, name), ns in runs.items():
        if path not in out["errors"]:
            out["cases"].setdefault(name, {})[path] = {
                "ns_per_pair": statistics.median(ns), "min_ns": min(ns), "max_ns": max(ns)}
    # Another driver library named: the suite's fake one, whatever device name it gives.
    out["device"] = ("fake driver" if os.environ.get("WATERWAVE_CUDA_DRIVER")
                     else torch.cuda.get_device_name(0) if "tensor" not in out["errors"]
                     else "unknown")
    return out


def check_names(allocators: list[str]) -> None:
    for name in allocators:
        if name not in ALLOCATORS:
            raise ValueError(f"unknown allocator {name!r}: choose from {', '.join(ALLOCATORS)}")


def run_all(allocators: list[str], pairs: int, repeats: int, seed: int = 1,
            timeout: float = 600) -> list[dict]:
    """Each allocator in its own process, one after another. One that fails
    gives its error; the others still run."""
    check_names(allocators)
    results = []
    for name in allocators:
        env = {**os.environ, **ALLOCATORS[name][0]}
        command = [sys.executable, "-m", __name__, name, "--pairs", str(pairs),
                   "--repeats", str(repeats), "--seed", str(seed)]
        try:
            r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout,
                               check=False)
        except subprocess.TimeoutExpired:
            results.append({"allocator": name, "failed": f"took over {timeout:.0f} s"})
            continue
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"allocator": name, "failed": tail[:300]})
        else:
            results.append(json.loads(lines[-1]))
    return results


def worker(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one allocator's figures, as JSON on stdout")
    parser.add_argument("allocator", choices=list(ALLOCATORS))
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.allocator, args.pairs, args.repeats, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(worker())
