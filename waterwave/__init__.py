"""Waterwave: a GPU memory engine for PyTorch.

The allocator core is C++ (``waterwave._C``); this package wraps it.
Everything here runs without a GPU: ``SimDevice`` is a simulated GPU with
virtual memory, stream queues on a virtual clock, events, and a detector of
cross-stream reuse hazards. On a GPU, ``install_allocator()`` makes PyTorch
allocate through Waterwave (``waterwave.cuda``).
"""
from ._C import (  # noqa: F401  (re-exported API)
    ConfigError,
    InvariantError,
    OutOfMemoryError,
    PointerError,
    SimDevice,
)
from .allocator import Allocator, PlanAllocator, config_string, parse_config  # noqa: F401
from .capture import capture  # noqa: F401  (imports torch only when called)
from .cuda import install_allocator  # noqa: F401  (imports torch only when called)
from .graph import Graph  # noqa: F401
from .planner import Plan, pack, plan  # noqa: F401
from .runtime import optimize  # noqa: F401

__all__ = [
    "Allocator",
    "PlanAllocator",
    "SimDevice",
    "OutOfMemoryError",
    "PointerError",
    "ConfigError",
    "InvariantError",
    "config_string",
    "parse_config",
    "capture",
    "Graph",
    "Plan",
    "plan",
    "pack",
    "optimize",
    "install_allocator",
]
__version__ = "0.1.0"
