"""Where each hyperparameter sits in a traced update: the update is traced
with a unique sentinel for each constant, ``ConstantSites`` notes where each
landed, and before a step whose groups hold other values those nodes get the
new ones (a scheduler's lr, say), exactly, in the operator forms eager
PyTorch uses.

May import: this package.
"""
from __future__ import annotations

from .rule import OptimizerError

SENTINEL = -987654.25  # and below it, one for each constant: no graph holds these


def sentinels(real: list[dict[str, float]]) -> list[dict[str, float]]:
    """A value for each constant that nothing else in a graph holds, to
    trace the update with and find each constant's place after."""
    out, n = [], 0
    for consts in real:
        out.append({})
        for key in consts:
            out[-1][key] = SENTINEL - n
            n += 1
    return out


class ConstantSites:
    """Where each group's constants sit in a traced graph: (node name, arg
    index or kwarg name) for each (group, constant)."""

    def __init__(self, graph, traced_with: list[dict[str, float]]):
        lookup = {v: (k, key) for k, consts in enumerate(traced_with) for key, v in consts.items()}
        self.sites: list[tuple[str, int | str, int, str]] = []
        for node in graph.nodes:
            places = [*enumerate(node.args), *node.kwargs.items()]
            for where, a in places:
                if not isinstance(a, float):
                    continue
                if a in lookup:
                    self.sites.append((node.name, where, *lookup[a]))
                elif abs(a - SENTINEL) < 100_000:
                    # A value torch derived from a sentinel inside an operator's
                    # Python: it could not be patched, so the step would run with it.
                    raise OptimizerError(f"the optimizer's update traced a constant derived "
                                         f"from a hyperparameter ({node.name}: {a}); this "
                                         "optimizer cannot be captured")

    def patch(self, graph, values: list[dict[str, float]]) -> None:
        """Put ``values`` in their places in ``graph`` (the traced graph, or
        one with its node names, as ``CapturedStep.reorder`` makes)."""
        nodes = {n.name: n for n in graph.nodes}
        for name, where, k, key in self.sites:
            node = nodes.get(name)
            if node is None:
                continue
            if isinstance(where, int):
                args = list(node.args)
                args[where] = values[k][key]
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, where: values[k][key]}
