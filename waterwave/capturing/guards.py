"""What a captured step took as fixed, checked before every step.

A capture traces the model as it was: in train or eval mode (dropout and
batch norm trace differently), with its parameters and hooks then (and
which parameters require grad: the gradients it computes), outside
or inside ``torch.autocast`` (and with gradients on, as training needs), and
with the Python values its modules' code read (a dropout's ``p``, a scale
kept as an attribute, a flag): the trace holds what they were, and its step
never runs that code again. A step run after any of these changed would
silently train another model than eager PyTorch would. ``StepGuard`` notes
them at capture and raises ``StaleCaptureError`` at the next step when one
changed, naming it and the fix; it never guesses.

Which attributes a trace read is recorded while it runs (``AttributeReads``):
each module's class is swapped for a subclass whose ``__getattribute__``
notes reads of its public instance attributes, and swapped back after.
Only what was read is guarded, so bookkeeping kept on a model (an epoch
count) may change freely. Attributes the code sets before reading them (an
auxiliary loss kept as ``self.aux`` for the loss) are outputs, not
guarded, and put back after the trace (its values are fake tensors); before
each call's captured steps they are set to a ``SetInsideCapturedStep``,
which says so wherever it is used, since the steps do not carry them out
and a value left from before (an evaluation's) would be stale, silently.
One read and then set to a tensor (a running value outside the buffers) is
refused at capture, since no step could carry it on. Values are compared
when they are plain (numbers, strings, None, tuples and lists of them,
dtypes, devices) and tensors by identity; other objects are not compared.

May import: nothing of waterwave; torch lazily.
"""
from __future__ import annotations

import math


class StaleCaptureError(ValueError):
    """The model or the context changed since the step was captured."""


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
         "_state_dict_hooks")


def _autocast(device: str) -> tuple:
    import torch

    if not torch.is_autocast_enabled(device):
        return (False,)
    return (True, str(torch.get_autocast_dtype(device)))


_MISSING = ("missing",)  # an attribute deleted since the capture
_RECORDING: dict[type, type] = {}  # a module class -> its recording subclass


def _plain(value, depth: int = 0):
    """A comparable copy of a plain value, or None where there is none."""
    import torch

    if value is None or isinstance(value, (bool, int, str, bytes, torch.dtype, torch.device)):
        return ("v", value)
    if isinstance(value, float):
        return ("v", "nan" if math.isnan(value) else value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)) and depth < 3 and len(value) <= 64:
        items = tuple(_plain(v, depth + 1) for v in value)
        return None if any(i is None for i in items) else (type(value).__name__, items)
    return None


def comparable(value):
    """``value`` as guards compare it (``_plain``): None where it is not
    plain; ("tensor", id) for a tensor, equal only to itself."""
    return _plain(value)


class _Record:
    """What the modules' code did with their public instance attributes
    while recorded: ``reads`` (module id, name) read before any write;
    ``writes`` (module id, name) -> (module, name, value before, read first)."""

    def __init__(self):
        self.reads: set = set()
        self.writes: dict = {}


def _recording_class(cls: type) -> type:
    """``cls`` with reads and writes of public instance attributes noted in
    the instance's ``_waterwave_reads`` record, made once per class."""
    sub = _RECORDING.get(cls)
    if sub is None:
        base, base_set = cls.__getattribute__, cls.__setattr__

        def __getattribute__(self, name, _base=base):
            value = _base(self, name)
            if name[:1] != "_" and name != "training":
                d = _base(self, "__dict__")
                if name in d:
                    record = d.get("_waterwave_reads")
                    if record is not None and (id(self), name) not in record.writes:
                        record.reads.add((id(self), name))
            return value

        def __setattr__(self, name, value, _set=base_set):
            d = object.__getattribute__(self, "__dict__")
            before = d.get(name, _MISSING)
            _set(self, name, value)
            record = d.get("_waterwave_reads")
            if record is not None and name[:1] != "_" and name in d:
                key = (id(self), name)
                record.writes.setdefault(key, (self, name, before, key in record.reads))
        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__setattr__": __setattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _RECORDING[cls] = sub
    return sub


class SetInsideCapturedStep:
    """What a module attribute that the forward pass (or the loss) sets
    without reading it first holds once captured steps have run: the steps
    compute it inside the step and do not carry it out, where an eager step
    would have left the last one there. Used in any way (an attribute, a
    number, arithmetic, truth), it raises naming the attribute and the fix;
    printed, it says what it is. It copies as itself and pickles as None
    (no value), so that a model saved whole after training loads where
    waterwave is not installed."""

    __slots__ = ("where",)

    def __init__(self, where: str):
        object.__setattr__(self, "where", where)

    def message(self) -> str:
        return (f"{self.where} is set by the forward pass inside the captured training step "
                "(job.train, ConcurrentTrainer.run or an optimize trainer's step), which does "
                "not carry it out of the step: return it from forward() or add it to the loss "
                "to train on it, and read it after a plain eager forward (an evaluation "
                "between train() calls) to see its value")

    def __repr__(self) -> str:
        return f"<{self.where}: set inside the captured step, not carried out>"

    def __getattr__(self, name):
        raise AttributeError(self.message())

    def __setattr__(self, name, value):
        raise AttributeError(self.message())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (type(None), ())

    def __format__(self, spec: str) -> str:
        if spec:
            raise TypeError(self.message())
        return repr(self)

    def _refuse(self, *args, **kwargs):
        raise TypeError(self.message())

    __bool__ = __float__ = __int__ = __index__ = __complex__ = __len__ = __iter__ = _refuse
    __getitem__ = __call__ = __neg__ = __pos__ = __abs__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = _refuse
    __matmul__ = __rmatmul__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


class AttributeReads:
    """``with AttributeReads({name: module, ...}) as reads:`` records the
    public instance attributes the modules' code reads inside the block;
    ``reads.read`` is then a list of (name, attribute) read before the code
    set them. Attributes the code sets (an auxiliary loss kept as
    ``self.aux`` for the loss to read) are put back as they were before the
    block: the trace's values are not real tensors. ``reads.tensor_state``
    lists the attributes it read and then set to a tensor (a running value
    kept outside the buffers), which a captured step cannot carry from step
    to step; ``reads.outputs`` those it set without reading them first, as
    (module, attribute, its marker) for ``mark_outputs``."""

    def __init__(self, modules: dict):
        self.modules = modules
        self.read: list[tuple[str, str]] = []
        self.tensor_state: list[tuple[str, str]] = []
        self.outputs: list[tuple] = []
        self._swapped: list = []
        self._record = _Record()

    def __enter__(self) -> AttributeReads:
        for m in self.modules.values():
            cls = type(m)
            try:
                m.__dict__["_waterwave_reads"] = self._record
                m.__class__ = _recording_class(cls)
            except (TypeError, AttributeError):  # a class that cannot be swapped: not recorded
                m.__dict__.pop("_waterwave_reads", None)
                continue
            self._swapped.append((m, cls))
        return self

    def __exit__(self, *exc) -> None:
        import torch

        for m, cls in self._swapped:
            m.__class__ = cls
            m.__dict__.pop("_waterwave_reads", None)
        names = {id(m): name for name, m in self.modules.items()}
        record = self._record
        for (i, attr), (m, name, before, read_first) in record.writes.items():
            if read_first and isinstance(m.__dict__.get(name), torch.Tensor) and i in names:
                self.tensor_state.append((names[i], attr))
            if not read_first and i in names:
                where = f"module {names[i]}'s attribute" if names[i] else "the model's attribute"
                self.outputs.append((m, name, SetInsideCapturedStep(f"{where} {attr!r}")))
            if before is _MISSING:
                m.__dict__.pop(name, None)
            else:
                m.__dict__[name] = before
        self.read = sorted((names[i], attr) for i, attr in record.reads if i in names)
        self.tensor_state.sort()


def mark_outputs(outputs) -> None:
    """Before a call's captured steps: each attribute the step's code sets
    (``AttributeReads.outputs``) to a ``SetInsideCapturedStep``, as the
    steps leave no value of theirs there."""
    for module, name, marker in outputs:
        module.__dict__[name] = marker


def guarded_modules(model, loss_fn=None) -> dict:
    """The modules whose attributes a step's code reads: the model's, and
    the loss's when it is a module."""
    import torch

    modules = dict(model.named_modules())
    if isinstance(loss_fn, torch.nn.Module):
        modules.update({"loss_fn" + ("." + n if n else ""): m
                        for n, m in loss_fn.named_modules()})
    return modules


class StepGuard:
    """What a step traced from ``model`` (and ``loss_fn``) took as fixed,
    read at capture; ``check`` compares the model with it before each call
    or step, in one walk over its modules (it runs per step under
    ``optimize``, so it is kept to identity and equality tests)."""

    def __init__(self, model, device: str, read: list[tuple[str, str]] = (), loss_fn=None):
        """``read``: the module attributes the trace read (``AttributeReads``)."""
        self.device = device
        walk = _Walk(model)
        self.module_ids, self.names = walk.module_ids, walk.names
        self.training = walk.training  # ((module name, training), ...): the capture's modes
        self.parameters, self.keys, self.layouts = walk.parameters, walk.keys, walk.layouts
        self.requires_grad = walk.requires_grad  # which parameters the step trains
        self.hooks, self.global_hooks = walk.hooks, _global_hooks()
        self.autocast = _autocast("cuda" if device == "cuda" else "cpu")
        modules = guarded_modules(model, loss_fn)
        self.attributes = []  # (where, attribute, module, value then, its comparable copy)
        for name, attr in read:
            m = modules[name]
            value = m.__dict__.get(attr, _MISSING)
            frozen = _MISSING if value is _MISSING else _plain(value)
            if frozen is not None:
                self.attributes.append((name, attr, m, value, frozen))

    def check(self, model) -> list:
        """Raise ``StaleCaptureError`` if what the capture took as fixed changed,
        or if gradients are off where the step is asked for. Returns the
        model's buffers now, in the step's order."""
        import torch

        if not torch.is_grad_enabled():
            raise StaleCaptureError(
                "gradients are off here (inside torch.no_grad() or torch.inference_mode()): "
                "an eager step could not backpropagate, and a captured one would train anyway: "
                "call train() or step() outside them")
        walk = _Walk(model)
        remake = "make a new Job (or waterwave.optimize) for the model as it is now"
        if walk.module_ids != self.module_ids:
            if walk.names != self.names:
                raise StaleCaptureError(f"the model's modules were added or removed since the "
                                        f"step was captured: {remake}")
            name = next(n for n, a, b in zip(self.names, self.module_ids, walk.module_ids)
                        if a != b)
            raise StaleCaptureError(f"module {name or 'the model'} was replaced since the step "
                                    f"was captured, which runs the modules it traced: {remake}")
        if walk.training != self.training:
            then = dict(self.training)
            name, mode = next((n, t) for n, t in walk.training if then.get(n) != t)
            was = "train" if then.get(name) else "eval"
            now = "train" if mode else "eval"
            raise StaleCaptureError(
                f"module {name or 'the model'} is in {now} mode; the step was captured in {was} "
                f"mode, which fixes what dropout and batch norm do: call model.{was}() before "
                f"training, or {remake}")
        if walk.keys != self.keys:
            raise StaleCaptureError("the model's parameters or buffers were added or removed "
                                    f"since the step was captured: {remake}")
        if walk.layouts != self.layouts:
            i, was, now = next((i, a, b) for i, (a, b) in enumerate(zip(self.layouts,
                                                                        walk.layouts)) if a != b)
            name = f"{self.keys[i][2]} {_key_name(self.names, self.keys[i])}"
            raise StaleCaptureError(
                f"{name} is {_layout(now)} now; the step was captured with it {_layout(was)} "
                "(model.to(), .double() or .half() changed it in place), and a captured step's "
                f"operators are made for those: {remake}")
        if walk.parameters != self.parameters:
            raise StaleCaptureError("the model's parameters are not those the step was captured "
                                    "with (one was replaced), and its optimizer trains those: "
                                    f"{remake}")
        if walk.requires_grad != self.requires_grad:
            i = next(i for i, (a, b) in enumerate(zip(self.requires_grad, walk.requires_grad))
                     if a != b)
            name = _key_name(self.names, self.keys[walk.parameter_keys[i]])
            now = "requires grad" if walk.requires_grad[i] else "is frozen (requires_grad=False)"
            then = "frozen" if walk.requires_grad[i] else "trained"
            raise StaleCaptureError(
                f"parameter {name} {now} now; the step was captured with it {then}, and a "
                f"captured step computes the gradients it traced: set requires_grad back, or "
                f"{remake}")
        if walk.hooks != self.hooks or _global_hooks() != self.global_hooks:
            raise StaleCaptureError("module hooks changed since the step was captured (a captured "
                                    f"step runs the hooks it traced, no others): {remake}")
        if walk.gradient_hooks:
            raise StaleCaptureError(
                f"parameter {walk.gradient_hooks} has a gradient hook now (register_hook or "
                "register_post_accumulate_grad_hook), which a captured step does not run: "
                "remove it, and change the gradient in the loss or the model")
        for name, attr, m, then, frozen in self.attributes:
            value = m.__dict__.get(attr, _MISSING)
            if value is then and type(then) is not list:  # the same immutable value
                continue
            if (_MISSING if value is _MISSING else _plain(value)) != frozen:
                where = f"{name}.{attr}" if name else f"the model's {attr}"
                shown = "deleted" if value is _MISSING else repr(value)
                raise StaleCaptureError(
                    f"{where} is {shown} now; it was {_shown(frozen)} when the step was "
                    "captured, and a captured step runs the values its trace read (the "
                    "module's Python code does not run again): set it before making the "
                    f"Job, or {remake}")
        autocast = _autocast("cuda" if self.device == "cuda" else "cpu")
        if autocast != self.autocast:
            raise StaleCaptureError(
                f"torch.autocast is {'on' if autocast[0] else 'off'} here and was "
                f"{'on' if self.autocast[0] else 'off'} when the step was captured; a captured "
                "step runs in the precision it traced: train outside autocast and give the Job "
                "autocast_dtype= (its forward pass then runs inside autocast, as eager code's)")
        return walk.buffers


def model_structure(model, loss_fn=None) -> tuple | None:
    """What two models must share for one trace to serve both: each
    module's name, class and mode, each parameter's and buffer's place,
    dtype, shape, strides, device and whether it is trained, and the loss's modules
    likewise (a loss function: itself). None where a hook (a module's, a
    parameter's or a global one) makes the model's trace its own."""
    import torch

    parts = []
    for what in (model, loss_fn):
        if what is None or not isinstance(what, torch.nn.Module):
            parts.append(what)
            continue
        walk = _Walk(what)
        if walk.hooks or walk.gradient_hooks:
            return None
        # Strides too: a channels-last weight traces other copies than a contiguous one.
        strides = tuple(t.stride() for t in (*what.parameters(), *what.buffers()))
        parts.append((walk.names, tuple(type(m) for _, m in what.named_modules()),
                      walk.training, walk.keys, walk.layouts, strides, walk.requires_grad))
    if _global_hooks():
        return None
    return tuple(parts)


def plain_reads(modules: dict, read: list[tuple[str, str]]) -> tuple | None:
    """The values of the attributes a trace read (``AttributeReads.read``)
    in ``modules`` as comparable copies, or None where one is not plain or
    is a tensor: then only that model's own step may run the trace."""
    out = []
    for name, attr in read:
        m = modules.get(name)
        if m is None:
            return None
        value = m.__dict__.get(attr, _MISSING)
        frozen = _MISSING if value is _MISSING else _plain(value)
        if frozen is None or frozen[0] == "tensor":
            return None
        out.append(frozen)
    return tuple(out)


class _Walk:
    """One walk over a model's modules, in ``named_modules`` order, and
    their parameters and buffers as ``named_parameters`` and
    ``named_buffers`` list them (each tensor once)."""

    def __init__(self, model):
        modules = list(model.named_modules())
        self.names = tuple(n for n, _ in modules)
        self.module_ids = tuple(id(m) for _, m in modules)
        self.training = tuple((n, m.training) for n, m in modules)
        hooks, keys, layouts, params, buffers, seen = [], [], [], [], [], set()
        for i, (_, m) in enumerate(modules):
            d = m.__dict__
            n = sum(len(d.get(h, ())) for h in HOOKS)
            if n:
                hooks.append((i, n))
            for kind, tensors, out in (("parameter", d["_parameters"], params),
                                       ("buffer", d["_buffers"], buffers)):
                for key, t in tensors.items():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    out.append(t)
                    keys.append((i, key, kind))
                    layouts.append((t.dtype, t.shape, t.device))
        self.hooks, self.keys, self.layouts = tuple(hooks), tuple(keys), tuple(layouts)
        self.parameters = tuple(id(p) for p in params)
        self.requires_grad = tuple(p.requires_grad for p in params)
        # where each parameter's key is in ``keys``
        self.parameter_keys = tuple(i for i, k in enumerate(keys) if k[2] == "parameter")
        # The first parameter with a gradient hook of its own, by name (or "")
        hooked = next((i for i, p in zip(self.parameter_keys, params)
                       if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)),
                      None)
        self.gradient_hooks = "" if hooked is None else _key_name(self.names, keys[hooked])
        self.buffers = buffers


def _key_name(names: tuple, key: tuple) -> str:
    """A parameter's or buffer's name in the model (``0.weight``) from its
    key in ``_Walk.keys``."""
    module, attr, _ = key
    return f"{names[module] + '.' if names[module] else ''}{attr}"


def _global_hooks() -> int:
    import torch.nn.modules.module as nn_module

    return (len(nn_module._global_forward_hooks) + len(nn_module._global_forward_pre_hooks)
            + len(nn_module._global_backward_hooks))


def _shown(frozen) -> str:
    """A comparable value (``_plain``) as the user wrote it."""
    kind, value = frozen[0], frozen[1] if len(frozen) > 1 else None
    if kind == "v":
        return "nan" if value == "nan" else repr(value)
    if kind == "tensor":
        return "another tensor"
    if kind == "missing":
        return "missing"
    items = ", ".join(_shown(v) for v in value)
    return f"({items}{',' if len(value) == 1 else ''})" if kind == "tuple" else f"[{items}]"


def _layout(layout) -> str:
    dtype, shape, device = layout
    return f"{str(dtype).removeprefix('torch.')} of shape {list(shape)} on {device}"
