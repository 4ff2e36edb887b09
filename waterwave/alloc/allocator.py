"""``waterwave.Allocator``: the allocator stack (``waterwave._C.AllocatorStack``,
one C++ class for every face) with Python's conveniences: settings from
arguments or the environment, PyTorch's snapshot format, a summary table.

The same class serves both faces: ``Allocator(...)`` over a simulated GPU,
and ``Allocator.for_cuda(index)``, the CUDA runtime's stack of one device
(the one PyTorch's hooks reach; ``waterwave.cuda`` calls it).

May import: waterwave._C and this package.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import _C
from .._C import AllocatorConfig
from . import snapshot as snapshots
from .settings import resolve_settings
from .summary import memory_summary as format_summary

DEFAULT_SIM_CAPACITY = 16 * 1024**3


class Allocator(_C.AllocatorStack):
    """A caching allocator policy over a device, with plans and recordings
    per stream above it.

    ``policy``: ``"waterwave"`` (the multi-stream allocator of the Waterwave
    paper) or ``"pytorch"`` (PyTorch 2.14's native caching policy); when
    omitted, the ``policy:`` entry of ``WATERWAVE_ALLOC_CONF``, else waterwave.
    ``device``: a ``SimDevice``; by default a 16 GiB simulated GPU.
    ``config``: an ``AllocatorConfig`` or a PYTORCH_CUDA_ALLOC_CONF-style
    string; when omitted ``WATERWAVE_ALLOC_CONF`` is read. Keyword settings
    (``max_split_size_mb=200`` ...) apply on top.
    """

    _policy_role = "allocator policy"  # what errors call the policy argument

    def __init__(self, policy: str | None = None, device: _C.SimDevice | None = None,
                 config: str | AllocatorConfig | None = None, **kwargs: Any) -> None:
        policy, settings = resolve_settings(policy, config, self._policy_role, **kwargs)
        if device is None:
            device = _C.SimDevice(DEFAULT_SIM_CAPACITY)
        elif not isinstance(device, _C.SimDevice):
            raise TypeError(f"device must be a waterwave.SimDevice, got {device!r}; for a GPU, "
                            "waterwave.install_allocator() makes Waterwave PyTorch's CUDA "
                            "allocator, and Allocator.for_cuda(index) is its stack")
        super().__init__(device, policy, settings)

    @classmethod
    def for_cuda(cls, index: int) -> Allocator:
        """The CUDA runtime's stack of device ``index`` (created at its first
        use, with the settings of ``waterwave.cuda.configure``)."""
        stack = cls.__new__(cls)
        _C.AllocatorStack.__init__(stack, cuda_device=index)
        return stack

    # Allocation -----------------------------------------------------------
    # The C++ methods take unsigned 64-bit values. When pybind refuses one
    # ("incompatible function arguments"), _explain names the bad value
    # instead; the checks run only then, never on the allocation path.
    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` for use on ``stream``; returns the address (0 for 0 bytes)."""
        if nbytes.__class__ is bool:  # pybind takes True as 1: a byte nobody asked for
            raise TypeError(f"the size must be a whole number of bytes, got {nbytes!r}")
        try:
            return super().alloc(nbytes, stream)
        except TypeError as e:
            if isinstance(nbytes, int) and nbytes < 0:
                raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)") from None
            _explain(e, size=nbytes, stream=stream)

    def free(self, ptr: int) -> None:
        """Free the allocation at ``ptr`` (a PointerError if it is not one)."""
        try:
            super().free(ptr)
        except TypeError as e:
            _explain(e, pointer=ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        """The allocation at ``ptr`` is also used on ``stream`` (torch's ``Tensor.record_stream``)."""
        try:
            super().record_stream(ptr, stream)
        except TypeError as e:
            _explain(e, pointer=ptr, stream=stream)

    def allocation_size(self, ptr: int) -> int:
        """The bytes handed out at ``ptr`` (a PointerError if it is not an allocation)."""
        try:
            return super().allocation_size(ptr)
        except TypeError as e:
            _explain(e, pointer=ptr)

    def clear_plan(self, stream: int | None = None) -> None:
        """Remove ``stream``'s plan (every plan, by default); refused while its
        blocks live, and for a stream that has no plan."""
        try:
            super().clear_plan(stream)
        except TypeError as e:
            _explain(e, stream=stream)

    # Plans, per stream --------------------------------------------------------
    def set_plan(self, stream: int, slots, arena: int | None = None, scope: str = "stream",
                 give_back_cache: bool = True) -> None:
        """Serve ``stream``'s allocations from a plan over this allocator:
        the k-th allocation of a step gets ``slots[k] = (size, offset)`` in
        an arena of ``arena`` bytes (default: the end of the last slot).
        ``scope="stream"``: the plan answers for its stream alone, so several
        streams (jobs) can each have one; ``"device"``: another stream's
        allocation leaves the plan for the step. ``give_back_cache``: the
        policy's wholly free cached segments go back to the device first, so
        the arena takes their place rather than adding to them.
        ``waterwave.cuda.set_plan`` has the same defaults."""
        slots = [(_unsigned(s, "slot size"), _unsigned(o, "slot offset")) for s, o in slots]
        if arena is None:
            arena = max((s + o for s, o in slots), default=0)
        self._set_plan(_unsigned(stream, "stream"), slots, _unsigned(arena, "arena"), scope,
                       give_back_cache)

    # Simulated GPU ----------------------------------------------------------
    def launch(self, stream: int, duration_us: float, uses: Iterable[int] = (),
               sm_share: float = 1.0, bw_share: float = 1.0) -> int:
        """Queue a simulated kernel on ``stream`` that touches the allocations
        ``uses``; ``sm_share`` and ``bw_share`` are the shares of the GPU it
        takes beside other streams' kernels (``SimDevice.set_concurrent_kernels``)."""
        return super().launch(stream, duration_us, list(uses), sm_share, bw_share)

    def synchronize(self) -> None:
        """Block the (simulated) host until all streams are idle."""
        self._sim("synchronize").synchronize()

    def now(self) -> float:
        """The simulated host clock in microseconds."""
        return self._sim("now").now()

    def hazards(self) -> list[dict]:
        """Cross-stream reuse hazards the simulated device detected."""
        return self._sim("hazards").hazards()

    def _sim(self, what: str) -> _C.SimDevice:
        if self.device is None:
            raise _C.ConfigError(f"{what} needs a simulated device; this allocator serves CUDA "
                                 f"device {self.cuda_device}")
        return self.device

    # Memory history and PyTorch's snapshot format ---------------------------
    def record_memory_history(self, enabled: Any = True,
                              max_entries: int = snapshots.DEFAULT_MAX_ENTRIES) -> None:
        """Record the allocator's events (alloc, free_requested,
        free_completed, segment_alloc/free/map/unmap, oom), keeping the newest
        ``max_entries``; ``enabled=False`` stops and drops them (torch's
        ``_record_memory_history``)."""
        self._record_history(*snapshots.history_settings(enabled, max_entries))

    def memory_snapshot(self) -> dict:
        """PyTorch's snapshot dict: ``segments`` and ``device_traces``."""
        index = self.cuda_device or 0
        return snapshots.build({index: self.snapshot()}, {index: self.history()})

    def dump_snapshot(self, path: str) -> None:
        """Write ``memory_snapshot()`` as the pickle PyTorch's memory viewer opens."""
        snapshots.dump(self.memory_snapshot(), path)

    def memory_summary(self, abbreviated: bool = False) -> str:
        """``stats()`` as a readable table, laid out like ``torch.cuda.memory_summary()``."""
        where = ("simulated device" if self.cuda_device is None
                 else f"CUDA memory summary, device {self.cuda_device}")
        online = _C.AllocatorStack.policy.fget(self)  # the layout follows the policy's pools
        return format_summary(self.stats(), f"Waterwave memory summary, {where}, "
                              f"policy '{self.policy}'", online, abbreviated)

    # The name this class had before torch's was taken for both faces.
    reset_peak_stats = _C.AllocatorStack.reset_peak_memory_stats

    def __repr__(self) -> str:
        s = self.stats()
        return (f"{type(self).__name__}(policy={self.policy!r}, "
                f"allocated={s['allocated_bytes.all.current']}, "
                f"reserved={s['reserved_bytes.all.current']})")


def _explain(error: TypeError, **values) -> None:
    """Raise what is wrong with the first of ``values`` (by name) that is not
    an unsigned 64-bit whole number; else ``error`` itself."""
    for what, value in values.items():
        _unsigned(value, what.replace("_", " "))
    raise error


def _unsigned(value: int, what: str) -> int:
    """``value`` as an unsigned 64-bit argument, or a ValueError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"the {what} must be a whole number, got {value!r}")
    if not isinstance(value, int):
        try:
            value = value.__index__()
        except AttributeError:
            raise TypeError(f"the {what} must be a whole number, got {value!r}") from None
    if not 0 <= value < 1 << 64:
        raise ValueError(f"the {what} must be a whole number in 0..2^64-1, got {value}")
    return value


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
                 stream: int = 0, config: str | AllocatorConfig | None = None,
                 arena: int | None = None, graph=None, **kwargs: Any) -> None:
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
    def fallback(self) -> str:
        """The online policy under the plan."""
        return _C.AllocatorStack.policy.fget(self)

    @property
    def policy(self) -> str:
        return "plan"
