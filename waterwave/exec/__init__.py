"""Executors: what runs training steps over the planner's plans and the
allocator stack.

- ``step``: a model's training step, captured once and run with its real
  tensors;
- ``trainer``: ``waterwave.optimize``, one model's steps in a planned order,
  its allocations served from a plan on a GPU;
- ``sharing``: ``waterwave.sharing(model)``, any eager loop a member of
  its device's training session, gated at hooks by what its passes were
  measured needing (``pipeline.pass_profile``);
- ``job``, ``session``: ``waterwave.Job`` and its device's training
  session: ``job.train(steps)`` runs a job's steps eagerly as a sharing
  member, or, in a session with ``capture=True``, captured and paired on
  the NodeGroup pipeline;
- ``concurrent``: ``waterwave.ConcurrentTrainer``, a fixed set of jobs on
  one device, memory flowing between them, run on the NodeGroup pipeline
  (``waterwave.pipeline``: node groups, pairing, the barrier, the feed, the
  schedule table).

May import: waterwave.pipeline, waterwave.capturing, waterwave.graph,
waterwave.planner, waterwave.cuda, waterwave.alloc, waterwave._C; torch.
"""
from .concurrent import ConcurrentTrainer  # noqa: F401
from .job import Job  # noqa: F401
from .session import TrainingSession, training_session  # noqa: F401
from .sharing import sharing  # noqa: F401
from .trainer import Trainer, optimize  # noqa: F401
