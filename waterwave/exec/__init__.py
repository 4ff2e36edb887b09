"""Executors: what runs training steps over the planner's plans and the
allocator stack.

- ``trainer``: ``waterwave.optimize``, one model's steps in a planned order,
  its allocations served from a plan on a GPU.

May import: waterwave.planner, waterwave.alloc, waterwave._C; torch.
"""
from .trainer import Trainer, optimize  # noqa: F401
