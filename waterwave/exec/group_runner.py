"""Running a captured step's FX graph one node group at a time, in a
partition's order, each value dropped after its last use as eager PyTorch
frees it: what each job of the NodeGroup pipeline runs between barrier waits.

May import: waterwave.pipeline, this package; torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.nodegroups import Partition
from .step import CapturedStep


@dataclass
class _Stage:
    """A group's FX nodes and the values to drop once it has run."""
    nodes: list
    drop_after: dict  # node -> values whose last use it is


class GroupRunner:
    """Runs a captured step's FX graph group by group, in the partition's
    order, dropping each value after its last use (as eager PyTorch frees)."""

    def __init__(self, step: CapturedStep, part: Partition):
        g = step.graph
        # Run node by node (run_group), so a new hyperparameter needs no recompile.
        self.module = step.reorder([g.nodes[v].name for v in part.order], compiled=False)
        group_of = {g.nodes[v].name: k for k, grp in enumerate(part.groups) for v in grp.nodes}
        fx_graph = self.module.graph
        self.placeholders = [n for n in fx_graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in fx_graph.nodes if n.op == "output")
        calls = [n for n in fx_graph.nodes if n.op not in ("placeholder", "output")]
        # Nodes the planner's graph dropped (views) join the group of the
        # next node it kept, the one that needs them.
        assignment, pending = [], []
        for n in calls:
            pending.append(n)
            if n.name in group_of:
                assignment += [(m, group_of[n.name]) for m in pending]
                pending = []
        assignment += [(m, len(part.groups) - 1) for m in pending]
        last_use = {}
        for pos, (n, _) in enumerate(assignment):
            for a in n.all_input_nodes:
                last_use[a] = pos
        kept = set(self.placeholders) | set(self.output.all_input_nodes)
        drops: dict = {}
        for value, pos in last_use.items():
            if value not in kept:
                drops.setdefault(assignment[pos][0], []).append(value)
        self.stages = [_Stage([], {}) for _ in part.groups]
        for n, k in assignment:
            self.stages[k].nodes.append(n)
            if n in drops:
                self.stages[k].drop_after[n] = drops[n]

    def start(self, flat: list) -> dict:
        if len(flat) != len(self.placeholders):
            raise ValueError(f"the step takes {len(self.placeholders)} inputs, got {len(flat)}")
        return dict(zip(self.placeholders, flat))

    def run_group(self, k: int, env: dict) -> None:
        from torch import fx

        for n in self.stages[k].nodes:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = self._call(n, args, kwargs)
            for value in self.stages[k].drop_after.get(n, ()):
                env.pop(value, None)

    def _call(self, n, args, kwargs):
        """One FX node, as ``torch.fx.Interpreter`` runs it. A capture is
        mostly ``call_function`` (aten operators); tensors a loss closes
        over (the targets of ``models.build``'s losses) are ``get_attr``."""
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "get_attr":
            obj = self.module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.module.get_submodule(n.target)(*args, **kwargs)
        raise ValueError(f"the captured step has an FX node {n.name!r} of kind {n.op!r}, "
                         "which the trainer cannot run")

    def finish(self, env: dict):
        from torch import fx

        return fx.node.map_arg(self.output.args[0], env.__getitem__)
