"""The allocator layer's Python faces, over the C++ allocator stack
(csrc/alloc) in ``waterwave._C``.

- ``settings``: policy names and the config-string grammar both faces share;
- ``allocator``: ``Allocator`` and ``PlanAllocator`` on a simulated GPU;
- ``cuda``: the same stack on real GPUs, inside PyTorch (``install_allocator``);
- ``cupy``: the same stacks for CuPy (``waterwave.cupy.install()``);
- ``torch_bridge``: builds what makes out of memory torch's own error;
- ``summary``, ``snapshot``: torch-shaped statistics tables and snapshots.

May import: waterwave._C only. Nothing here imports the planner: plans
arrive as data, (size, offset) slots and an arena.
"""
from . import cuda, cupy  # noqa: F401  (cupy imports CuPy only when called)
from .allocator import Allocator, PlanAllocator  # noqa: F401
from .settings import POLICIES, config_string, parse_config  # noqa: F401
