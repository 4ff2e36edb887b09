"""Simulation on the simulated GPU (``SimDevice``): workloads driven through
the allocator stack, and the demo ``make demo`` runs.

- ``workloads``: synthetic training jobs on streams of a simulated GPU;
- ``demo``: two out-of-phase jobs under both policies, side by side.

May import: waterwave.alloc, waterwave.planner, waterwave._C.
"""
