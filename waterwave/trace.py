"""``waterwave.trace``: traces of allocations and kernels, from PyTorch
memory snapshots and captured steps, saved, loaded and replayed on the
simulated GPU. The public face of ``waterwave.sim.trace``, where they live.

May import: waterwave.sim.
"""
from .sim.eager import from_graph  # noqa: F401
from .sim.trace import Op, Trace, TraceError, from_snapshot, run_op  # noqa: F401

__all__ = ["Op", "Trace", "TraceError", "from_graph", "from_snapshot", "run_op"]
