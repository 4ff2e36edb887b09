"""Simulation on the simulated GPU (``SimDevice``): the instruments every
schedule is developed and checked on.

- ``trace``: traces from PyTorch memory snapshots and captured steps, saved,
  loaded and replayed (``waterwave.trace``);
- ``eager``, ``kernels``, ``gpus``, ``phases``: a captured step as eager PyTorch runs it on
  a named GPU, with library workspaces and first calls measured on an H100;
- ``jobs``: a model's step at any batch size;
- ``multijob``, ``schedules``, ``maxbatch``: several jobs on one GPU, each on
  its own stream, under a schedule and a policy; the largest batch.

May import: waterwave._C, waterwave.alloc, waterwave.graph, waterwave.capturing,
waterwave.pipeline (never waterwave.exec: the trainer and the simulator both
run the pipeline's schedules).
"""
