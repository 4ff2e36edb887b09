"""Traces reused across models of the same structure: the trials of a
search that differ only in their hyperparameters (a learning rate, a weight
decay, a seed) trace the same training step, and tracing is most of what
making a ``Job`` costs (0.1-0.3 s for a digits MLP, more than its whole
eager trial).

A trace holds what a step's code did with the model it traced, so it serves
another model only where nothing it fixed can differ:

- the same module tree (names, classes, train or eval modes), the same
  parameters and buffers (places, dtypes, shapes, strides, devices, which
  are trained), no hooks anywhere (``guards.model_structure``);
- the same attributes read by the modules' code, each plain (a number, a
  string, a dtype: not a tensor, not an object) and equal
  (``guards.plain_reads``): a dropout's ``p``, a flag;
- the same loss (the same function object, or a loss module as above);
- the same optimizer class, update structure, per-group options other than
  its numbers, and step layout: the numbers themselves (a learning rate,
  betas) are traced as sentinels and put in each step's graph
  (``optimizers.ConstantSites``), so they may differ;
- the same example inputs and targets (shapes, strides, dtypes, devices), the same
  clipping, accumulation, autocast and gradient scaling.

Anything else (a model whose code reads an object or a tensor attribute, a
loss made per trial) is traced for itself, as before. A value the code reads
from a module-level global is not checked, across models as within one
model's steps (``guards``): a search that changes such a global between
trials must pass it as an attribute or an argument instead. Each model that takes
a trace from here gets its own copy of the graph, its own constants put in
(its own tensors where the trace holds the traced model's: a frozen
parameter is a constant of the step, not an input), and its own
``StepGuard``, so it is checked before every step exactly as a model that
traced itself.

May import: this package; torch lazily.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from . import guards, optimizers
from .fake_step import check_step, trace_step

MAX_ENTRIES = 32  # traces kept, least recently used dropped first


@dataclass
class Reads:
    """What ``guards.AttributeReads`` reports of a trace, for the model that
    takes it: the attributes read, those the step sets (with their markers)
    and those read and then set to a tensor."""
    read: list
    outputs: list
    tensor_state: list = field(default_factory=list)


@dataclass
class _Entry:
    gm: object
    roles: list
    names: list
    grads: list
    sites: optimizers.ConstantSites
    read: list
    values: tuple        # the read attributes' comparable values
    outputs: list        # (module name, attribute, marker)
    # The graph's constants that are the traced model's own tensors (a
    # frozen parameter is a constant of the step, not an input): (their
    # stand-ins in ``gm``, meta tensors holding no memory, (module name,
    # attribute)), each replaced by the taking model's own tensor.
    own: list = field(default_factory=list)


class TraceCache:
    """The process's traces by structure (see the module's opening),
    bounded and shared by every thread."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()  # key -> [_Entry, ...]
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def stats(self) -> dict:
        with self._lock:
            return {"entries": sum(len(v) for v in self._entries.values()),
                    "hits": self.hits, "misses": self.misses}

    def trace(self, model, example_inputs, loss_fn, optimizer, example_targets=(), clip=None,
              micro_batches: int = 1, autocast_dtype=None, grad_scaler=None):
        """``trace_step``'s (gm, roles, names, grads, sites) for ``model``,
        and its ``Reads``: from a trace of a model like it where one is kept,
        else traced now (and kept where another model may take it). The
        second item says whether it was reused."""
        modules = guards.guarded_modules(model, loss_fn)
        # What a trace refuses is refused before one is taken from here too.
        shapes, scaling, layout, clipping, _ = check_step(
            model, example_inputs, loss_fn, optimizer, example_targets, clip, micro_batches,
            autocast_dtype, grad_scaler)
        key = step_key(model, example_inputs, example_targets, loss_fn, optimizer,
                       (shapes, scaling, layout, clipping, micro_batches, autocast_dtype))
        if key is not None:
            hit = self._find(key, modules)
            if hit is not None:
                # The model's own tensors where the trace had the traced
                # model's (a frozen layer's weights), not copies of them.
                gm = copy.deepcopy(hit.gm, {id(stand_in): _tensor_of(modules, *where)
                                            for stand_in, where in hit.own})
                # Its graph takes this optimizer's numbers. Its code is not
                # regenerated: a step runs reordered copies of the graph,
                # never this module's code (CapturedStep.modules).
                hit.sites.patch(gm.graph, optimizers.constants(optimizer))
                outputs = [(modules[name], attr, marker) for name, attr, marker in hit.outputs]
                return ((gm, list(hit.roles), list(hit.names), list(hit.grads), hit.sites),
                        Reads(list(hit.read), outputs)), True
        with guards.AttributeReads(modules) as reads:
            traced = trace_step(model, example_inputs, loss_fn, optimizer, example_targets, clip,
                                micro_batches, autocast_dtype, grad_scaler)
        found = Reads(reads.read, reads.outputs, reads.tensor_state)
        values = guards.plain_reads(modules, reads.read)
        names = {id(m): name for name, m in modules.items()}
        if (key is not None and values is not None and not reads.tensor_state
                and all(id(m) in names for m, _, _ in reads.outputs)):
            gm, roles, step_names, grads, sites = traced
            outputs = [(names[id(m)], attr, marker) for m, attr, marker in reads.outputs]
            own = _own_constants(gm, modules)
            # Kept without the model's tensors: meta stand-ins in their place.
            kept = copy.deepcopy(gm, {i: stand_in for i, (stand_in, _) in own.items()})
            self._keep(key, _Entry(kept, list(roles), list(step_names), list(grads), sites,
                                   list(reads.read), values, outputs, list(own.values())))
        return (traced, found), False

    def _find(self, key, modules) -> _Entry | None:
        with self._lock:
            entries = self._entries.get(key, [])
            for entry in entries:
                if guards.plain_reads(modules, entry.read) == entry.values:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return entry
            self.misses += 1
            return None

    def _keep(self, key, entry: _Entry) -> None:
        with self._lock:
            entries = self._entries.setdefault(key, [])
            entries[:] = [e for e in entries if e.values != entry.values] + [entry]
            self._entries.move_to_end(key)
            while sum(len(v) for v in self._entries.values()) > self.max_entries:
                oldest = next(iter(self._entries))
                self._entries[oldest].pop(0)
                if not self._entries[oldest]:
                    del self._entries[oldest]


TRACES = TraceCache()


def _own_constants(gm, modules: dict) -> dict:
    """The tensors ``gm``'s ``get_attr`` nodes read that are a module's own
    parameter or buffer, by id: (a meta stand-in, (module name, attribute)).
    A trace holds such a tensor itself (make_fx makes a frozen parameter a
    constant of the step), so another model of the structure must get its
    own tensor there, never a copy of the traced model's."""
    owners = {}
    for name, module in modules.items():
        for attr, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None:
                owners.setdefault(id(t), (name, attr))
    out = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = _attribute(gm, node.target)
        where = owners.get(id(t))
        if where is not None and id(t) not in out:
            out[id(t)] = (t.detach().to("meta"), where)
    return out


def _attribute(root, target: str):
    for part in target.split("."):
        root = getattr(root, part)
    return root


def _tensor_of(modules: dict, name: str, attr: str):
    module = modules[name]
    found = module._parameters.get(attr)
    return found if found is not None else module._buffers[attr]


def step_key(model, example_inputs, example_targets, loss_fn, optimizer,
             checked: tuple) -> tuple | None:
    """What a training step's trace is fixed by, beside the attributes its
    code reads (see the module's opening); ``checked``: what ``check_step``
    found it shaped by, with the accumulation and the autocast dtype. None
    where it cannot be told (a hook; an input, target or optimizer option
    that is neither a tensor nor a plain value)."""
    import torch

    structure = guards.model_structure(model, loss_fn)
    if structure is None:
        return None
    examples = []
    for x in (*example_inputs, *example_targets):
        if isinstance(x, torch.Tensor):
            examples.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
                             x.layout))
        else:
            plain = guards.comparable(x)
            if plain is None or plain[0] == "tensor":
                return None
            examples.append(plain)
    options = []
    for group in optimizer.param_groups:
        named = []
        for name, value in sorted(group.items()):
            if name == "params" or isinstance(value, float):
                continue  # numbers are traced as sentinels and put in per graph
            plain = guards.comparable(value)
            if plain is None or plain[0] == "tensor":
                return None
            named.append((name, plain))
        options.append(tuple(named))
    shapes, scaling, layout, clipping, micro_batches, autocast_dtype = checked
    return (structure, type(optimizer), repr(shapes), repr(layout), tuple(options),
            tuple(examples), repr(clipping), micro_batches, str(autocast_dtype), scaling,
            torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))
