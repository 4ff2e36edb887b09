"""Training jobs for the simulator: a model's captured step at any batch
size, as an eager trace on a named GPU.

Capturing a step costs seconds; a batch-size search needs dozens of sizes.
``JobModel`` captures the step twice, at ``b0`` and ``2·b0``, and gives the
graph at any batch by linear interpolation: an activation's bytes and an
operator's FLOPs are affine in the batch (same operators, same tensors);
parameters, buffers and optimizer state do not change. Where the two
captures differ in structure, ``JobModel`` captures each batch it is asked
for instead. A ``JobModel`` with a ``cache_key`` (a library model's name
and input size) keeps its captures on disk for the next run
(``capture_cache``).

A job is a model's name and a builder of ``(model, example inputs, loss)``
for a batch size (``waterwave.tools.models.build`` for the models the CLI
knows), trained with SGD with momentum 0.9 (as
bench/data/gpu-snapshots/probe.py trains).

May import: waterwave.graph, waterwave.capturing, this package; torch lazily.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from ..capturing import capture
from ..graph import Graph, round_size
from . import capture_cache
from .eager import eager_trace
from .gpus import GPU
from .kernels import NONE, KernelModel
from .trace import Trace

Builder = Callable[[int], tuple]  # batch -> (model, example inputs, loss_fn)


def capture_step(name: str, batch: int, build: Builder, cache_key: str | None = None) -> Graph:
    """The training step of ``build(batch)``, captured on the CPU with CUDA's
    kernels, named after the model; with a ``cache_key``, read from the
    capture cache when it holds it."""
    def fresh() -> Graph:
        import torch

        net, inputs, loss = build(batch)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        return capture(net, inputs, loss, opt, name=f"{name}-bs{batch}")

    if cache_key is None:
        return fresh()
    graph = capture_cache.captured(cache_key, batch, fresh)
    graph.name = f"{name}-bs{batch}"
    return graph


@dataclass
class JobModel:
    """A model's step at any batch size (see the module's opening)."""
    name: str
    build: Builder
    b0: int = 128  # a multiple of 128: fp32 activations are whole 512-byte blocks
    _pair: tuple[Graph, Graph] | None = None
    _exact: dict[int, Graph] = field(default_factory=dict)
    linear: bool = True
    # What identifies the model ``build`` makes, for the capture cache (a
    # library model's name and input size); None: captured every run.
    cache_key: str | None = None

    def _captures(self) -> tuple[Graph, Graph]:
        if self._pair is None:
            small = capture_step(self.name, self.b0, self.build, self.cache_key)
            large = capture_step(self.name, 2 * self.b0, self.build, self.cache_key)
            self.linear = _same_structure(small, large)
            self._pair = (small, large)
        return self._pair

    def graph_at(self, batch: int) -> Graph:
        if batch < 1:
            raise ValueError(f"batch size must be at least 1, got {batch}")
        small, large = self._captures()
        if not self.linear:
            if batch not in self._exact:
                self._exact[batch] = capture_step(self.name, batch, self.build, self.cache_key)
            return self._exact[batch]
        g = copy.deepcopy(small)
        g.name = f"{self.name}-bs{batch}"
        f = (batch - self.b0) / self.b0
        for t, t1 in zip(g.tensors, large.tensors):
            if t.size != t1.size:
                t.size = round_size(int(round(t.size + (t1.size - t.size) * f)))
        for n, n1 in zip(g.nodes, large.nodes):
            n.flops = int(round(n.flops + (n1.flops - n.flops) * f))
        g.meta["input_shapes"] = [[batch, *s[1:]] for s in g.meta.get("input_shapes", [])]
        return g

    def trace_at(self, batch: int, gpu: GPU | str, kernels: KernelModel = NONE,
                 stream: int = 0, partition=None) -> Trace:
        """The step at ``batch`` as an eager trace; ``partition(graph)``, if
        given, cuts it into node groups (``eager_trace``'s partition)."""
        g = self.graph_at(batch)
        return eager_trace(g, gpu, kernels, model=self.name, stream=stream,
                           name=f"{self.name}-bs{batch}",
                           partition=partition(g) if partition else None)


def _same_structure(a: Graph, b: Graph) -> bool:
    """Same operators on the same tensors, persistent ones of the same size."""
    if len(a.nodes) != len(b.nodes) or len(a.tensors) != len(b.tensors):
        return False
    for x, y in zip(a.tensors, b.tensors):
        if x.kind != y.kind or x.persistent != y.persistent or (x.persistent and x.size != y.size):
            return False
    return all(n.op == m.op and n.inputs == m.inputs and n.outputs == m.outputs
               for n, m in zip(a.nodes, b.nodes))
