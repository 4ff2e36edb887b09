"""The allocator layer's Python face, over the C++ allocator stack
(csrc/alloc) in ``waterwave._C``.

- ``settings``: policy names and ``AllocatorConfig``, parsed once at the edge;
- ``allocator``: ``Allocator`` (one class for the simulator and for each CUDA
  device's stack) and ``PlanAllocator``;
- ``torch_bridge``: builds what makes out of memory torch's own error;
- ``summary``, ``snapshot``: torch-shaped statistics tables and snapshots.

``waterwave.cuda`` (torch-named functions over a CUDA device's allocator,
``install_allocator``) and ``waterwave.cupy`` sit on top of this package.

May import: waterwave._C only. Nothing here imports the planner: plans
arrive as data, (size, offset) slots and an arena.
"""
from .._C import AllocatorConfig  # noqa: F401
from .allocator import Allocator, PlanAllocator  # noqa: F401
from .settings import POLICIES, config_string, fraction_allowing, parse_config  # noqa: F401
