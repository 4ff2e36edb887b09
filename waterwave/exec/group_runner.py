"""Running a captured step's FX graph one node group at a time, in a
partition's order, each value dropped after its last use as eager PyTorch
frees it: what each job of the NodeGroup pipeline runs between barrier waits.
Each group is compiled once into a function of straight-line operator calls.

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
        # Not the module's own code: each group is compiled below, and the
        # nodes holding hyperparameters read them from their patched nodes,
        # so a new hyperparameter needs no recompile.
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

        # Each group as one compiled function of straight-line calls: the
        # interpreter's per-node cost (argument mapping, dictionary lookups)
        # was a tenth of a small model's step on the CPU. Values live in a
        # list, one slot per FX node. An argument that holds one of the
        # optimizer's hyperparameters (patched into its node when a
        # scheduler changes it) is read from its node at each call, so the
        # value patched last is the one used, with no recompile.
        from torch.fx import map_arg

        self._map_arg = map_arg
        self.slot = {n: i for i, n in enumerate(fx_graph.nodes) if n.op != "output"}
        patched: dict[str, set] = {}
        for name, where, *_ in step.sites.sites:
            patched.setdefault(name, set()).add(where)
        self._groups = [self._compile(k, stage, patched) for k, stage in enumerate(self.stages)]

    def _compile(self, k: int, stage: _Stage, patched: dict[str, set]):
        from torch.fx import Node

        consts: list = []

        def const(value) -> str:
            consts.append(value)
            return f"c[{len(consts) - 1}]"

        def holds_node(a) -> bool:
            return isinstance(a, Node) or (isinstance(a, (list, tuple))
                                           and any(holds_node(x) for x in a))

        def render(a) -> str:
            if isinstance(a, Node):
                return f"e[{self.slot[a]}]"
            if not holds_node(a):  # the very object FX holds
                return const(a)
            if isinstance(a, list):  # FX's immutable_list: a list to the operator
                return "[" + ", ".join(render(x) for x in a) + "]"
            return "(" + "".join(render(x) + ", " for x in a) + ")"

        lines = ["def run(e, c=c, by_node=by_node):"]
        for n in stage.nodes:
            if n.op == "call_function" and all(key.isidentifier() for key in n.kwargs):
                live = patched.get(n.name, ())
                node = const(n) if live else ""
                parts = [f"{node}.args[{i}]" if i in live else render(a)
                         for i, a in enumerate(n.args)]
                parts += [f"{key}={node}.kwargs[{key!r}]" if key in live else f"{key}={render(v)}"
                          for key, v in n.kwargs.items()]
                lines.append(f"    e[{self.slot[n]}] = {const(n.target)}({', '.join(parts)})")
            else:
                lines.append(f"    e[{self.slot[n]}] = by_node({const(n)}, e)")
            lines += [f"    e[{self.slot[v]}] = None" for v in stage.drop_after.get(n, ())]
        lines.append("    return None")
        namespace = {"c": consts, "by_node": self._by_node}
        exec(compile("\n".join(lines), f"<waterwave node group {k}>", "exec"), namespace)
        return namespace["run"]

    def _by_node(self, n, env: list):
        map_arg, slot = self._map_arg, self.slot
        args = map_arg(n.args, lambda x: env[slot[x]])
        kwargs = map_arg(n.kwargs, lambda x: env[slot[x]])
        return self._call(n, args, kwargs)

    def start(self, flat: list) -> list:
        """The step's values, one slot per node, its inputs filled in."""
        if len(flat) != len(self.placeholders):
            raise ValueError(f"the step takes {len(self.placeholders)} inputs, got {len(flat)}")
        env: list = [None] * len(self.slot)
        for n, value in zip(self.placeholders, flat):
            env[self.slot[n]] = value
        return env

    def value(self, env: list, n):
        """Node n's value in a step's values (None once dropped)."""
        return env[self.slot[n]]

    def run_group(self, k: int, env: list) -> None:
        self._groups[k](env)

    def _call(self, n, args, kwargs):
        """One FX node, as ``torch.fx.Interpreter`` runs it. A capture is
        mostly ``call_function`` (aten operators); tensors a loss closes
        over (the targets of ``models.build``'s losses) are ``get_attr``."""
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "get_attr":
            obj = self.module.root
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.module.root.get_submodule(n.target)(*args, **kwargs)
        raise ValueError(f"the captured step has an FX node {n.name!r} of kind {n.op!r}, "
                         "which the trainer cannot run")

    def finish(self, env: list):
        return self._map_arg(self.output.args[0], lambda x: env[self.slot[x]])
