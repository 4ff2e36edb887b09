"""A traced training step as a ``waterwave.graph.Graph``:

- tensors are storages (``StorageWeakRef``), so views and aliases add no
  tensor and extend their base's lifetime;
- in-place writes come from each operator's schema (``alias_info.is_write``,
  and ``UNMARKED_WRITES`` where a schema marks none), and add the ordering
  edges they need;
- ``inplace_ok``: a pointwise operator's ``self`` input, where the operator
  has an in-place overload that can take its place (``inplace_variant``:
  same shape, dtype and contiguous layout, the whole storage, not a graph
  input), so that the runtime can run any planned in-place pair in place;
- multi-output operators create all their outputs at once;
- parameters, buffers and optimizer state are persistent; gradients are
  tensors of kind ``grad`` made by the backward pass and consumed by the
  update;
- sizes are storage bytes rounded to 512, as PyTorch's CUDA caching
  allocator rounds them.

May import: waterwave.graph; torch lazily.
"""
from __future__ import annotations

from ..graph import Graph, round_size


def inplace_variant(target):
    """The in-place overload of a functional aten operator (``aten.add.Tensor``
    -> ``aten.add_.Tensor``) whose first argument is the tensor it writes, or
    None."""
    import torch

    packet = getattr(target, "overloadpacket", None)
    overload_name = getattr(target, "_overloadname", None)
    if packet is None or overload_name is None or packet.__name__.endswith("_"):
        return None
    try:
        overload = getattr(getattr(torch.ops.aten, packet.__name__ + "_"), overload_name)
    except (AttributeError, RuntimeError):
        return None
    args = overload._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if not isinstance(args[0].type, torch.TensorType):
        return None
    return overload


# Operators that update running statistics in place (when training) though
# their schemas mark no write: ATen's instance_norm, among others, calls them
# on a repeat of the running mean and averages it afterwards, and without
# this ordering edge a reordered step averaged it before the update (the
# running statistics never moved). Overload name -> (written, training flag).
UNMARKED_WRITES = {f"{op}.default": (("running_mean", "running_var"), "training")
                   for op in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")}


class _GraphBuilder:
    """Turns a traced step into a Graph, one FX node at a time. Tensors are
    storages: the first time a storage is seen it becomes a tensor (of the
    placeholder's role, or an activation or gradient made by a node)."""

    def __init__(self, name: str, meta: dict, grads_seen):
        import torch

        from torch.multiprocessing.reductions import StorageWeakRef

        self.torch, self.ref = torch, StorageWeakRef
        self.g = Graph(name, meta)
        self.tensor_of: dict = {}  # StorageWeakRef -> tensor id
        self.keep_alive = []  # hold storages so that weak refs are not reused
        self.grad_refs = {StorageWeakRef(t.untyped_storage()) for t in grads_seen
                          if isinstance(t, torch.Tensor)}
        self.last_writer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}

    def storages_of(self, val) -> list:
        """(StorageWeakRef, bytes) of each tensor in a value or nested sequence."""
        out = []
        if isinstance(val, self.torch.Tensor):
            st = val.untyped_storage()
            self.keep_alive.append(st)
            out.append((self.ref(st), st.nbytes()))
        elif isinstance(val, (list, tuple)):
            for v in val:
                out.extend(self.storages_of(v))
        return out

    def arg_storages(self, arg) -> list:
        out = []
        if isinstance(arg, self.torch.fx.Node):
            out.extend(self.storages_of(arg.meta.get("val")))
        elif isinstance(arg, (list, tuple)):
            for a in arg:
                out.extend(self.arg_storages(a))
        elif isinstance(arg, dict):
            for a in arg.values():
                out.extend(self.arg_storages(a))
        return out

    def known(self, arg, once: bool = True) -> list[int]:
        """The tensors an argument holds, in order (``once``: each once)."""
        out = []
        for r, _ in self.arg_storages(arg):
            t = self.tensor_of.get(r)
            if t is not None and not (once and t in out):
                out.append(t)
        return out

    def add_placeholders(self, placeholders, roles, names) -> None:
        for node, role, nm in zip(placeholders, roles, names):
            for ref, nbytes in self.storages_of(node.meta.get("val")):
                if ref not in self.tensor_of:
                    self.tensor_of[ref] = self.g.add_tensor(nm, round_size(nbytes), role,
                                                            persistent=role != "input")

    def mutated(self, node) -> list[int]:
        """Tensors the node writes in place, from its schema's alias info,
        and the running statistics of the batch norms whose schemas do not
        say they write them (``UNMARKED_WRITES``)."""
        out = []
        schema = getattr(node.target, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        for i, a in enumerate(arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                out.extend(self.known(val, once=False))
        unmarked = UNMARKED_WRITES.get(getattr(node.target, "__name__", ""))
        if unmarked is not None:
            written, training = unmarked
            values = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                      for i, a in enumerate(arguments)}
            if values.get(training):
                for name in written:
                    out.extend(self.known(values.get(name), once=False))
        return out

    def new_outputs(self, node) -> list[int]:
        """Tensors the node creates; views, aliases and in-place results add none."""
        outs = []
        for r, nbytes in self.storages_of(node.meta.get("val")):
            if r in self.tensor_of or nbytes == 0:
                continue
            kind = "grad" if r in self.grad_refs else "activation"
            self.tensor_of[r] = self.g.add_tensor(node.name, round_size(nbytes), kind)
            outs.append(self.tensor_of[r])
        return outs

    def inplace_candidates(self, node, outs: list[int]) -> list[int]:
        """The node's first input, if a pointwise in-place overload could
        write its output there: same shape, dtype and contiguous layout, the
        whole storage, not persistent and not a graph input."""
        torch = self.torch
        if not (torch.Tag.pointwise in getattr(node.target, "tags", ()) and len(outs) == 1
                and node.args and isinstance(node.args[0], torch.fx.Node)
                and inplace_variant(node.target) is not None):
            return []
        mine, made = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(mine, torch.Tensor) and isinstance(made, torch.Tensor)
                and mine.shape == made.shape and mine.dtype == made.dtype
                and mine.is_contiguous() and made.is_contiguous() and mine.storage_offset() == 0
                and mine.untyped_storage().nbytes() == made.untyped_storage().nbytes()):
            return []
        t = self.tensor_of.get(self.ref(mine.untyped_storage()))
        if t is None or self.g.tensors[t].persistent or self.g.tensors[t].kind == "input":
            return []
        return [t]

    def add_call(self, node) -> None:
        ins = self.known(list(node.args) + list(node.kwargs.values()))
        mutated = self.mutated(node)
        outs = self.new_outputs(node)
        if not outs and not mutated:
            return  # pure views and metadata ops move no memory
        v = len(self.g.nodes)
        deps = {self.last_writer[t] for t in ins if t in self.last_writer}  # read after write
        for t in mutated:
            deps.update(self.readers.get(t, []))  # write after read
        deps.discard(v)
        self.g.add_node(node.name, str(node.target), ins, outs, mutated, sorted(deps),
                        self.inplace_candidates(node, outs), _flops(node), _attrs(node))
        for t in ins:
            self.readers.setdefault(t, []).append(v)
        for t in mutated:
            self.last_writer[t] = v
            self.readers[t] = []


_CONV_WEIGHT_ARG = {"convolution": 1, "convolution_backward": 2}


def _vals(x):
    """A node argument with FX nodes replaced by their (fake) values."""
    import torch

    return torch.fx.node.map_arg(x, lambda n: n.meta.get("val"))


def _flops(node) -> int:
    """The node's floating-point operations by torch's flop counter (0 where
    it does not know the operator: pointwise work is bandwidth, not FLOPs)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    fn = flop_registry.get(packet)
    if fn is None:
        return 0
    try:
        return int(fn(*_vals(node.args), out_val=node.meta.get("val"), **_vals(node.kwargs)))
    except Exception:  # an overload the counter's formula does not take: no estimate
        return 0


def _attrs(node) -> dict:
    """Shape facts the simulator needs: a convolution's kernel size."""
    packet = getattr(node.target, "overloadpacket", None)
    k = _CONV_WEIGHT_ARG.get(getattr(packet, "__name__", ""))
    if k is None or len(node.args) <= k:
        return {}
    weight = _vals(node.args[k])
    shape = list(getattr(weight, "shape", ()))
    return {"kernel": [int(d) for d in shape[2:]]} if len(shape) > 2 else {}


def graph_from_trace(gm, roles, names, grads_seen, name: str, meta: dict) -> Graph:
    """Turn a traced step into a Graph; node names are the FX node names."""
    b = _GraphBuilder(name, meta, grads_seen)
    b.add_placeholders([n for n in gm.graph.nodes if n.op == "placeholder"], roles, names)
    outputs = []
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = b.known(node.args)
        elif node.op == "call_function":
            b.add_call(node)
    b.g.meta["outputs"] = sorted(set(outputs))
    b.g.validate()
    return b.g
