"""The simulator's face of the allocator stack: ``waterwave.Allocator`` and
``waterwave.PlanAllocator`` on a ``SimDevice``.

May import: waterwave._C and this package.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import _C
from . import snapshot as snapshots
from .settings import config_string, resolve_settings
from .summary import memory_summary as format_summary

DEFAULT_SIM_CAPACITY = 16 * 1024**3


class Allocator:
    """A caching allocator policy over a device.

    ``policy``: ``"waterwave"`` (the multi-stream allocator of the Waterwave
    paper) or ``"pytorch"`` (PyTorch 2.14's native caching policy); when
    omitted, the ``policy:`` entry of ``WATERWAVE_ALLOC_CONF``, else waterwave.
    ``device``: a ``SimDevice``; by default a 16 GiB simulated GPU.
    ``config``: a PYTORCH_CUDA_ALLOC_CONF-style string; when omitted the
    ``WATERWAVE_ALLOC_CONF`` environment variable is read. Keyword arguments
    (``max_split_size_mb=200`` ...) are applied on top.
    """

    _policy_role = "allocator policy"  # what errors call the policy argument

    def __init__(self, policy: str | None = None, device: _C.SimDevice | None = None,
                 config: str | None = None, **kwargs: Any) -> None:
        policy, config = resolve_settings(policy, config, self._policy_role)
        if device is None:
            device = _C.SimDevice(DEFAULT_SIM_CAPACITY)
        self._a = _C._Allocator(policy, device, config_string(config, **kwargs))
        self.device = device

    # Allocation -----------------------------------------------------------
    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` for use on ``stream``; returns the address (0 for 0 bytes)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        return self._a.alloc(nbytes, stream)

    def free(self, ptr: int) -> None:
        """Free a pointer from ``alloc``. Unknown pointers and double frees raise PointerError."""
        self._a.free(ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark ``ptr`` as also used on ``stream`` (PyTorch's ``Tensor.record_stream``)."""
        self._a.record_stream(ptr, stream)

    def sync_and_coalesce(self) -> None:
        """Synchronize the device, mark every free block synced and coalesce."""
        self._a.sync_and_coalesce()

    def empty_cache(self) -> None:
        """Give every wholly free cached segment back to the device."""
        self._a.empty_cache()

    # Plans, per stream --------------------------------------------------------
    def set_plan(self, stream: int, slots, arena: int | None = None, scope: str = "stream") -> None:
        """Serve ``stream``'s allocations from a plan over this allocator:
        the k-th allocation of a step gets ``slots[k] = (size, offset)`` in
        an arena of ``arena`` bytes (default: the end of the last slot).
        ``scope="stream"``: the plan answers for its stream alone, so several
        streams (jobs) can each have one; ``"device"``: another stream's
        allocation leaves the plan for the step."""
        slots = [(int(s), int(o)) for s, o in slots]
        if arena is None:
            arena = max((s + o for s, o in slots), default=0)
        self._a.set_plan(stream, slots, int(arena), scope)

    def clear_plan(self, stream: int | None = None) -> None:
        """Remove ``stream``'s plan (every plan, by default); refused while its blocks live."""
        self._a.clear_plan(stream)

    def begin_step(self, stream: int | None = None) -> None:
        """The next allocation on ``stream`` is its plan's first (``stream``
        may be left out when one stream has a plan)."""
        self._a.begin_step(stream)

    def plan_stats(self, stream: int | None = None) -> dict:
        """Planned and fallback allocations, deviations and why the last one happened."""
        return self._a.plan_stats(stream)

    # Simulated GPU ----------------------------------------------------------
    def launch(self, stream: int, duration_us: float, uses: Iterable[int] = ()) -> int:
        """Queue a simulated kernel on ``stream`` that touches the allocations ``uses``."""
        return self._a.launch(stream, duration_us, list(uses))

    def synchronize(self) -> None:
        """Block the (simulated) host until all streams are idle."""
        self.device.synchronize()

    def now(self) -> float:
        """The simulated host clock in microseconds."""
        return self.device.now()

    def hazards(self) -> list[dict]:
        """Cross-stream reuse hazards the simulated device detected."""
        return self.device.hazards()

    # Introspection ------------------------------------------------------------
    def stats(self) -> dict:
        """Statistics: PyTorch's ``memory_stats()`` keys plus Waterwave's counters."""
        return self._a.stats()

    # Memory history and PyTorch's snapshot format ---------------------------
    def record_memory_history(self, enabled: Any = True,
                              max_entries: int = snapshots.DEFAULT_MAX_ENTRIES) -> None:
        """Record the allocator's events (alloc, free_requested,
        free_completed, segment_alloc/free/map/unmap, oom), keeping the newest
        ``max_entries``; ``enabled=False`` stops and drops them (torch's
        ``_record_memory_history``)."""
        self._a.record_history(*snapshots.history_settings(enabled, max_entries))

    def memory_snapshot(self) -> dict:
        """PyTorch's snapshot dict: ``segments`` and ``device_traces`` (device 0)."""
        return snapshots.build({0: self._a.snapshot()}, {0: self._a.history()})

    def dump_snapshot(self, path: str) -> None:
        """Write ``memory_snapshot()`` as the pickle PyTorch's memory viewer opens."""
        snapshots.dump(self.memory_snapshot(), path)

    def memory_summary(self, abbreviated: bool = False) -> str:
        """``stats()`` as a readable table, laid out like ``torch.cuda.memory_summary()``."""
        return format_summary(self.stats(), f"Waterwave memory summary, simulated device, "
                              f"policy '{self.policy}'", self._a.policy, abbreviated)

    def reset_peak_stats(self) -> None:
        self._a.reset_peak_stats()

    def snapshot(self) -> list[dict]:
        """Segments and their blocks, in address order."""
        return self._a.snapshot()

    def check_invariants(self) -> None:
        """Raise InvariantError if any internal invariant is broken."""
        self._a.check_invariants()

    def allocation_size(self, ptr: int) -> int:
        return self._a.allocation_size(ptr)

    @property
    def policy(self) -> str:
        return self._a.policy

    @property
    def config(self) -> str:
        return self._a.config

    def __repr__(self) -> str:
        s = self.stats()
        return (f"Allocator(policy={self.policy!r}, allocated={s['allocated_bytes.all.current']}, "
                f"reserved={s['reserved_bytes.all.current']})")


class PlanAllocator(Allocator):
    """Replays an offline plan: the k-th allocation of a step gets the k-th
    planned offset inside one arena; frees are no-ops for planned blocks.
    Any deviation sends the rest of the step to the ``fallback`` policy and
    is counted in ``plan_stats()``; memory is never handed out twice. The
    plan is the whole device's step: an allocation on another stream than
    ``stream`` leaves it for the step.

    ``plan``: a list of ``(size, offset)`` slots with ``arena`` given (else
    the end of the last slot), or a ``waterwave.planner.Plan`` with the
    ``graph`` it was made for (its ``allocation_slots(graph)`` give them).
    """

    _policy_role = "fallback policy"

    def __init__(self, plan, device: _C.SimDevice | None = None, fallback: str = "waterwave",
                 stream: int = 0, config: str | None = None, arena: int | None = None,
                 graph=None, **kwargs: Any) -> None:
        if isinstance(plan, (list, tuple)):
            slots = [(int(s), int(o)) for s, o in plan]
            if arena is None:
                arena = max((s + o for s, o in slots), default=0)
        else:
            if graph is None:
                raise ValueError("PlanAllocator needs the graph the plan was made for "
                                 "(graph=...) to know the allocation sequence")
            slots, arena = plan.allocation_slots(graph)
        super().__init__(fallback, device, config, **kwargs)
        self.set_plan(stream, slots, arena, scope="device")
        self.stream = stream
        self.slots = slots

    @property
    def policy(self) -> str:
        return "plan"

    @property
    def fallback(self) -> str:
        """The online policy under the plan."""
        return self._a.policy
