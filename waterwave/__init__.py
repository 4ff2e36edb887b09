"""Waterwave: a GPU memory engine for PyTorch.

The allocator stack is C++ (``waterwave._C``); the packages here are its
layers, imported one way (each package's docstring says what it may import):

- ``alloc``: the allocator's face: ``Allocator`` (one class for the
  simulated GPU and each CUDA device's stack), ``AllocatorConfig``;
- ``cuda``, ``cupy``: torch-named functions over a CUDA device's allocator,
  ``install_allocator``; CuPy's hook (modules of their own, over ``alloc``);
- ``trace``: the face of ``sim.trace`` (traces saved, loaded, replayed);
- ``planner``: capture a training step, its graph, plans and their checks;
- ``exec``: executors that run steps (``optimize``, ``Job``, ``sharing``,
  ``ConcurrentTrainer``), loaded at first use;
- ``sim``: traces (``trace``), the multi-job simulator and the demo;
- ``tools``: the command line, models by name, plots.

Everything runs without a GPU: ``SimDevice`` is a simulated GPU with virtual
memory, stream queues on a virtual clock, events, and a detector of
cross-stream reuse hazards.
"""
from . import cuda, cupy, trace  # noqa: F401  (cupy imports CuPy only when called)
from ._C import (  # noqa: F401  (re-exported API)
    ConfigError,
    InvariantError,
    OutOfMemoryError,
    PointerError,
    SimDevice,
)
from .alloc import (  # noqa: F401
    Allocator,
    AllocatorConfig,
    PlanAllocator,
    config_string,
    parse_config,
)
from .capturing import capture  # noqa: F401  (imports torch only when called)
from .cuda import install_allocator  # noqa: F401  (imports torch only when called)
from .graph import Graph, InputLimits, input_limits, set_input_limits  # noqa: F401
from .planner import Plan, pack, plan  # noqa: F401

__all__ = [
    "Allocator",
    "AllocatorConfig",
    "PlanAllocator",
    "SimDevice",
    "OutOfMemoryError",
    "PointerError",
    "ConfigError",
    "InvariantError",
    "config_string",
    "parse_config",
    "capture",
    "cuda",
    "cupy",
    "trace",
    "Graph",
    "InputLimits",
    "input_limits",
    "set_input_limits",
    "Plan",
    "plan",
    "pack",
    "optimize",
    "Job",
    "ConcurrentTrainer",
    "TrainingSession",
    "training_session",
    "sharing",
    "install_allocator",
]
__version__ = "0.1.0"

# The executors load at first use: ``import waterwave.graph`` (or the
# allocator alone) does not import them.
_EXECUTORS = ("ConcurrentTrainer", "Job", "TrainingSession", "optimize", "sharing",
              "training_session")


def __getattr__(name: str):
    if name in _EXECUTORS:
        from . import exec as executors

        value = getattr(executors, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'waterwave' has no attribute {name!r}")
