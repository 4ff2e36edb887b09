"""The NodeGroup pipeline (the Waterwave paper, sections 4.3 and 4.4), below
both what runs it on tensors (``waterwave.exec``) and what simulates it
(``waterwave.sim``):

- ``nodegroups``: a job's step cut into node groups;
- ``pairing``: groups paired into rounds (Algorithm 1, and ours under a
  memory budget), planned a window at a time;
- ``counter_barrier``: holds a group until the rounds before it finish;
- ``round_feed``: hands each job its rounds as the run reaches them;
- ``schedules``: the one table of schedules, each a cut and a pairing;
- ``pass_profile``: what a ``waterwave.sharing`` member's passes need, its
  gates cut by the same measure of bytes as node groups.

May import: waterwave.graph.
"""
from .schedules import SCHEDULES, Schedule, schedule  # noqa: F401
