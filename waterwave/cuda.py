"""``waterwave.cuda``: the Waterwave allocator on real GPUs, inside PyTorch,
under torch's names.

``install_allocator()`` makes PyTorch take every CUDA allocation from
Waterwave (``waterwave.alloc.pluggable``: through
``torch.cuda.memory.CUDAPluggableAllocator``); call it at process start,
before anything touches CUDA. The C++ core runs over the CUDA driver, which
is opened at run time (``WATERWAVE_CUDA_DRIVER`` names another
``libcuda.so``, e.g. the fake driver the tests build).

Settings come from the arguments, else from ``WATERWAVE_ALLOC_CONF``: a
``PYTORCH_CUDA_ALLOC_CONF``-style string with one more key, ``policy``
(``waterwave`` or ``pytorch``)::

    WATERWAVE_ALLOC_CONF="policy:waterwave,max_split_size_mb:256" python train.py

PyTorch's own ``torch.cuda.memory_stats()`` does not work with a pluggable
allocator (PyTorch refuses it); ``waterwave.cuda.memory_stats()`` gives the
same keys and Waterwave's own.

Each device has one allocator stack (csrc/alloc/stack.h): the online policy,
and per stream at most one plan or recording over it. Plans come from the
planner (``waterwave.planner.plan_from_trace`` packs a recording).

Each function here is one call on the device's ``waterwave.Allocator``
(``allocator(device)``), the same class the simulator uses.

May import: waterwave._C, waterwave.alloc (torch, lazily).
"""
from __future__ import annotations

from typing import Any

from . import _C
from .alloc import snapshot as snapshots
from .alloc.allocator import Allocator
from .alloc.pluggable import (  # noqa: F401  (the registration, under torch's names)
    EMPTY_CACHE,
    FREE,
    MALLOC,
    RECORD_STREAM,
    configure,
    current_settings,
    install_allocator,
    is_installed,
    registration,
)


def _device_index(device) -> int:
    if device is None:
        import torch

        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise ValueError(f"not a CUDA device: {device!r}; give an index, 'cuda:N' or a "
                         "torch.device")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"not a CUDA device index: {device}; indices start at 0")
        return device
    if isinstance(device, str):  # "cuda", "cuda:1" (a str's .index is a method, not an index)
        kind, _, tail = device.partition(":")
        if kind != "cuda" or (tail and not tail.isdigit()):
            raise ValueError(f"not a CUDA device: {device!r}; give 'cuda', 'cuda:N' or an index "
                             "(waterwave.cuda reports the GPU allocator, not the CPU's)")
        return int(tail) if tail else 0
    kind = getattr(device, "type", None)  # torch.device
    if kind is not None and kind != "cuda":
        raise ValueError(f"not a CUDA device: {device}; waterwave.cuda reports the GPU allocator")
    index = getattr(device, "index", None)
    return 0 if index is None else int(index)


def allocator(device=None) -> Allocator:
    """The device's allocator stack, the one PyTorch's hooks use: a
    ``waterwave.Allocator`` (created at the device's first use)."""
    return Allocator.for_cuda(_device_index(device))


def memory_stats(device=None) -> dict:
    """The device's allocator statistics: ``torch.cuda.memory_stats()``'s
    keys (``allocated_bytes.all.peak`` ...) plus fragmentation, how requests
    were served, syncs and waits."""
    return allocator(device).stats()


def memory_allocated(device=None) -> int:
    """Bytes in blocks handed out now (``torch.cuda.memory_allocated``)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device=None) -> int:
    """Bytes held from the driver now (``torch.cuda.memory_reserved``)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def own_segments(stream: int, device=None) -> dict[str, int]:
    """The segments ``stream`` (a ``torch.cuda.Stream``'s ``cuda_stream``)
    reserved on the device, and the bytes allocated in them, each now and
    at its peak since ``reset_peak_memory_stats``: ``reserved_bytes.current``,
    ``reserved_bytes.peak``, ``allocated_bytes.current``,
    ``allocated_bytes.peak``; zeros for a stream that reserved none."""
    zero = dict.fromkeys(("reserved_bytes.current", "reserved_bytes.peak",
                          "allocated_bytes.current", "allocated_bytes.peak"), 0)
    return memory_stats(device)["own_segments_by_stream"].get(stream, zero)


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device as its driver reports them
    (``torch.cuda.mem_get_info``): memory this allocator has cached counts
    as used."""
    return tuple(allocator(device).mem_get_info())


def get_per_process_memory_fraction(device=None) -> float:
    """The share of the device's memory this allocator may reserve
    (``per_process_memory_fraction``; torch's name), 1.0 for no limit."""
    return allocator(device).get_per_process_memory_fraction()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """From now on, keep the memory this allocator reserves within
    ``fraction`` of the device's (torch's ``set_per_process_memory_fraction``);
    memory already reserved above it stays until freed and given back."""
    allocator(device).set_per_process_memory_fraction(fraction)


def set_max_split_size_mb(mb: int | None, device=None) -> None:
    """From now on, never split a cached block of at least ``mb`` MiB
    (``max_split_size_mb``, as ``PYTORCH_CUDA_ALLOC_CONF`` sets it at start;
    None: no limit). Blocks split before stay split until they coalesce.
    A sharing session's first block on a GPU sets 20 MiB unless a limit was
    chosen, here (None included) or in the allocator's settings
    (``alloc/cache_splits.py``)."""
    if mb is not None:
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise ValueError(f"max_split_size_mb must be a positive whole number of MiB or None; "
                             f"got {mb!r}")
        if mb > (1 << 43):  # 2**63 bytes: beyond any device
            raise ValueError(f"max_split_size_mb={mb} is beyond any device; give None for no "
                             "limit")
    allocator(device).set_max_split_size(-1 if mb is None else mb << 20)


def max_split_size_chosen(device=None) -> bool:
    """Whether the device's limit was chosen: in the allocator's settings or
    by ``set_max_split_size_mb`` (None too)."""
    return allocator(device).max_split_size_chosen()


def set_own_segments_first(on: bool, device=None) -> None:
    """From now on, under the waterwave policy, each stream takes its own
    segments' free blocks and a new segment before other streams' free
    memory, which it takes only once the device (or its memory fraction) is
    out (``own_segments_first``; off by default). ConfigError with expandable
    segments, which keep each stream to its own segment already. See the
    guide's allocator page for when it pays."""
    if not isinstance(on, bool):
        raise TypeError(f"set_own_segments_first takes True or False, not {on!r}")
    allocator(device).set_own_segments_first(on)


def record_memory_history(enabled: Any = True, max_entries: int = snapshots.DEFAULT_MAX_ENTRIES,
                          device=None) -> None:
    """Record the device allocator's events for ``memory_snapshot`` (torch's
    ``_record_memory_history``): the newest ``max_entries`` are kept;
    ``enabled=False`` stops and drops them."""
    allocator(device).record_memory_history(enabled, max_entries)


def memory_snapshot() -> dict:
    """Every device's segments and recorded history in PyTorch's snapshot
    format (``torch.cuda.memory._snapshot()``)."""
    stacks = {d: Allocator.for_cuda(d) for d in _C.cuda_devices()}
    return snapshots.build({d: a.snapshot() for d, a in stacks.items()},
                           {d: a.history() for d, a in stacks.items()})


def dump_snapshot(path: str) -> None:
    """Write ``memory_snapshot()`` as the pickle ``torch.cuda.memory._dump_snapshot``
    writes: https://pytorch.org/memory_viz and ``torch.cuda._memory_viz`` open it."""
    snapshots.dump(memory_snapshot(), path)


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A readable table of the device's statistics, laid out like
    ``torch.cuda.memory_summary()``, then free memory by state (synced, each
    stream's unsynced, pending), fragmentation and how requests were served."""
    return allocator(device).memory_summary(abbreviated)


def reset_peak_memory_stats(device=None) -> None:
    allocator(device).reset_peak_memory_stats()


def reset_accumulated_memory_stats(device=None) -> None:
    """Zero the counts of what was allocated and freed, and of retries,
    OOMs and device calls (torch's ``reset_accumulated_memory_stats``)."""
    allocator(device).reset_accumulated_memory_stats()


def empty_cache() -> None:
    """Give every wholly free cached segment back to the driver."""
    _C.cuda_empty_cache()


def sync_and_coalesce(device=None) -> None:
    """Synchronize the device, mark every free block synced and coalesce."""
    allocator(device).sync_and_coalesce()


def check_invariants(device=None) -> None:
    allocator(device).check_invariants()


def free_errors() -> tuple[int, str]:
    """(count, last message) of bad frees PyTorch made: a free cannot raise."""
    return _C.cuda_free_errors()


# Plans ---------------------------------------------------------------------
def _current_stream(index: int) -> int:
    import torch

    return torch.cuda.current_stream(index).cuda_stream


def set_plan(slots: list[tuple[int, int]], arena: int | None = None, device=None,
             stream: int | None = None, scope: str = "stream", give_back_cache: bool = True) -> None:
    """Serve ``stream``'s allocations from a plan: the k-th allocation of a
    step gets ``slots[k] = (size, offset)`` inside one arena of ``arena``
    bytes (default: the end of the last slot); anything else falls back to
    the online allocator, safely. ``stream``: the stream the plan is for
    (default: the current one). ``scope`` and ``give_back_cache`` as for
    ``Allocator.set_plan``, with its defaults: ``"stream"`` (the plan answers
    for its stream alone, so several jobs' plans share the device) or
    ``"device"`` (the plan is the device's whole step, as ``waterwave.optimize``
    plans it: another stream's allocation leaves it for the step)."""
    index = _device_index(device)
    stream = _current_stream(index) if stream is None else stream
    allocator(index).set_plan(stream, slots, arena, scope=scope, give_back_cache=give_back_cache)


def clear_plan(device=None, stream: int | None = None) -> None:
    """Remove the stream's plan (every plan of the device, by default); refused
    while its blocks are in use."""
    allocator(device).clear_plan(stream)


def begin_step(device=None, stream: int | None = None) -> None:
    """The next allocation is the first of a planned step. ``stream`` names
    the plan when the device has several."""
    allocator(device).begin_step(stream)


def plan_stats(device=None, stream: int | None = None) -> dict:
    """Planned and fallback allocations, deviations and why the last one happened."""
    return allocator(device).plan_stats(stream)


def has_plan(device=None, stream: int | None = None) -> bool:
    return allocator(device).has_plan(stream)


def start_recording(device=None, stream: int | None = None) -> None:
    """Record the device's allocations on ``stream`` (default: the current
    one) until ``stop_recording``. Removes that stream's plan (its blocks
    must be free)."""
    index = _device_index(device)
    stream = _current_stream(index) if stream is None else stream
    allocator(index).start_recording(int(stream))


def stop_recording(device=None, stream: int | None = None) -> list[tuple[int, int, int]]:
    """The recorded blocks in allocation order: ``(size, allocated, freed)``,
    times counted in allocations and frees, ``freed`` -1 for a block still
    live at the end. ``stream`` names the recording when there are several."""
    return [tuple(b) for b in allocator(device).stop_recording(stream)]
