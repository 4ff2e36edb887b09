"""Waterwave: a GPU memory engine for PyTorch.

The allocator core is C++ (``waterwave._C``); this package wraps it.
Everything here runs without a GPU: ``SimDevice`` is a simulated GPU with
virtual memory, stream queues on a virtual clock, events, and a detector of
cross-stream reuse hazards.
"""
from ._C import (  # noqa: F401  (re-exported API)
    ConfigError,
    InvariantError,
    OutOfMemoryError,
    PointerError,
    SimDevice,
)
from .allocator import Allocator, config_string, parse_config  # noqa: F401

__all__ = [
    "Allocator",
    "SimDevice",
    "OutOfMemoryError",
    "PointerError",
    "ConfigError",
    "InvariantError",
    "config_string",
    "parse_config",
]
__version__ = "0.1.0"
