"""The planner's error: a plan that is invalid for its graph, or a plan file
that cannot be read. Its own module so that the checker (check.py), which
plan.py's slots call, imports no plan.py.

May import: nothing.
"""


class PlanError(ValueError):
    """A plan that is invalid for its graph, or a plan file that cannot be read."""
