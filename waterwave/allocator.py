"""The Python face of the allocator core: ``waterwave.Allocator``."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from . import _C

DEFAULT_SIM_CAPACITY = 16 * 1024**3
ENV_VAR = "WATERWAVE_ALLOC_CONF"
POLICIES = ("waterwave", "pytorch")


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return str(value)
    try:
        parts = [f"{k}:{v}" for k, v in items]
    except (TypeError, ValueError):
        raise _C.ConfigError(
            f"allocator config: {key} takes an int or a mapping of interval (MiB) to "
            f"divisions, e.g. {{256: 1, '>': 4}}; got {value!r}"
        ) from None
    return "[" + ",".join(parts) + "]"


def config_string(config: str | None = None, **kwargs: Any) -> str:
    """Join a PYTORCH_CUDA_ALLOC_CONF-style string and keyword settings.

    ``config_string("max_split_size_mb:200", roundup_power2_divisions={256: 1, ">": 4})``
    gives ``"max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4]"``.
    Keywords override keys of the string (they come later).
    """
    parts = [config] if config else []
    parts += [f"{k}:{_format_value(k, v)}" for k, v in kwargs.items()]
    return ",".join(parts)


def parse_config(config: str) -> str:
    """Validate a config string; returns its canonical form or raises ConfigError."""
    return _C.parse_config(config)


def split_policy(config: str) -> tuple[str | None, str]:
    """Take the ``policy:NAME`` entry out of a config string:
    ``"policy:pytorch,max_split_size_mb:200"`` → ``("pytorch", "max_split_size_mb:200")``."""
    policy, rest = None, []
    for entry in re.split(r",(?![^\[]*\])", config):  # commas inside [...] belong to a value
        key, _, value = entry.partition(":")
        if key.strip() == "policy":
            policy = value.strip()
        elif entry.strip():
            rest.append(entry.strip())
    return policy, ",".join(rest)


def resolve_settings(policy: str | None, config: str | None,
                     role: str = "allocator policy") -> tuple[str, str]:
    """The policy and config string to use. The config is the argument, else
    ``WATERWAVE_ALLOC_CONF``; its ``policy:`` entry picks the policy unless
    the argument does; the default is ``waterwave``."""
    config_policy, config = split_policy(os.environ.get(ENV_VAR, "") if config is None else config)
    policy = policy or config_policy or "waterwave"
    if policy not in POLICIES:
        raise _C.ConfigError(f"unknown {role} {policy!r}: choose one of {', '.join(POLICIES)} "
                             f"(in {ENV_VAR} write e.g. policy:waterwave)")
    return policy, config


def _prepare(policy: str | None, device, config, role: str = "allocator policy"):
    """Resolve the policy and config (see resolve_settings); default the device."""
    policy, config = resolve_settings(policy, config, role)
    if device is None:
        device = _C.SimDevice(DEFAULT_SIM_CAPACITY)
    return policy, device, config


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

    def __init__(self, policy: str | None = None, device: _C.SimDevice | None = None,
                 config: str | None = None, **kwargs: Any) -> None:
        policy, device, config = _prepare(policy, device, config)
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
    is counted in ``plan_stats()``; memory is never handed out twice.

    ``plan``: a ``waterwave.planner.Plan`` (its allocation sequence is the
    order's outputs, in order) or a list of ``(size, offset)`` slots with
    ``arena`` given.
    """

    def __init__(self, plan, device: _C.SimDevice | None = None, fallback: str = "waterwave",
                 stream: int = 0, config: str | None = None, arena: int | None = None,
                 graph=None, **kwargs: Any) -> None:
        fallback, device, config = _prepare(fallback, device, config, role="fallback policy")
        if isinstance(plan, (list, tuple)):
            slots = [(int(s), int(o)) for s, o in plan]
            if arena is None:
                arena = max((s + o for s, o in slots), default=0)
        else:
            if graph is None:
                raise ValueError("PlanAllocator needs the graph the plan was made for "
                                 "(graph=...) to know the allocation sequence")
            slots, arena = plan_slots(graph, plan)
        self._a = _C._Allocator(device, slots, int(arena), stream, fallback,
                                config_string(config, **kwargs))
        self.device = device
        self.slots = slots

    def begin_step(self) -> None:
        """The next allocation is the first of a training step."""
        self._a.begin_step()

    def plan_stats(self) -> dict:
        return self._a.plan_stats()


def plan_slots(graph, plan) -> tuple[list[tuple[int, int]], int]:
    """The allocation sequence a step makes under ``plan``: the outputs of
    each node in the plan's order (except those written in place into an
    input, which allocate nothing), with their planned offsets (relative to
    the arena of non-persistent tensors, which starts after the persistent
    block)."""
    from .planner.lifetimes import allocation_events

    base = min((plan.offsets[t.id] for t in graph.tensors if not t.persistent and t.size),
               default=0)
    slots = [(graph.tensors[t].size, plan.offsets[t] - base)
             for kind, t in allocation_events(graph, plan.order, plan.inplace) if kind == "alloc"]
    arena = max((o + s for s, o in slots), default=0)
    return slots, arena
