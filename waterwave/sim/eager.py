"""A captured training step as eager PyTorch runs it on a GPU: the trace a
job's thread produces, operator by operator.

- Persistent memory where eager PyTorch makes it: the batch first (the jobs
  keep it on the GPU, as bench/data/gpu-snapshots/probe.py does), then the
  parameters and buffers; in the first step, each optimizer state tensor
  right before its first use, and the cuBLAS and cuBLASLt workspaces of the
  job's stream (``gpus.py``) before the first matrix product.
- Then, in program order (the order autograd ran while tracing), each
  operator allocates its outputs and its workspaces (``kernels.py``),
  launches its kernel, and frees its workspaces and the tensors it used
  last: PyTorch frees when the host drops the last reference, at scheduling
  time, not when the kernel ends (Waterwave paper, section 3.1).
- Each kernel's time is its roofline on the named GPU (``GPU.kernel_us``:
  FLOPs from the capture, bytes its inputs and outputs); convolutions use
  tensor cores (TF32). Each operator costs the host ``cpu_us``, and a
  library operator's first call in a thread more (``kernels.py``).
- Phases: ``forward`` up to the loss, ``optimizer`` from the first in-place
  update of a parameter or optimizer state, ``backward`` between.

May import: waterwave.graph, this package.
"""
from __future__ import annotations

from ..graph import Graph
from ..graph.lifetimes import lifetimes
from .gpus import GPU
from .gpus import gpu as named_gpu
from .kernels import NONE, KernelModel
from .phases import phases
from .trace import Op, Trace

CPU_US = 10.0  # host time per operator: PyTorch's dispatch and kernel launch
TENSOR_CORE_OPS = ("aten.convolution", "aten.convolution_backward")
BLAS_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
BLAS_LIBRARIES = 2  # cuBLAS and cuBLASLt
# A kernel's threads, for its SM share (gpus.GPU.kernel_shares): one per
# output element of 4 bytes (float32; a float16 graph's kernels have twice
# as many, so its shares are understated by up to half).
ELEMENT_BYTES = 4


def batch_size(g: Graph) -> int | None:
    """The captured batch: the first input's leading dimension."""
    shapes = g.meta.get("input_shapes") or []
    return int(shapes[0][0]) if shapes and shapes[0] else None


def eager_trace(g: Graph, gpu: GPU | str = "H100-80GB", kernels: KernelModel = NONE,
                model: str | None = None, stream: int = 0, cpu_us: float = CPU_US,
                name: str | None = None, partition=None) -> Trace:
    """One training step of ``g`` as a trace on ``stream`` (see the module's
    opening). ``model`` names the measured kernel table to use, if any.
    With a ``partition`` (``waterwave.pipeline.nodegroups``) the operators run in
    its order, and ``meta["groups"]`` holds each node group's operators as
    ``[first, end, bytes]`` (end exclusive)."""
    order = list(partition.order) if partition is not None else list(range(len(g.nodes)))
    spec = named_gpu(gpu) if isinstance(gpu, str) else gpu
    batch = batch_size(g)
    t = Trace(name or g.name, meta={"source": "capture", "graph": g.name, "gpu": spec.name,
                                     "batch_size": batch, "model": model,
                                     "kernels": kernels.source})
    first_use = {}
    for node in (g.nodes[v] for v in order):
        for x in (*node.inputs, *node.mutates):
            first_use.setdefault(x, node.id)
    for kinds in (("input",), ("param", "buffer")):
        t.persistent += [(x.id, x.size, stream, -1) for x in g.tensors
                         if x.kind in kinds and x.size]
    t.persistent += [(x.id, x.size, stream, first_use.get(x.id, 0)) for x in g.tensors
                     if x.kind == "optimizer_state" and x.size]
    next_block = len(g.tensors)
    first_blas = next((v for v in order if g.nodes[v].op.rsplit(".", 1)[0] in BLAS_OPS), None)
    for _ in range(BLAS_LIBRARIES if first_blas is not None else 0):
        t.persistent.append((next_block, spec.blas_workspace, stream, first_blas))
        next_block += 1
    kept = {x.id for x in g.tensors if x.persistent or x.kind == "input"}
    last = {}
    for x, (_, end) in zip(g.tensors, lifetimes(g, order)):
        if x.id not in kept and x.size:
            last.setdefault(order[end], []).append(x.id)
    first_op = {}  # node -> its first operator in the trace
    phase_of = phases(g)
    for node, phase in ((g.nodes[v], phase_of[v]) for v in order):
        first_op[node.id] = len(t.ops)
        nbytes = sum(g.tensors[x].size for x in (*node.inputs, *node.outputs))
        tensor_cores = node.op.rsplit(".", 1)[0] in TENSOR_CORE_OPS
        gpu_us = spec.kernel_us(node.flops, nbytes, tensor_cores)
        out_bytes = sum(g.tensors[x].size for x in node.outputs)
        sm, bw = spec.kernel_shares(nbytes, gpu_us, out_bytes / ELEMENT_BYTES)
        outputs = [(x, g.tensors[x].size) for x in node.outputs if g.tensors[x].size]
        sizes = kernels.workspaces(g, node, model, batch)
        first_us = kernels.first_us(g, node, model)
        frees = last.get(node.id, [])
        uses = [x for x in node.inputs if g.tensors[x].size and x not in frees]
        # A kernel per workspace, as cuDNN runs them: convolution_backward
        # makes grad_input with one workspace, then grad_weight with another.
        parts = max(1, len(sizes))
        for k in range(parts):
            op = Op(node.name, stream, phase, gpu_us=round(gpu_us / parts, 3),
                    cpu_us=cpu_us if k == 0 else 0.0,
                    first_us=first_us if k == 0 else 0.0, sm=sm, bw=bw)
            op.alloc = outputs[k:k + 1] if k < parts - 1 else outputs[k:]
            if k < len(sizes):
                op.alloc = [*op.alloc, (next_block, sizes[k])]
                op.free.append(next_block)
                next_block += 1
            op.use = [*uses, *(frees if k < parts - 1 else ())]
            if k == parts - 1:
                op.free += frees
            t.ops.append(op)
    t.persistent = [(b, n, st, first_op[at] if at >= 0 else at) for b, n, st, at in t.persistent]
    if partition is not None:
        ends = [first_op[grp.nodes[0]] for grp in partition.groups[1:]] + [len(t.ops)]
        t.meta["groups"] = [[first_op[grp.nodes[0]], end, grp.delta]
                            for grp, end in zip(partition.groups, ends)]
        t.meta["partition"] = {"how": partition.how, "split_size": partition.split_size,
                               "peak": partition.peak}
    t.validate()
    return t


# Captured steps ---------------------------------------------------------------
def from_graph(graph, gpu: str = "H100-80GB", kernels=None, model: str | None = None,
               stream: int = 0) -> Trace:
    """A captured training step (``waterwave.capturing``) as eager PyTorch runs
    it on ``gpu`` (``eager.eager_trace``). ``kernels``: a ``KernelModel``,
    by default the one measured on the H100 (measured tables for the
    ``model`` named, else its rules)."""
    return eager_trace(graph, gpu, kernels or KernelModel.load(), model=model, stream=stream)
