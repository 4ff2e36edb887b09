"""Waterwave: a GPU memory engine for PyTorch.

The allocator stack is C++ (``waterwave._C``); the packages here are its
layers, imported one way (each package's docstring says what it may import):

- ``alloc``: the allocator's faces: ``Allocator``/``PlanAllocator`` on the
  simulated GPU, ``cuda`` (``install_allocator``) on real ones;
- ``planner``: capture a training step, its graph, plans and their checks;
- ``exec``: executors that run steps (``optimize``, ``ConcurrentTrainer``);
- ``sim``: traces (``trace``), the multi-job simulator and the demo;
- ``tools``: the command line, models by name, plots.

Everything runs without a GPU: ``SimDevice`` is a simulated GPU with virtual
memory, stream queues on a virtual clock, events, and a detector of
cross-stream reuse hazards.
"""
import sys as _sys

from ._C import (  # noqa: F401  (re-exported API)
    ConfigError,
    InvariantError,
    OutOfMemoryError,
    PointerError,
    SimDevice,
)
from .alloc import Allocator, PlanAllocator, config_string, cuda, cupy, parse_config  # noqa: F401
from .alloc.cuda import install_allocator  # noqa: F401  (imports torch only when called)
from .exec import ConcurrentTrainer, Job, optimize  # noqa: F401  (torch only when called)
from .planner import Plan, pack, plan  # noqa: F401
from .planner.capture import capture  # noqa: F401  (imports torch only when called)
from .planner.graph import Graph  # noqa: F401
from .sim import trace  # noqa: F401

# ``import waterwave.cuda`` names the one module object waterwave.alloc.cuda,
# ``import waterwave.cupy`` waterwave.alloc.cupy, ``import waterwave.trace``
# waterwave.sim.trace.
_sys.modules[__name__ + ".cuda"] = cuda
_sys.modules[__name__ + ".cupy"] = cupy
_sys.modules[__name__ + ".trace"] = trace

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
    "cuda",
    "cupy",
    "trace",
    "Graph",
    "Plan",
    "plan",
    "pack",
    "optimize",
    "Job",
    "ConcurrentTrainer",
    "install_allocator",
]
__version__ = "0.1.0"
